"""LevelPlan: which blocks one forward of one sequence reads from one KV level (the same for every layer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashmemory.kvcache.manager.blocks import BlockEntry, BlockTable, Level


@dataclass
class LevelPlan:
    """What one forward reads from one level for one sequence (the same for every layer)."""

    indices: list[int]  # logical block indices whose primary copy is on the level, in order
    slots: list[int]
    slot_tensor: torch.Tensor  # int64 slots on the level's device (L2: on the CPU)
    digest: torch.Tensor | None  # [num_layers, num_kv_heads, blocks, 2 * head_dim] for selection (a view if contiguous)
    seq_id: int = -1
    position: int = 0  # the sequence's tokens before this forward (the decode step's clock)
    num_blocks: int = 0  # full blocks of the sequence
    index_tensor: torch.Tensor | None = None  # `indices` as a CPU int64 tensor (made once, for choice observers)
    hints: dict[int, torch.Tensor] | None = None  # per layer, [num_kv_heads, k] logical blocks always chosen


def primary_copy(block: BlockEntry) -> Level:
    """The copy a decode step reads: the fastest."""
    return block.primary


def plan_reads(seq_id: int, table: BlockTable, num_tokens: int, digest: torch.Tensor | None,
               devices: dict[Level, torch.device], with_digest: bool,
               copy_of: Callable[[BlockEntry], Level] = primary_copy, skip_oldest: int = 0,
               skip_newest: int = 0, gathered: dict | None = None) -> dict[Level, LevelPlan]:
    """Per level, the blocks a forward reads from it: each block from the copy `copy_of` picks.

    devices: where each level's slot numbers are used (the pool's device; the CPU for a file).
    digest: the sequence's key digests [num_layers, num_kv_heads, capacity_blocks, 2 * head_dim], sliced for
    selection when `with_digest` (decode steps of query-aware selection).
    skip_oldest, skip_newest: the first and the newest full blocks no level is read for (the forward attends them
    elsewhere).
    gathered: per level, (indices, digest) of the last gather of candidates that are not one run
    of blocks, reused while the indices are the same, else made again (SequenceKV.digest_gathers).
    """
    by_level: dict[Level, list[int]] = {level: [] for level in devices}
    for i in range(skip_oldest, len(table.blocks) - skip_newest):
        block = table.blocks[i]
        if block.slots:
            by_level[copy_of(block)].append(i)
    plans = {}
    for level in devices:
        indices = by_level[level]
        if not indices:
            continue
        slots = [table.blocks[i].slots[level] for i in indices]
        slot_tensor = torch.as_tensor(slots, dtype=torch.int64, device=devices[level])
        level_digest = None
        if with_digest and level != Level.DEVICE:
            assert digest is not None
            if indices[-1] - indices[0] + 1 == len(indices):  # the usual case: one run of blocks, a view
                level_digest = digest[:, :, indices[0] : indices[-1] + 1]
            elif gathered is not None and level in gathered and gathered[level][0] == indices:
                level_digest = gathered[level][1]
            else:
                level_digest = digest[:, :, torch.as_tensor(indices, device=digest.device)]
                if gathered is not None:
                    gathered[level] = (indices, level_digest)
        plans[level] = LevelPlan(indices, slots, slot_tensor, level_digest, seq_id, num_tokens, len(table.blocks))
    return plans
