"""Synthetic keys, values and queries for testing the tiered cache at its own size: the tiny model's geometry,
no checkpoint, and a dense float64 reference attention to compare with."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache.config import TieredCacheConfig
from flashmemory.kvcache.interface import ForwardBatch, KVCache

LAYERS, HEADS, KV_HEADS, DIM = 2, 4, 2, 16  # the tiny test model's geometry (tests/helpers.py)


# Every other KV setting is the product's default (KVSettings: FP16 recent rows, 4-key digest
# boxes, the L1 fraction), so the cache under test is the one users run. These scale it down to
# the tiny model: 8-token blocks, two blocks each of L0 and L1, so that a test of a few dozen
# tokens reaches every level.
TINY_SETTINGS = dict(block_size=8, active_window=16, warm_tokens=16)


def skip_without_native(cache: KVCache, backend: str) -> None:
    """Skip a test of the native backend where the kernel cannot be built (no C compiler)."""
    if backend == "native" and cache.attention.name != "native":
        pytest.skip("no C compiler: the native kernel cannot be built here")


def tiny_config(**overrides) -> TieredCacheConfig:
    """The tiny model's cache, 64 slots a level; `overrides` change settings or geometry."""
    geometry = dict(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, device_slots=64,
                    host_slots=64, disk_slots=64)
    return TieredCacheConfig(**{**geometry, **TINY_SETTINGS, **overrides})


QWEN_GEOMETRY = dict(layers=3, heads=14, kv_heads=2, dim=64)  # Qwen2.5-0.5B's heads (fewer layers, for speed)


class SyntheticSequence:
    """Deterministic q, k, v per layer and token of one sequence, and the dense reference attention over them."""

    def __init__(self, seq_id: int, num_tokens: int, seed: int = 0, layers: int = LAYERS, heads: int = HEADS,
                 kv_heads: int = KV_HEADS, dim: int = DIM) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seq_id = seq_id
        self.layers, self.heads, self.kv_heads, self.dim = layers, heads, kv_heads, dim
        self.q = torch.randn(layers, num_tokens, heads, dim, generator=g)
        # Keys with a per-channel offset, as real keys have, so a block's min/max box means something.
        self.k = torch.randn(layers, num_tokens, kv_heads, dim, generator=g) + torch.randn(layers, 1, kv_heads, dim,
                                                                                           generator=g)
        self.v = torch.randn(layers, num_tokens, kv_heads, dim, generator=g)

    def forward(self, cache: KVCache, start: int, end: int) -> torch.Tensor:
        """Feed tokens [start, end) through every layer and commit; the attention outputs [layers, n, heads, D]."""
        batch = ForwardBatch.build([(self.seq_id, start, end - start)], torch.device("cpu"))
        out = torch.stack([cache.attend(layer, batch, self.q[layer, start:end], self.k[layer, start:end],
                                        self.v[layer, start:end]) for layer in range(self.layers)])
        cache.commit(batch)
        return out

    def reference(self, start: int, end: int) -> torch.Tensor:
        """Causal attention of tokens [start, end) over every earlier token, float64 over fp16-rounded K/V."""
        out = torch.empty(self.layers, end - start, self.heads, self.dim, dtype=torch.float64)
        group = self.heads // self.kv_heads
        for layer in range(self.layers):
            k = self.k[layer, :end].half().double().repeat_interleave(group, dim=1)  # [T, heads, D]
            v = self.v[layer, :end].half().double().repeat_interleave(group, dim=1)
            q = self.q[layer, start:end].double()
            scores = torch.einsum("nhd,thd->hnt", q, k) * self.dim**-0.5
            visible = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]  # [n, T]
            scores = scores.masked_fill(~visible, float("-inf"))
            out[layer] = torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), v)
        return out
