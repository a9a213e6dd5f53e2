"""TensorPool's reads that only an in-memory level has: one layer with every KV head its own
slots, and (FP16) the keys alone."""

from __future__ import annotations

import torch

from flashmemory.kvcache.config import level_codecs
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.manager.blocks import Level

LAYERS, HEADS, BS, DIM, SLOTS = 3, 2, 8, 16, 5


def test_keys_per_head_are_the_stored_keys_of_each_head_s_own_slots():
    codec = level_codecs("mixed", BS, DIM)[Level.HOST]  # FP16
    pool = TensorPool(Level.HOST, codec, SLOTS, LAYERS, HEADS, BS, DIM, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(SLOTS, LAYERS, HEADS, BS, DIM, generator=g)
    for slot in range(SLOTS):
        pool.put(slot, codec.encode(k[slot], -k[slot]))
    slots = torch.tensor([[4, 0, 2], [1, 1, 3]])  # [heads, n]
    keys = pool.get_layer_keys_per_head(slots, layer=1)
    assert keys.shape == (HEADS, 3, BS, DIM) and keys.dtype == torch.float16
    for h in range(HEADS):
        for i, slot in enumerate(slots[h].tolist()):
            assert torch.equal(keys[h, i], k[slot, 1, h].half())
    whole = codec.decode(pool.get_layer_per_head(slots, layer=1), torch.float16)
    assert torch.equal(whole[0], keys) and torch.equal(whole[1], -keys)  # K, then V
