"""The KV hierarchy as data: an ordered list of levels, each a LevelSpec (no torch).

A level is known by its position: L0 keeps the hot copies attention reads first (the newest
window, pinned blocks), L1 the FP16 master copy of every block younger than its keep, and each
level after it the blocks older than the keeps before it (the last level keeps them for good).
`Level.DEVICE`, `Level.HOST` and `Level.DISK` name the first three positions. The levels come
from the built-in three (sized by max_gpu_memory_mb, cpu_memory_gb and cold_zone_gb) and the
`kv_levels` setting, which may name another medium for them and adds levels after them: a new
level is one medium file, one line in kvcache/levels/registry.py's MEDIA and its kv_levels entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashmemory.errors import ConfigError
from flashmemory.kvcache.manager.blocks import Level, as_level, level_label

__all__ = ["BITS_OF", "BUILT_IN_NAMES", "LevelSpec", "as_level", "level_label", "parse_kv_levels"]

BITS_OF = {"fp16": 16, "int4": 4, "int2": 2}  # a level's precision by name (quant.py's codecs)
BUILT_IN_MEDIA = ("device_memory", "host_memory", "disk_file")  # L0, L1, L2 (with the cold zone)
BUILT_IN_SHORT_NAMES = ("device", "host", "disk")  # "L2 disk" in the CLI and diagnose
# How messages name the built-in levels: (pool, the setting a full one asks to raise).
BUILT_IN_NAMES = {
    Level.DEVICE: ("device", "max_gpu_memory_mb (or lower active_window)"),
    Level.HOST: ("host", "cpu_memory_gb"),
    Level.DISK: ("disk (cold zone)", "cold_zone_gb"),
}
_FULL_MESSAGES = {
    Level.DEVICE: ("the device KV pool is full of pinned blocks and newest windows; raise "
                   "max_gpu_memory_mb, lower active_window, or run fewer sequences at once"),
    Level.HOST: "the host KV pool is full (cpu_memory_gb); raise cpu_memory_gb",
    Level.DISK: "the cold zone file is full; raise cold_zone_gb or shorten the context",
}
KV_LEVELS_FORM = "MEDIUM:MIB:PRECISION:AFTER_TOKENS"


@dataclass(frozen=True)
class LevelSpec:
    """One level of the hierarchy: its medium, precision, capacity, how long blocks stay on it
    and how messages name it."""

    medium: str  # a MEDIA name (kvcache/levels/registry.py)
    name: str  # a word for it after its label: "L2 disk"
    bits: int  # 16 (FP16), 4 or 2 (quant.py)
    num_slots: int  # blocks it holds (one slot = one block of every layer)
    keep_tokens: int | None = None  # tokens a block stays before the next level; None: the last
    pool_name: str = ""  # "host", "disk (cold zone)": completes "the ... KV pool is full"
    capacity_setting: str = ""  # the setting a full level asks to raise
    full_message: str = ""  # what Placement says when the level is full and nothing can move


@dataclass(frozen=True)
class ExtraLevel:
    """A level `kv_levels` adds after the built-in ones, as written there (sized later)."""

    medium: str
    capacity_mb: float  # MiB of the level
    precision: str  # a BITS_OF name
    after_tokens: int  # tokens of age a block spends on the level before this one


@dataclass(frozen=True)
class LevelList:
    """What `kv_levels` says: a medium per built-in level (none given: their own), then the
    added levels."""

    media: tuple[str, ...] = ()
    extra: tuple[ExtraLevel, ...] = ()


def parse_kv_levels(text: str, num_built_in: int) -> LevelList:
    """Read the kv_levels setting: comma-separated levels in order; the first `num_built_in` (L0,
    L1 and, with the cold zone, L2) give only their medium, each one after them is
    MEDIUM:MIB:PRECISION:AFTER_TOKENS. Empty: the built-in levels as they are. ConfigError names
    the entry and the fix."""
    if not text.strip():
        return LevelList()
    entries = [e.strip() for e in text.split(",")]
    if len(entries) < num_built_in:
        example = "device_memory,host_memory" + (",disk_file" if num_built_in > 2 else "")
        raise ConfigError(f"kv_levels={text!r} lists {len(entries)} levels but the cache has "
                          f"{num_built_in} built-in ones: list every level in order, e.g. "
                          f"'{example}', then any added level as {KV_LEVELS_FORM}")
    for i, entry in enumerate(entries[:num_built_in]):
        if not entry or ":" in entry:
            raise ConfigError(f"kv_levels entry {i + 1} ({entry!r}) is the built-in "
                              f"{level_label(i)}: give only its medium (its size and precision "
                              "come from their own settings)")
    extra = tuple(_extra_level(entry, num_built_in + i)
                  for i, entry in enumerate(entries[num_built_in:]))
    if extra and num_built_in == 2 and extra[0].after_tokens:
        raise ConfigError(f"kv_levels adds {level_label(2)} right after L1 (no cold zone), where "
                          "blocks arrive warm_tokens after the window: write 0 for its "
                          "AFTER_TOKENS and set warm_tokens")
    return LevelList(tuple(entries[:num_built_in]), extra)


def _extra_level(entry: str, index: int) -> ExtraLevel:
    parts = entry.split(":")
    where = f"kv_levels entry {index + 1} ({entry!r}, the added {level_label(index)})"
    if len(parts) != 4 or not parts[0]:
        raise ConfigError(f"{where}: write it as {KV_LEVELS_FORM}, e.g. "
                          "'host_memory:512:int4:8192'")
    medium, mb, precision, after = parts
    try:
        capacity_mb, after_tokens = float(mb), int(after)
    except ValueError:
        raise ConfigError(f"{where}: MIB must be a number and AFTER_TOKENS an integer") from None
    if capacity_mb <= 0 or after_tokens < 0:
        raise ConfigError(f"{where}: MIB must be > 0 and AFTER_TOKENS >= 0")
    if precision not in BITS_OF:
        raise ConfigError(f"{where}: PRECISION {precision!r} is not one of "
                          f"{', '.join(BITS_OF)}")
    return ExtraLevel(medium, capacity_mb, precision, after_tokens)


def built_in_spec(level: int, medium: str | None, bits: int, num_slots: int,
                  keep_tokens: int | None) -> LevelSpec:
    """One of the three built-in levels (`medium` None: its own)."""
    pool, setting = BUILT_IN_NAMES[level]
    return LevelSpec(medium or BUILT_IN_MEDIA[level], BUILT_IN_SHORT_NAMES[level], bits,
                     num_slots, keep_tokens, pool, setting, _FULL_MESSAGES[level])


def extra_spec(index: int, extra: ExtraLevel, num_slots: int,
               keep_tokens: int | None) -> LevelSpec:
    """A level kv_levels adds, sized to `num_slots`."""
    label = level_label(index)
    full = (f"the {extra.medium} KV level {label} is full; raise its MIB in kv_levels or "
            "shorten the context")
    return LevelSpec(extra.medium, extra.medium, BITS_OF[extra.precision], num_slots,
                     keep_tokens, f"{extra.medium} ({label})", f"{label}'s MIB in kv_levels", full)
