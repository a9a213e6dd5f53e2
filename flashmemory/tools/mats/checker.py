"""ShadowChecker: compares what a KV level serves with the shadow copy of what was written.

FP16 levels must give back the written bytes exactly. A quantized level must decode to within the codec's own
error bound (bounds.py) of what was written, and its stored parts must equal the codec's encoding of the written
block: every copy on a level is encoded from the FP16 master copy (new blocks, promotions and demotions to L2
alike), so a bit flipped anywhere in a record, even in a scale's last bit, shows.
"""

from __future__ import annotations

import torch

from flashmemory.kvcache.manager.blocks import Level, level_label
from flashmemory.kvcache.quant import Codec, Parts
from flashmemory.kvcache.tiered import TieredKVCache
from flashmemory.tools.mats.bounds import kv_error_bound
from flashmemory.tools.mats.report import ErrorLog, LevelTally
from flashmemory.tools.mats.shadow import ShadowSequence


def level_name(level: int) -> str:
    return level_label(level)


class ShadowChecker:
    """Owns the per-level read tallies; checks served parts against the shadow sequences it is given."""

    def __init__(self, cache: TieredKVCache, shadows: dict[int, ShadowSequence], errors: ErrorLog,
                 tallies: dict[str, LevelTally]) -> None:
        self.cache = cache
        self.shadows = shadows  # seq_id -> shadow, shared with the driver (it adds and removes sequences)
        self.errors = errors
        self.tallies = tallies

    def owners(self, level: Level) -> dict[int, tuple[int, int]]:
        """Slot -> (seq_id, block index) of every block with a copy on `level`, now."""
        out = {}
        for seq_id, table in self.cache.blocks.tables.items():
            for index, block in enumerate(table.blocks):
                slot = block.slots.get(level)
                if slot is not None:
                    out[slot] = (seq_id, index)
        return out

    def check(self, level: Level, seq_id: int, index: int, parts: Parts, layer: int | None, what: str,
              head: int | None = None) -> bool:
        """Parts of block `index` of the sequence as served from `level`: one layer ([kv_heads, ...]; one KV head's
        record, [...], with `head`) or, with layer None, every layer ([layers, kv_heads, ...]). Counts the read;
        logs and returns False on a mismatch."""
        tally = self.tallies.setdefault(level_name(level), LevelTally())
        k, v = self.shadows[seq_id].block(index)  # [layers, kv_heads, block_size, D]
        if layer is not None:
            k, v = k[layer], v[layer]
            if head is not None:
                k, v = k[head], v[head]
        codec = self.cache.codecs[level]
        nbytes = sum(t.numel() * t.element_size() for t in parts.values())
        problem, ratio = compare(codec, {name: t.cpu() for name, t in parts.items()}, k, v)
        tally.add_read(nbytes, ratio)
        if problem is None:
            return True
        tally.errors += 1
        where = f"layer {layer}" if layer is not None else "every layer"
        where += f", KV head {head}" if head is not None else ""
        self.errors.add("wrong read", f"{what}: sequence {seq_id} block {index} ({where}) on {level_name(level)}: "
                                      f"{problem}")
        return False

    def check_layer(self, level: Level, slots: list[int], parts: Parts, layer: int, what: str,
                    owners: dict[int, tuple[int, int]] | None = None) -> int:
        """A layer read of several slots (parts [kv_heads, len(slots), ...]); returns the number of wrong reads."""
        owners = self.owners(level) if owners is None else owners
        wrong = 0
        for j, slot in enumerate(slots):
            owner = owners.get(slot)
            if owner is None:
                self.errors.add("stale read", f"{what}: {level_name(level)} slot {slot} was served but no live block "
                                              "holds it")
                wrong += 1
                continue
            wrong += not self.check(level, *owner, {name: t[:, j] for name, t in parts.items()}, layer, what)
        return wrong


def compare(codec: Codec, parts: Parts, k: torch.Tensor, v: torch.Tensor) -> tuple[str | None, float]:
    """(what is wrong or None, worst |decoded - written| / bound) for parts holding k, v [..., block_size, D]."""
    if codec.bits == 16:
        expected = torch.stack((k, v), dim=-3)  # [..., 2, block_size, D], the "kv" part's layout
        if torch.equal(parts["kv"], expected):
            return None, 0.0
        differing = int((parts["kv"] != expected).sum())
        return f"{differing} of {expected.numel()} FP16 values differ from what was written", 0.0
    decoded = codec.decode(parts, torch.float32).double()  # [2, ..., block_size, D]
    written = torch.stack((k, v)).double()
    bound = kv_error_bound(k, v, codec.bits, codec.key_group_tokens, codec.value_group_channels, codec.key_shrink,
                           codec.value_shrink)
    error = (decoded - written).abs()
    ratio = float((error / bound).max())
    if bool((error > bound).any()):
        beyond = int((error > bound).sum())
        return (f"{beyond} values beyond the INT{codec.bits} bound (worst {ratio:.2f} x the bound, "
                f"|error| up to {float(error.max()):.4g})"), ratio
    encoded = codec.encode(k, v)
    for name, tensor in encoded.items():
        if not torch.equal(parts[name], tensor):
            return f"its INT{codec.bits} part '{name}' differs from the encoding of what was written", ratio
    return None, ratio
