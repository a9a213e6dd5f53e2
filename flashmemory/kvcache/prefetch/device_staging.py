"""Device staging of warm (L1) blocks: a bounded device-memory area filled ahead of the decode step that reads it.

L1 lives in host memory (pinned where CUDA is present). Without staging, a decode step that attends selected L1
blocks gathers their records on the CPU and copies them to the device synchronously. With a DeviceStaging, the
prefetcher names, after each step's query-aware choice, the host slots each layer will probably read next step
(`want`, hottest first); their (slot, layer) records are copied into a preallocated device area in the background
(a thread on a CPU host, a side CUDA stream from pinned memory where a GPU exists). The next step's `gather` serves
staged records from the area (hits) and copies the rest from the host on demand (misses); the result is the same
bytes either way.

One entry of the area holds one (host slot, layer) record of every KV head: [num_kv_heads, record_bytes]. Entries
are handed out while free ones remain and a layer's fair share (capacity // num_layers by default) is not used up;
the rest of a wanted set is read on demand. An entry leaves when no sequence wants it anymore; if it was never
read, its bytes count as wasted.

NOTE (no half-written block is ever served): an entry is served only after its copy completed (`Copier.wait`), and
only if the host slot was not rewritten since the copy was issued. TensorPool.put bumps the slot's generation
*before* writing; the generation is recorded when the copy is issued and compared when the entry is read, so a
copy that raced with a rewrite (or was issued before one) is never served: the step reads the host instead. An
entry whose copy is still in flight is never given a new (slot, layer) while the copy runs: an evicted in-flight
entry is set aside and reused only once its copy completed. On CUDA the side stream waits for the work queued on
the consumer stream before each copy, so a copy neither reads host bytes an earlier asynchronous put still writes,
nor overwrites an entry a queued kernel still reads; the consumer stream waits on the copy's event before reading.

Threading: DeviceStaging itself is used from one thread (the engine's); only the copier runs elsewhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from flashmemory.errors import ConfigError
from flashmemory.kvcache.prefetch.copiers import Copier, CudaStreamCopier, ThreadCopier
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.quant import Parts


class DeviceStaging:
    """Owns a bounded device area of L1 block records, the (slot, layer) -> entry map, and the copier filling it.

    Entry e of `area` [capacity_entries, num_kv_heads, record_bytes] holds the record of one (host slot, layer) of
    every KV head. Nothing is allocated on the device after construction but the per-step gather results.
    """

    def __init__(self, host_pool: TensorPool, device: torch.device, capacity_bytes: int,
                 copier: Copier | None = None, layer_quota_entries: int | None = None) -> None:
        if capacity_bytes < 0:
            raise ConfigError(f"device staging capacity_bytes={capacity_bytes} must be >= 0")
        self.host_pool = host_pool
        self.device = torch.device(device)
        num_layers, heads, num_slots, record_bytes = host_pool.storage.shape
        self.num_layers, self.num_kv_heads, self.num_slots, self.record_bytes = num_layers, heads, num_slots, record_bytes
        self.entry_bytes = heads * record_bytes
        capacity = min(capacity_bytes // self.entry_bytes, num_layers * num_slots)
        self.capacity_entries = capacity
        if layer_quota_entries is None:
            layer_quota_entries = max(1, capacity // num_layers) if capacity else 0
        if layer_quota_entries < 0:
            raise ConfigError(f"device staging layer_quota_entries={layer_quota_entries} must be >= 0")
        self.layer_quota_entries = layer_quota_entries
        self.area = torch.empty((capacity, heads, record_bytes), dtype=torch.uint8, device=self.device)
        self._area_flat = self.area.view(capacity * heads, record_bytes)
        if copier is None:
            copier = CudaStreamCopier(self.device) if self.device.type == "cuda" else ThreadCopier()
        self.copier = copier
        # Entry metadata: tensors where gather needs them vectorized (all on the CPU), lists for want.
        self._entry_of = torch.full((num_layers, num_slots), -1, dtype=torch.int64)  # (layer, slot) -> entry
        self._entry_generation = torch.zeros(capacity, dtype=torch.int64)  # host slot generation at issue
        self._entry_ticket = torch.zeros(capacity, dtype=torch.int64)  # the copier ticket of the entry's copy
        self._entry_used = torch.zeros(capacity, dtype=torch.bool)  # served at least once
        self._entry_key: list[tuple[int, int] | None] = [None] * capacity  # entry -> (layer, slot)
        self._entry_wanted_by: list[set[int]] = [set() for _ in range(capacity)]  # sequences wanting it
        self._layer_entries = [0] * num_layers
        self._free: deque[int] = deque(range(capacity))
        self._retired: deque[int] = deque()  # evicted while their copy ran: reusable once it completed
        self._wanted: dict[tuple[int, int], dict[int, None]] = {}  # (seq_id, layer) -> slots, hottest first
        self._closed = False
        self.counters = {"device_staging_issued": 0, "device_staging_hits": 0, "device_staging_misses": 0,
                         "device_staging_wasted_bytes": 0}

    # ---- prefetch side ----------------------------------------------------------------------------------------

    def want(self, layer: int, slots: Sequence[int], seq_id: int = 0) -> None:
        """Make `slots` (host slots, hottest first) the wanted set of (seq_id, layer) for the next step.

        Entries no sequence wants anymore leave (never-read ones count as wasted); wanted (slot, layer) records not
        staged yet are copied in the given order while free entries and the layer's share remain.
        """
        self._check_layer(layer)
        if self._closed:
            return
        new = dict.fromkeys(int(s) for s in slots)
        for s in new:
            if not 0 <= s < self.num_slots:
                raise IndexError(f"host slot {s} out of range [0, {self.num_slots})")
        old = self._wanted.pop((seq_id, layer), {})
        if new:
            self._wanted[(seq_id, layer)] = new
        for slot in old:
            if slot not in new:
                self._unwant(layer, slot, seq_id)
        if self.capacity_entries == 0:
            return
        generation = self.host_pool.generation
        for slot in new:
            entry = int(self._entry_of[layer, slot])
            if entry >= 0 and int(self._entry_generation[entry]) != int(generation[slot]):
                self._evict(entry)  # the slot was rewritten since the copy: copy it again below
                entry = -1
            if entry >= 0:
                self._entry_wanted_by[entry].add(seq_id)
                continue
            if self._layer_entries[layer] >= self.layer_quota_entries:
                continue
            entry = self._allocate()
            if entry is None:
                continue  # full: read on demand
            self._issue(entry, layer, slot, seq_id)

    def forget(self, seq_id: int) -> None:
        """A sequence ended: drop its wanted sets (entries nobody else wants leave)."""
        for key in [k for k in self._wanted if k[0] == seq_id]:
            for slot in self._wanted.pop(key):
                self._unwant(key[1], slot, seq_id)

    # ---- decode side ------------------------------------------------------------------------------------------

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Records [num_kv_heads, b, record_bytes] on the device of host slots [num_kv_heads, b] (each KV head its
        own), byte for byte what the host pool holds: staged, completed and still current entries are served from
        the area, the rest is copied from the host now."""
        self._check_layer(layer)
        heads, b = slots.shape
        if heads != self.num_kv_heads:
            raise ValueError(f"slots has {heads} rows, the pool {self.num_kv_heads} KV heads")
        slots = slots.to("cpu", torch.int64)
        entry = self._entry_of[layer][slots]  # [heads, b]
        hit = entry >= 0
        if bool(hit.any()):
            safe = entry.clamp(min=0)
            hit &= self._entry_generation[safe] == self.host_pool.generation[slots]
        hit_pos = hit.flatten().nonzero().squeeze(1)
        n_hits = int(hit_pos.numel())
        self.counters["device_staging_hits"] += n_hits
        self.counters["device_staging_misses"] += heads * b - n_hits
        if n_hits == 0:
            return self._from_host(layer, slots)
        hit_entries = entry.flatten()[hit_pos]
        self.copier.wait(int(self._entry_ticket[hit_entries].max()))
        # A rewrite can only come from this thread, so the generations checked above still hold after the wait.
        self._entry_used[hit_entries] = True
        head_of = torch.arange(heads).repeat_interleave(b)
        src = (hit_entries * heads + head_of[hit_pos]).to(self.device)
        staged = self._area_flat.index_select(0, src)
        if n_hits == heads * b:
            return staged.view(heads, b, self.record_bytes)
        out = torch.empty((heads * b, self.record_bytes), dtype=torch.uint8, device=self.device)
        out.index_copy_(0, hit_pos.to(self.device), staged)
        miss_pos = (~hit).flatten().nonzero().squeeze(1)
        flat_host = self.host_pool.storage[layer].view(heads * self.num_slots, self.record_bytes)
        host = flat_host.index_select(0, head_of[miss_pos] * self.num_slots + slots.flatten()[miss_pos])
        out.index_copy_(0, miss_pos.to(self.device), host.to(self.device))
        return out.view(heads, b, self.record_bytes)

    def gather_parts(self, layer: int, slots: torch.Tensor) -> Parts:
        """`gather` as the codec's parts (views), like TensorPool.get_layer_per_head but on the staging device."""
        return self.host_pool._parts(self.gather(layer, slots))

    def get_layer_per_head(self, slots: torch.Tensor, layer: int) -> Parts:
        """The read path's per-head source interface (the same call as TensorPool's)."""
        return self.gather_parts(layer, slots)

    # ---- accounting -------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.counters)
        self._reclaim()  # in use: entries holding a (slot, layer), and evicted ones a copy still writes
        out["device_staging_bytes"] = (self.capacity_entries - len(self._free)) * self.entry_bytes
        out["device_staging_capacity_bytes"] = self.capacity_entries * self.entry_bytes
        return out

    def close(self) -> None:
        """Stop the copier; afterwards `want` does nothing and `gather` reads the host only."""
        if self._closed:
            return
        self._closed = True
        self.copier.close()
        self._entry_of.fill_(-1)
        self._wanted.clear()

    # ---- internals --------------------------------------------------------------------------------------------

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")

    def _from_host(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The synchronous path: the host pool's per-head gather, moved to the device."""
        heads, b = slots.shape
        flat = (slots + torch.arange(heads)[:, None] * self.num_slots).flatten()
        records = self.host_pool.storage[layer].view(heads * self.num_slots, self.record_bytes).index_select(0, flat)
        return records.view(heads, b, self.record_bytes).to(self.device)

    def _issue(self, entry: int, layer: int, slot: int, seq_id: int) -> None:
        # The generation is read before the copy is queued: a put after this point changes it (put bumps first).
        self._entry_generation[entry] = self.host_pool.generation[slot]
        source = self.host_pool.storage[layer, :, slot]  # [heads, record_bytes]; per head: contiguous (pinned)
        pairs = [(self.area[entry, h], source[h]) for h in range(self.num_kv_heads)]
        self._entry_ticket[entry] = self.copier.submit(pairs)
        self._entry_used[entry] = False
        self._entry_key[entry] = (layer, slot)
        self._entry_wanted_by[entry] = {seq_id}
        self._entry_of[layer, slot] = entry
        self._layer_entries[layer] += 1
        self.counters["device_staging_issued"] += 1

    def _unwant(self, layer: int, slot: int, seq_id: int) -> None:
        entry = int(self._entry_of[layer, slot])
        if entry < 0:
            return
        wanted_by = self._entry_wanted_by[entry]
        wanted_by.discard(seq_id)
        if not wanted_by:
            self._evict(entry)

    def _evict(self, entry: int) -> None:
        key = self._entry_key[entry]
        assert key is not None
        layer, slot = key
        self._entry_of[layer, slot] = -1
        self._entry_key[entry] = None
        self._entry_wanted_by[entry] = set()
        self._layer_entries[layer] -= 1
        if not bool(self._entry_used[entry]):
            self.counters["device_staging_wasted_bytes"] += self.entry_bytes
        if self.copier.done(int(self._entry_ticket[entry])):
            self._free.append(entry)
        else:
            self._retired.append(entry)  # its copy still writes it: no new (slot, layer) until it completed

    def _reclaim(self) -> None:
        """Entries set aside in flight whose copy has completed become free (FIFO copies: check the oldest)."""
        while self._retired and self.copier.done(int(self._entry_ticket[self._retired[0]])):
            self._free.append(self._retired.popleft())

    def _allocate(self) -> int | None:
        self._reclaim()
        return self._free.popleft() if self._free else None
