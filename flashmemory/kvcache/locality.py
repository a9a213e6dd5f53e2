"""LocalityTracker: the access-locality index (ALI) of every block a decode step's selection sees,
and the link saturation (BS) that holds locality's moves back, for placement_policy="locality".

A ChoiceObserver: each query-aware choice (one layer and level, every KV head) adds to its
candidates the number of (layer, KV head) cells that chose them; at the step's end each
candidate's share of the step's cells goes into its ring of its last `history_steps` steps as a
candidate. A block's ALI is the mean of its ring (the seed's "over the last 100 accesses, the
share that hit the same page", with a step's choices as one access). A block read from L0 is no
candidate: its index stays as last measured (it keeps its L0 copy while no block with a higher
index needs the slot). The policy (manager/policy.py LocalityPolicy.roles) turns ALIs into
placements; Placement carries them out when the tracker says the link is not saturated.

Bandwidth saturation: the bytes the cache moves between levels per second of decode, against the
link's rate measured once (a copy of LINK_PROBE_BYTES host -> compute device) or, on CUDA with
NVML, the PCIe counters; above SATURATED locality's moves wait (the age rule's never do).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from flashmemory.kvcache.manager.blocks import BlockTable
from flashmemory.kvcache.manager.policy import (HOST_ALI, LIFT, BlockLocality, Locality,
                                               LocalityPolicy)
from flashmemory.kvcache.read.choice import LayerChoice

SATURATED = 0.8  # the seed's BS threshold: above this share of the link, no cross-level moves
LINK_PROBE_BYTES = 32 * 2**20


class LinkMonitor:
    """The share of the host <-> compute-device link that the cache's moves use."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.link_bytes_per_s = measure_link(device)
        self._nvml = _nvml_handle(device)
        self._last_time: float | None = None
        self._last_bytes = 0
        self.utilization = 0.0

    def observe(self, bytes_moved: int) -> float:
        """Fold the cache's total bytes moved so far (its counters) into the rate; returns the
        utilization, 0-1 (NVML's PCIe counters where there are)."""
        now = time.perf_counter()
        if self._nvml is not None:
            self.utilization = _nvml_utilization(self._nvml, self.link_bytes_per_s)
        elif self._last_time is not None and now > self._last_time:
            rate = (bytes_moved - self._last_bytes) / (now - self._last_time)
            self.utilization = min(1.0, rate / self.link_bytes_per_s)
        self._last_time, self._last_bytes = now, bytes_moved
        return self.utilization

    @property
    def saturated(self) -> bool:
        return self.utilization > SATURATED


def measure_link(device: torch.device) -> float:
    """Bytes per second of one host -> `device` copy of LINK_PROBE_BYTES (on a CPU host: a memory
    copy, the cost of an L1 -> L0 move there)."""
    src = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8)
    if device.type == "cuda":
        src = src.pin_memory()
    dst = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
    dst.copy_(src)  # first touch
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return LINK_PROBE_BYTES / max(best, 1e-9)


def _nvml_handle(device: torch.device):
    """An NVML device handle for a CUDA device when pynvml is installed, else None."""
    if device.type != "cuda":
        return None
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    except Exception:  # no pynvml, or no NVML driver: the measured rate serves
        return None


def _nvml_utilization(handle, link_bytes_per_s: float) -> float:
    import pynvml  # type: ignore[import-not-found]

    kib_per_s = sum(pynvml.nvmlDeviceGetPcieThroughput(handle, counter)
                    for counter in (pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES))
    return min(1.0, kib_per_s * 1024 / link_bytes_per_s)


class _SequenceALI:
    """One sequence's per-block rings of shares [history_steps, capacity_blocks]: a block's ring
    moves on only in the steps it was a candidate in (a block read from L0 is no candidate: its
    index stays as last measured), and the step being gathered."""

    def __init__(self, history_steps: int, capacity: int) -> None:
        self.ring = torch.zeros(history_steps, capacity)
        self.head = torch.zeros(capacity, dtype=torch.int64)  # each block's next ring row
        self.steps = torch.zeros(capacity, dtype=torch.int64)  # rows written, at most the ring's
        self.base_ring = torch.zeros(history_steps, capacity)  # the random share, per step
        self.chosen = torch.zeros(capacity)  # this step: cells that chose each block
        self.cells = torch.zeros(capacity)  # this step: cells each block was a candidate in
        self.base = torch.zeros(capacity)  # this step: cells times budget / candidates

    def grow(self, capacity: int) -> None:
        if capacity <= self.ring.shape[1]:
            return
        capacity = max(capacity, 2 * self.ring.shape[1])
        for name in ("ring", "base_ring"):
            old = getattr(self, name)
            ring = torch.zeros(old.shape[0], capacity)
            ring[:, : old.shape[1]] = old
            setattr(self, name, ring)
        for name in ("head", "steps", "chosen", "cells", "base"):
            old = getattr(self, name)
            new = torch.zeros(capacity, dtype=old.dtype)
            new[: old.numel()] = old
            setattr(self, name, new)


