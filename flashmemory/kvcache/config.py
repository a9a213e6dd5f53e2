"""TieredCacheConfig: the KV settings (kv_settings.py) and what start-up derives from them: the
hierarchy's shape (slot counts per level), the device, the model's fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

import torch

from flashmemory.errors import ConfigError
from flashmemory.kv_settings import KVSettings
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.manager.hierarchy import (BITS_OF, LevelSpec, as_level, built_in_spec,
                                                   extra_spec, parse_kv_levels)
from flashmemory.kvcache.manager.policy import PLACEMENT_POLICIES, LocalityPolicy, PlacementPolicy
from flashmemory.kvcache.quant import Codec

# Bits on L0, L1, L2. "mixed" kept INT2 on L2 (the seeds' hierarchy) until INT2 there was found to
# be the largest loss at 32K (docs/long/README.md): it is INT4 there now, the same as "int4" (kept
# for configurations that name it); "int2-disk" is the seeds' INT4 / FP16 / INT2.
PRECISIONS = {"fp16": (16, 16, 16), "int4": (4, 16, 4), "mixed": (4, 16, 4),
              "int2-disk": (4, 16, 2)}
VALUE_GROUP_CHANNELS = 32  # channels sharing one per-token scale/zero of the values (capped by head_dim)
MIB = 2**20


def level_codecs(kv_precision: str, block_size: int, head_dim: int, quant_range: str = "mse") -> dict[Level, Codec]:
    """The codec of every built-in level for a precision: keys grouped per block, values per 32
    channels."""
    return {level: _codec(bits, block_size, head_dim, quant_range)
            for level, bits in zip(Level, PRECISIONS[kv_precision])}


def hierarchy_codecs(levels: tuple[LevelSpec, ...], block_size: int, head_dim: int,
                     quant_range: str = "mse") -> dict[int, Codec]:
    """The codec of every level of a hierarchy, by level."""
    return {as_level(i): _codec(spec.bits, block_size, head_dim, quant_range)
            for i, spec in enumerate(levels)}


def _codec(bits: int, block_size: int, head_dim: int, quant_range: str) -> Codec:
    return Codec(bits, block_size, min(VALUE_GROUP_CHANNELS, head_dim), quant_range)


KV_DTYPE = torch.float16  # the unquantized KV storage type (the newest block, L1, the "fp16" precision)


# NOTE: kw_only: the derived fields have no defaults, and the settings before them do.
@dataclass(kw_only=True)
class TieredCacheConfig(KVSettings):
    """The KV settings plus what start-up derives from them and the model: geometry, slot
    counts (one slot = one block of every layer), device, fingerprint; no setting again."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    device_slots: int
    host_slots: int
    disk_slots: int
    num_sink_blocks: int = 1  # first blocks pinned to L0 (attention sinks)
    model_fingerprint: bytes = b""
    # NOTE: EngineConfig.device is the user's spelling ("auto", "cuda:1"); this, what it became.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    vocab_size: int = 0  # the model's: token ids read back from a persistent index are below it
    level_media: dict[int, str] = field(default_factory=dict)  # a level's medium, over kv_levels

    def __post_init__(self) -> None:
        super().__post_init__()  # the KV settings' bounds and rules, as EngineConfig checks them
        if not isinstance(self.block_size, int):
            raise ConfigError(f"block_size={self.block_size!r}: the cache needs a number of "
                              "tokens; resolve 'auto' first (EngineConfig.resolve_block_size)")
        box = self.selection_box_tokens
        if 0 < box < self.block_size and self.block_size % box:
            raise ConfigError(f"selection_box_tokens={box} does not divide block_size={self.block_size}: choose a "
                              f"divisor of the block (e.g. {self.block_size // 2}) or 0 for one box per block")

    @property
    def digest_boxes(self) -> int:
        """Boxes per block in the selection digest (read/selection.py's key_digest)."""
        box = self.selection_box_tokens
        return self.block_size // box if 0 < box < self.block_size else 1

    @property
    def digest_box_tokens(self) -> int:
        """Keys per box of the selection digest (the block's own size with one box)."""
        return self.block_size // self.digest_boxes

    def prefix_namespace(self) -> bytes:
        """What a block's name depends on besides its tokens: the model, every level's precision and how it rounds,
        the block size, the digest's boxes (persisted digests are kept with the blocks)."""
        settings = (f"|{self.kv_precision}|{self.kv_quant_range}|boxes={self.digest_boxes}|{self.block_size}|"
                    f"{self.num_layers}x{self.num_kv_heads}x{self.head_dim}")
        return hashlib.sha256(b"flashmemory-kv-v1|" + self.model_fingerprint + settings.encode()).digest()

    def hierarchy(self) -> tuple[LevelSpec, ...]:
        """The levels in order: L0, L1 and (with the cold zone) L2 from their settings, then the
        levels kv_levels adds, each sized from its MiB; ConfigError for a malformed kv_levels."""
        built_in = 3 if self.cold_zone_enabled else 2
        listed = parse_kv_levels(self.kv_levels, built_in)
        afters = [extra.after_tokens for extra in listed.extra]
        num_levels = built_in + len(listed.extra)

        def keep(i: int) -> int | None:  # tokens a block stays on level i (the last: for good)
            if i == 0:
                return self.active_window
            if i == num_levels - 1:
                return None
            return self.warm_tokens if i == 1 else afters[i + 1 - built_in]

        slots = (self.device_slots, self.host_slots, self.disk_slots)
        bits = PRECISIONS[self.kv_precision]
        specs = [built_in_spec(i, listed.media[i] if listed.media else None, bits[i], slots[i],
                               keep(i)) for i in range(built_in)]
        geometry = ((self.num_layers, self.num_kv_heads), self.block_size, self.head_dim)
        for j, extra in enumerate(listed.extra):
            codec = _codec(BITS_OF[extra.precision], self.block_size, self.head_dim,
                           self.kv_quant_range)
            num_slots = max(1, int(extra.capacity_mb * MIB) // codec.nbytes(*geometry))
            specs.append(extra_spec(built_in + j, extra, num_slots, keep(built_in + j)))
        return tuple(dataclasses.replace(spec, medium=self.level_media.get(i, spec.medium))
                     for i, spec in enumerate(specs))

    def build_placement_policy(self) -> PlacementPolicy:
        """The placement_policy's rule (manager/policy.py PLACEMENT_POLICIES); locality's budgets
        in blocks, within what the levels' slots leave a sequence beyond the age rule."""
        levels = self.hierarchy()
        keeps = tuple(spec.keep_tokens or 0 for spec in levels[2:-1])
        age = PlacementPolicy(self.block_size, self.active_window, self.warm_tokens,
                              self.num_sink_blocks, len(levels) > 2, keeps)
        if PLACEMENT_POLICIES[self.placement_policy] is PlacementPolicy:
            return age
        per_seq = self.device_slots // self.max_num_seqs
        device = min(self.locality_device_blocks(self.block_size),
                     max(0, per_seq - age.window_blocks - age.num_sink_blocks))
        host = min(self.locality_host_tokens // self.block_size,
                   max(0, self.host_slots - age.warm_end_blocks - age.num_sink_blocks - device))
        return LocalityPolicy(self.block_size, self.active_window, self.warm_tokens,
                              self.num_sink_blocks, len(levels) > 2, keeps, device_blocks=device,
                              host_blocks=host)
