"""Speculative decoding: a proposer drafts tokens (a smaller model, its tokens bridged where its
tokenizer is another, or prompt lookup), the target reads the last token and the drafts in one
forward as its decode steps would (KVCache.max_decode_rows), keeps the drafts it agrees with and
its own next token, and every cache forgets the rest. Greedy output is the target's own; sampled
output keeps its distribution (speculative rejection sampling)."""