class LocalityTracker:
    """Owns every live sequence's block ALIs (see the module's docstring). Its tensors are made and
    changed in inference mode only: choices arrive from a forward (in inference mode), the step's
    end from the commit after it (outside)."""

    def __init__(self, history_steps: int) -> None:
        self.history_steps = history_steps
        self._seqs: dict[int, _SequenceALI] = {}

    @torch.inference_mode()
    def on_choose(self, choice: LayerChoice) -> None:
        indices = choice.indices
        n = indices.numel()
        if n == 0:
            return
        top = int(indices.max()) + 1
        seq = self._seqs.get(choice.seq_id)
        if seq is None:
            seq = self._seqs[choice.seq_id] = _SequenceALI(self.history_steps, max(256, top))
        seq.grow(top)
        heads, budget = choice.chosen.shape
        counts = torch.bincount(choice.chosen.reshape(-1).cpu(), minlength=n)[:n].float()
        seq.chosen.index_add_(0, indices, counts)
        seq.cells.index_add_(0, indices, torch.full((n,), float(heads)))
        seq.base.index_add_(0, indices, torch.full((n,), heads * min(1.0, budget / n)))

    @torch.inference_mode()
    def on_step_end(self, seq_id: int) -> None:
        seq = self._seqs.get(seq_id)
        if seq is None:
            return
        seen = torch.nonzero(seq.cells > 0).flatten()
        rows = seq.head[seen]
        seq.ring[rows, seen] = seq.chosen[seen] / seq.cells[seen]
        seq.base_ring[rows, seen] = seq.base[seen] / seq.cells[seen]
        seq.head[seen] = (rows + 1) % self.history_steps
        seq.steps[seen] = (seq.steps[seen] + 1).clamp(max=self.history_steps)
        for gathered in (seq.chosen, seq.cells, seq.base):
            gathered.zero_()

    @torch.inference_mode()
    def on_step_abort(self, seq_id: int) -> None:
        seq = self._seqs.get(seq_id)
        if seq is not None:
            for gathered in (seq.chosen, seq.cells, seq.base):
                gathered.zero_()

    def forget(self, seq_id: int) -> None:
        """The sequence ended (or its KV was freed)."""
        self._seqs.pop(seq_id, None)

    @torch.inference_mode()
    def locality(self, seq_id: int, num_blocks: int) -> dict[int, BlockLocality]:
        """The ALI of each block of the sequence that locality may place: above HOST_ALI, or never
        chosen in a full history window (the rest follow the age rule: not listed)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return {}
        steps = seq.steps[:num_blocks]
        ali = seq.ring[:, :num_blocks].sum(0) / steps.clamp(min=1)
        base = seq.base_ring[:, :num_blocks].sum(0) / steps.clamp(min=1)
        banded = (ali > HOST_ALI) & (ali > LIFT * base)
        listed = banded | ((ali == 0) & (steps >= self.history_steps))
        out = {}
        for index in torch.nonzero(listed & (steps > 0)).flatten().tolist():
            out[index] = BlockLocality(float(ali[index]), int(steps[index]), self.history_steps,
                                       float(base[index]))
        return out


class LocalityPlacer:
    """What Placement asks when placement_policy="locality": each sequence's roles (recomputed when
    a block fills: ages change only then), whether the link lets locality move blocks now, and the
    counts of what it did."""

    def __init__(self, policy: LocalityPolicy, tracker: LocalityTracker,
                 link: LinkMonitor, bytes_moved: Callable[[], int]) -> None:
        self.policy = policy
        self.tracker = tracker
        self.link = link
        self._bytes_moved = bytes_moved
        self._roles: dict[int, tuple[int, dict[int, Locality]]] = {}
        self.raised_to_device = 0
        self.raised_to_host = 0
        self.sunk = 0
        self.deferred = 0  # role updates skipped while the link was saturated

    def roles(self, seq_id: int, table: BlockTable) -> dict[int, Locality]:
        n = len(table.blocks)
        cached = self._roles.get(seq_id)
        if cached is not None and cached[0] == n:
            return cached[1]
        self.link.observe(self._bytes_moved())
        if self.link.saturated and cached is not None:
            self.deferred += 1
            return {i: role for i, role in cached[1].items() if role is not Locality.SINK}
        pinned = {i for i, block in enumerate(table.blocks) if block.pinned}
        roles = self.policy.roles(n, self.tracker.locality(seq_id, n), pinned)
        self._roles[seq_id] = (n, roles)
        return roles

    def may_move(self) -> bool:
        return not self.link.saturated

    def count_raise(self, to_device: bool) -> None:
        if to_device:
            self.raised_to_device += 1
        else:
            self.raised_to_host += 1

    def count_sink(self) -> None:
        self.sunk += 1

    def forget(self, seq_id: int) -> None:
        self._roles.pop(seq_id, None)
        self.tracker.forget(seq_id)

    def stats(self) -> dict[str, float]:
        return {"locality_raised_to_device": self.raised_to_device,
                "locality_raised_to_host": self.raised_to_host,
                "locality_sunk": self.sunk,
                "locality_deferred": self.deferred,
                "link_utilization": self.link.utilization}
