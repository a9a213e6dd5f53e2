"""SpeculativeSettings: how the engine drafts tokens for the target model to verify (a draft model,
or prompt lookup), declared once with each field's Setting. EngineConfig includes them. Stdlib
only."""

from __future__ import annotations

from dataclasses import dataclass

from flashmemory.settings import setting

# One verification forward carries the sequence's last token and its drafts; the native GEMV takes
# 8 rows of activations in one call (quant_kernels.MAX_X_ROWS, FM_MAX_X), and more rows would go
# through prefill's dequantized GEMM, whose sums round otherwise than the decode steps' GEMV.
MAX_SPECULATIVE_TOKENS = 7


@dataclass
class SpeculativeSettings:
    """Speculative decoding: a proposer drafts tokens, the target verifies them in one forward."""

    speculative_method: str = setting(
        "auto", "who drafts the tokens the target verifies: auto (the draft model when "
        "draft_model_path is set, else none), draft (draft_model_path), ngram (prompt lookup: "
        "the tokens that followed the last earlier occurrence of the newest n-gram) or off",
        choices=("auto", "draft", "ngram", "off"))
    draft_model_path: str | None = setting(
        None, "GGUF file or HF safetensors folder of a smaller model "
        "that drafts tokens; None = no draft model", flags=("--draft-model", "--model-draft"))
    num_speculative_tokens: int = setting(
        4, "tokens drafted per decode step at most (fewer near the end of a KV block, of "
        "max_tokens or of the context); at most 7, so one verification forward stays on the "
        "decode kernels", unit="tokens", ge=1, le=MAX_SPECULATIVE_TOKENS,
        flags=("--num-speculative-tokens", "--draft-max"))
    speculative_adaptive: bool = setting(
        True, "draft fewer tokens for a sequence whose drafts the target keeps less often (each "
        "step at most num_speculative_tokens times the sequence's recent acceptance, at least "
        "one); off (--no-speculative-adaptive): always num_speculative_tokens", negatable=True)
    speculative_cost_aware: bool = setting(
        True, "with speculative_adaptive: draft the number of tokens that the measured step costs "
        "(the target's one-token step, each verified row past it, the proposer's time per draft) "
        "and the sequence's acceptance say emits tokens fastest, none while plain decoding is "
        "faster (every 16th step re-measures the other way); timed on steps that decode one "
        "sequence alone; off (--no-speculative-cost-aware): by acceptance only", negatable=True)
    prompt_lookup_max: int = setting(
        4, "longest n-gram prompt lookup matches (tried first)", unit="tokens", ge=1)
    prompt_lookup_min: int = setting(
        2, "shortest n-gram prompt lookup matches; at most prompt_lookup_max", unit="tokens", ge=1)
