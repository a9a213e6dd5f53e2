"""Prompt hints and the budget floor: what a prompt's question points to is read at every decode step, and a
short history is never cut to a block or two."""

from __future__ import annotations

import torch

from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.read.hints import boost_hints, prompt_hints
from flashmemory.kvcache.read.reader import BlockReader
from flashmemory.kvcache.read.selection import key_digest, top_blocks
from tests.kvcache.synthetic import tiny_config


def test_the_block_matching_the_prompts_last_queries_is_hinted():
    torch.manual_seed(0)
    keys = torch.randn(2, 30, 8, 16)  # [kv heads, blocks, tokens, D]
    q = torch.randn(20, 4, 16)  # a prefill chunk: 20 tokens, 2 query heads per KV head
    keys[:, 11, 3] = q[-1].view(2, 2, 16)[:, 0] * 4  # block 11 holds a key the last token's query matches
    indices = torch.arange(100, 130)  # logical indices of the level's blocks
    hints = prompt_hints(q, key_digest(keys), indices, k=3)
    assert hints.shape == (2, 3) and (hints == 111).any(dim=1).all()


def test_hinted_blocks_are_chosen_whatever_the_decode_query_scores():
    scores = torch.tensor([[5.0, 4.0, 3.0, -9.0, 2.0], [1.0, 2.0, 3.0, 4.0, -7.0]])
    indices = torch.tensor([10, 11, 12, 13, 14])
    hints = torch.tensor([[13], [14]])  # logical blocks, the worst-scored of each head
    chosen = top_blocks(boost_hints(scores, indices, hints), budget=2)
    assert chosen.tolist() == [[0, 3], [3, 4]]
    gone = torch.tensor([[99], [99]])  # a hinted block no longer on this level changes nothing
    assert top_blocks(boost_hints(scores, indices, gone), 2).tolist() == top_blocks(scores, 2).tolist()


def test_a_short_history_reads_at_least_the_floor(tmp_path):
    cfg = tiny_config(semantic_truncate_threshold=0.15, warm_budget_tokens=8, selection_min_tokens=40)
    reader = BlockReader(cfg, None, {}, {}, [])  # budgets need only the config
    assert reader.budget(Level.DISK, 20) == 5  # 15 % of 20 blocks is 3; the floor is 40 tokens = 5 blocks
    assert reader.budget(Level.HOST, 20) == 5
    assert reader.budget(Level.DISK, 4) == 4  # never more than there is
    assert reader.budget(Level.DISK, 100) == 15
    off = BlockReader(tiny_config(semantic_truncate_threshold=0.15, selection_min_tokens=0), None, {}, {}, [])
    assert off.budget(Level.DISK, 20) == 3


def test_l1_reads_at_most_its_fraction_and_the_token_cap():
    cfg = tiny_config(warm_budget_tokens=64, warm_budget_fraction=0.25, selection_min_tokens=0)
    reader = BlockReader(cfg, None, {}, {}, [])
    block = cfg.block_size
    assert reader.budget(Level.HOST, 20) == 5  # a quarter of a short L1
    assert reader.budget(Level.HOST, 23) == 5  # at most a quarter: rounded down
    assert reader.budget(Level.HOST, 1000) == 64 // block  # the token cap at a long one
    floored = BlockReader(tiny_config(warm_budget_tokens=64, warm_budget_fraction=0.25, selection_min_tokens=8 * block),
                          None, {}, {}, [])
    assert floored.budget(Level.HOST, 20) == 8  # the floor still holds under the fraction


class _Chosen:
    """A choice observer keeping, per decode step and layer, the logical blocks each KV head read from L1."""

    def __init__(self) -> None:
        self.rows: list[list[set[int]]] = []

    def on_choose(self, choice) -> None:
        self.rows.append([set(choice.indices[row].tolist()) for row in choice.chosen.cpu()])

    def on_step_end(self, seq_id: int) -> None: ...

    def on_step_abort(self, seq_id: int) -> None: ...


def _decode_choices(prompt_tokens: int, planted: int) -> list[list[set[int]]]:
    from flashmemory.kvcache.tiered import TieredKVCache
    from tests.kvcache.synthetic import SyntheticSequence

    cache = TieredKVCache(tiny_config(kv_precision="fp16", cold_zone_enabled=False, warm_budget_tokens=8,
                                      selection_min_tokens=0, selection_prompt_tokens=prompt_tokens))
    seq = SyntheticSequence(0, 90, seed=4)
    group = seq.heads // seq.kv_heads
    for layer in range(seq.layers):  # a key the prompt's last token asks for, of an ordinary size
        seq.k[layer, planted] = seq.q[layer, 69].view(seq.kv_heads, group, -1)[:, 0] * 1.0
    observer = _Chosen()
    cache.choice_observers.append(observer)
    cache.add_sequence(0)
    seq.forward(cache, 0, 40)
    seq.forward(cache, 40, 70)  # the last prefill chunk: its final queries set the hints
    for t in range(70, 90):
        seq.forward(cache, t, t + 1)
    cache.close()
    return observer.rows


def test_decode_steps_read_the_block_the_prompt_asked_for():
    planted_block = 20 // 8
    hinted = _decode_choices(prompt_tokens=8, planted=20)
    assert hinted and all(planted_block in head for heads in hinted for head in heads)  # every step, layer, head
    plain = _decode_choices(prompt_tokens=0, planted=20)
    assert not all(planted_block in head for heads in plain for head in heads)  # one block alone misses it


def test_a_hint_gone_from_the_level_next_to_a_hinted_last_block_keeps_it_hinted():
    scores = torch.tensor([[3.0, 2.0, 1.0]])
    indices = torch.tensor([4, 5, 6])
    boosted = boost_hints(scores, indices, torch.tensor([[6, 9]]))  # 9 is past the end: it lands on 6 too
    assert boosted[0, 2] == float("inf") and boosted[0, :2].tolist() == [3.0, 2.0]
