"""DeviceArena: the L0 pool, whose storage is given back to the device and taken again in whole
segments while the engine runs (the budget controller's shrink and grow,
kvcache/device_budget.py)."""

from __future__ import annotations

import logging

import torch

from flashmemory.kvcache.levels.tensor_pool import TensorPool

logger = logging.getLogger(__name__)

NUM_SEGMENTS = 16  # re-sized in sixteenths of the pool: a 10 % shrink frees at least one


class DeviceArena(TensorPool):
    """A TensorPool whose storage covers slots [0, allocated_slots): whole segments of
    `segment_slots` slots, the pool's `num_slots` at most (what it starts with).

    Reads stay one index_select over one contiguous tensor, so the storage is not a list of
    segment tensors (a gather across them, or the native kernel's one base pointer, would pay on
    every decode step): `fit` re-allocates it at a segment boundary instead. The live records wait
    in host memory meanwhile, so the device never holds the old and the new storage at once: a
    shrink needs no more than it had, a grow no more than the new size (max_gpu_memory_mb's share
    at most). On CUDA the freed storage goes back to the caching allocator, and a shrink empties
    its cache so that other processes (the co-located service a shrink is for) can have it.
    NOTE: a slot at or above `allocated_slots` has no storage; the slot limit
    (LimitedSlotAllocator) keeps blocks below it, and `fit` is told which slots hold blocks.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.segment_slots = max(1, -(-self.num_slots // NUM_SEGMENTS))
        self._lead_shape = tuple(self.storage.shape[:2])  # (num_layers, num_kv_heads)

    @property
    def allocated_slots(self) -> int:
        return self.storage.shape[2]

    @property
    def allocated_bytes(self) -> int:
        """Device bytes the storage holds now, counted from the tensor."""
        return self.storage.numel() * self.storage.element_size()

    def segments_for(self, num_slots: int) -> int:
        """Slots of the whole segments that cover [0, num_slots) (the pool's size at most)."""
        return min(self.num_slots, -(-num_slots // self.segment_slots) * self.segment_slots)

    def fit(self, num_slots: int, live_slots: list[int]) -> int:
        """Hold storage for the segments covering [0, num_slots), keeping the records of
        `live_slots` (each below the old and the new size); returns the slots allocated
        afterwards. A grow the device cannot serve keeps the old size (logged); the caller bounds
        its limit by the result."""
        target, before = self.segments_for(num_slots), self.allocated_slots
        if target == before:
            return before
        assert all(s < min(target, before) for s in live_slots), "a live slot outside the arena"
        index = torch.as_tensor(live_slots, dtype=torch.int64, device=self.device)
        # [layers, heads, live, record_bytes], off the device while the storage is re-sized
        saved = self.storage.index_select(2, index).to("cpu")
        self.storage = self._allocate(0)  # the old storage's last reference: freed first
        if target < before and self.device.type == "cuda":
            torch.cuda.empty_cache()  # else the caching allocator keeps them from other processes
        try:
            self.storage = self._allocate(target)
        except RuntimeError as e:  # out of device memory (torch.OutOfMemoryError is one)
            if target < before:
                raise
            logger.warning("the L0 arena could not grow from %d to %d slots (%s); it stays at %d",
                           before, target, e, before)
            self.storage = self._allocate(before)
        self.storage.index_copy_(2, index, saved.to(self.device))
        self.high_water_slots = min(self.high_water_slots, self.allocated_slots)
        return self.allocated_slots

    def _allocate(self, num_slots: int) -> torch.Tensor:
        return torch.empty((*self._lead_shape, num_slots, self.record_bytes), dtype=torch.uint8,
                           device=self.device)

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "bytes_allocated": self.allocated_bytes}
