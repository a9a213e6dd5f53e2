"""Synthetic keys, values and queries for testing the tiered cache at its own size: the tiny model's geometry,
no checkpoint, and a dense float64 reference attention to compare with."""

from __future__ import annotations

import dataclasses

import torch

from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.interface import ForwardBatch, KVCache

LAYERS, HEADS, KV_HEADS, DIM = 2, 4, 2, 16  # the tiny test model's geometry (tests/helpers.py)


def tiny_config(**overrides) -> TieredCacheConfig:
    base = TieredCacheConfig(LAYERS, KV_HEADS, DIM, device_slots=64, host_slots=64, disk_slots=64, block_size=8,
                             active_window=16, warm_tokens=16, max_num_seqs=3)
    return dataclasses.replace(base, **overrides)


class SyntheticSequence:
    """Deterministic q, k, v per layer and token of one sequence, and the dense reference attention over them."""

    def __init__(self, seq_id: int, num_tokens: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seq_id = seq_id
        self.q = torch.randn(LAYERS, num_tokens, HEADS, DIM, generator=g)
        # Keys with a per-channel offset, as real keys have, so a block's min/max box means something.
        self.k = torch.randn(LAYERS, num_tokens, KV_HEADS, DIM, generator=g) + torch.randn(LAYERS, 1, KV_HEADS, DIM,
                                                                                           generator=g)
        self.v = torch.randn(LAYERS, num_tokens, KV_HEADS, DIM, generator=g)

    def forward(self, cache: KVCache, start: int, end: int) -> torch.Tensor:
        """Feed tokens [start, end) through every layer and commit; the attention outputs [layers, n, heads, D]."""
        batch = ForwardBatch.build([(self.seq_id, start, end - start)], torch.device("cpu"))
        out = torch.stack([cache.attend(layer, batch, self.q[layer, start:end], self.k[layer, start:end],
                                        self.v[layer, start:end]) for layer in range(LAYERS)])
        cache.commit(batch)
        return out

    def reference(self, start: int, end: int) -> torch.Tensor:
        """Causal attention of tokens [start, end) over every earlier token, float64 over fp16-rounded K/V."""
        out = torch.empty(LAYERS, end - start, HEADS, DIM, dtype=torch.float64)
        group = HEADS // KV_HEADS
        for layer in range(LAYERS):
            k = self.k[layer, :end].half().double().repeat_interleave(group, dim=1)  # [T, heads, D]
            v = self.v[layer, :end].half().double().repeat_interleave(group, dim=1)
            q = self.q[layer, start:end].double()
            scores = torch.einsum("nhd,thd->hnt", q, k) * DIM**-0.5
            visible = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]  # [n, T]
            scores = scores.masked_fill(~visible, float("-inf"))
            out[layer] = torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), v)
        return out
