"""Device staging of L1 blocks: gathers equal the host pool's bytes, hits/misses/waste are counted, capacity holds,
and a slot rewritten after (or while) its copy was issued is never served from the staging area."""

from __future__ import annotations

import threading

import pytest
import torch

from flashmemory.errors import ConfigError
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.prefetch.copiers import CopyPairs, ThreadCopier
from flashmemory.kvcache.prefetch.device_staging import DeviceStaging
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.config import KV_DTYPE, level_codecs

LAYERS, HEADS, SLOTS, BLOCK, DIM = 3, 2, 12, 4, 8
CPU = torch.device("cpu")


def _kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, HEADS, BLOCK, DIM)
    return torch.randn(shape, generator=g).to(KV_DTYPE), torch.randn(shape, generator=g).to(KV_DTYPE)


def _pool() -> TensorPool:
    codec = level_codecs("mixed", BLOCK, DIM)[Level.HOST]  # the real L1 codec (fp16)
    pool = TensorPool(Level.HOST, codec, SLOTS, LAYERS, HEADS, BLOCK, DIM, CPU)
    for slot in range(SLOTS):
        pool.put(slot, codec.encode(*_kv(slot)))
    return pool


def _records(pool: TensorPool, slots: torch.Tensor, layer: int) -> torch.Tensor:
    """The synchronous path: get_layer_per_head's parts, as the records they view."""
    parts = pool.get_layer_per_head(slots, layer)
    (kv,) = parts.values()
    return kv.reshape(*slots.shape, -1).view(torch.uint8)


class GatedCopier(ThreadCopier):
    """A ThreadCopier whose copies wait until the test opens the gate: holds copies in flight deterministically."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)
        super().__init__()

    def _copy(self, pairs: CopyPairs) -> None:
        self.started.release()
        self.gate.wait()
        super()._copy(pairs)


@pytest.fixture
def pool() -> TensorPool:
    return _pool()


def _staging(pool: TensorPool, entries: int, copier=None, **kw) -> DeviceStaging:
    return DeviceStaging(pool, CPU, entries * HEADS * pool.record_bytes, copier, **kw)


def test_put_bumps_the_slot_generation(pool):
    before = pool.generation.clone()
    codec = pool.codec
    pool.put(3, codec.encode(*_kv(99)))
    assert pool.generation[3] == before[3] + 1
    assert torch.equal(pool.generation[:3], before[:3]) and torch.equal(pool.generation[4:], before[4:])


def test_gather_equals_host_records_for_staged_unstaged_and_per_head_slots(pool):
    staging = _staging(pool, entries=LAYERS * SLOTS)  # room for everything
    try:
        staging.want(1, [0, 1, 2, 3])
        staging.want(2, [5])
        cases = {
            1: [torch.tensor([[0, 1], [2, 3]]),  # all staged, per head different
                torch.tensor([[0, 7, 1], [9, 3, 11]]),  # a mix
                torch.tensor([[8, 9], [10, 11]]),  # none staged
                torch.tensor([[3, 3, 0], [0, 3, 3]])],  # repeats
            2: [torch.tensor([[5, 1], [5, 5]])],
            0: [torch.tensor([[0, 1], [2, 3]])],  # staged for another layer only
        }
        for layer, slot_sets in cases.items():
            for slots in slot_sets:
                got = staging.gather(layer, slots)
                assert got.dtype == torch.uint8 and got.shape == (HEADS, slots.shape[1], pool.record_bytes)
                assert torch.equal(got, _records(pool, slots, layer))
                parts = staging.gather_parts(layer, slots)
                assert torch.equal(parts["kv"], pool.get_layer_per_head(slots, layer)["kv"])
        st = staging.stats()
        # hits: 4 + 3 + 0 + 6 + 3 + 0, counted per (KV head, block) record, twice (gather and gather_parts)
        assert st["device_staging_hits"] == 2 * 16
        assert st["device_staging_misses"] == 2 * (0 + 3 + 4 + 0 + 1 + 4)
        assert st["device_staging_issued"] == 5
    finally:
        staging.close()


def test_capacity_is_never_exceeded_and_the_rest_is_read_on_demand(pool):
    staging = _staging(pool, entries=3, layer_quota_entries=3)
    try:
        staging.want(0, [4, 5, 6, 7, 8])  # hottest first: 4, 5, 6 fit
        st = staging.stats()
        assert st["device_staging_issued"] == 3
        assert st["device_staging_bytes"] == st["device_staging_capacity_bytes"] == 3 * HEADS * pool.record_bytes
        staging.want(1, [0, 1])  # nothing free
        assert staging.stats()["device_staging_issued"] == 3
        slots = torch.tensor([[4, 7], [6, 8]])
        assert torch.equal(staging.gather(0, slots), _records(pool, slots, 0))
        assert staging.stats()["device_staging_hits"] == 2
        assert staging.stats()["device_staging_misses"] == 2
    finally:
        staging.close()


def test_layer_share_keeps_one_layer_from_taking_the_whole_area(pool):
    staging = _staging(pool, entries=LAYERS * 2)  # default share: 2 entries per layer
    try:
        staging.want(0, list(range(SLOTS)))
        staging.want(1, list(range(SLOTS)))
        assert staging.stats()["device_staging_issued"] == 4
    finally:
        staging.close()


def test_unused_entries_count_as_wasted_when_evicted(pool):
    staging = _staging(pool, entries=8, layer_quota_entries=8)
    entry = HEADS * pool.record_bytes
    try:
        staging.want(0, [0, 1, 2])
        staging.gather(0, torch.tensor([[0], [0]]))  # slot 0 used
        staging.copier.wait(3)  # copies done: evicted entries are free at once
        staging.want(0, [2, 3])  # 0 (used) and 1 (never used) leave, 2 stays, 3 comes
        st = staging.stats()
        assert st["device_staging_wasted_bytes"] == entry
        assert st["device_staging_issued"] == 4
        assert st["device_staging_bytes"] == 2 * entry
        staging.copier.wait(4)
        staging.want(0, [])
        assert staging.stats()["device_staging_wasted_bytes"] == 3 * entry
        assert staging.stats()["device_staging_bytes"] == 0
    finally:
        staging.close()


def test_an_entry_stays_while_another_sequence_wants_it(pool):
    staging = _staging(pool, entries=8)
    try:
        staging.want(0, [0, 1], seq_id=1)
        staging.want(0, [1], seq_id=2)
        staging.copier.wait(2)  # both copies done: the evicted entry is free at once
        staging.want(0, [], seq_id=1)  # 0 leaves, 1 is still wanted by sequence 2
        assert staging.stats()["device_staging_bytes"] == HEADS * pool.record_bytes
        staging.gather(0, torch.tensor([[1], [1]]))
        assert staging.stats()["device_staging_hits"] == 2
        staging.forget(2)
        assert staging.stats()["device_staging_bytes"] == 0
    finally:
        staging.close()


def test_slot_rewritten_after_the_copy_completed_is_read_from_the_host(pool):
    staging = _staging(pool, entries=8)
    try:
        staging.want(0, [2])
        slots = torch.tensor([[2], [2]])
        assert torch.equal(staging.gather(0, slots), _records(pool, slots, 0))  # waits for the copy: a hit
        pool.put(2, pool.codec.encode(*_kv(1234)))
        assert torch.equal(staging.gather(0, slots), _records(pool, slots, 0))
        st = staging.stats()
        assert (st["device_staging_hits"], st["device_staging_misses"]) == (2, 2)
        staging.want(0, [2])  # stale entry: copied again, then served
        assert staging.stats()["device_staging_issued"] == 2
        assert torch.equal(staging.gather(0, slots), _records(pool, slots, 0))
        assert staging.stats()["device_staging_hits"] == 4
    finally:
        staging.close()


def test_slot_rewritten_while_its_copy_is_in_flight_is_never_served(pool):
    copier = GatedCopier()
    staging = _staging(pool, entries=8, copier=copier)
    try:
        old = _records(pool, torch.tensor([[5], [5]]), 1).clone()
        staging.want(1, [5, 6])
        assert copier.started.acquire(timeout=10)  # the copy of slot 5 has begun and is held
        pool.put(5, pool.codec.encode(*_kv(777)))  # rewritten mid-copy
        copier.gate.set()
        slots = torch.tensor([[5, 6], [6, 5]])
        got = staging.gather(1, slots)
        assert torch.equal(got, _records(pool, slots, 1))
        assert not torch.equal(got[0, :1], old[0])
        st = staging.stats()
        assert (st["device_staging_hits"], st["device_staging_misses"]) == (2, 2)  # slot 6 staged, slot 5 not
    finally:
        copier.gate.set()
        staging.close()


def test_gather_waits_for_copies_in_flight(pool):
    copier = GatedCopier()
    staging = _staging(pool, entries=8, copier=copier)
    try:
        staging.want(2, [7])
        slots = torch.tensor([[7], [7]])
        result: list[torch.Tensor] = []
        reader = threading.Thread(target=lambda: result.append(staging.gather(2, slots)))
        reader.start()
        assert copier.started.acquire(timeout=10)
        reader.join(timeout=0.2)
        assert reader.is_alive()  # blocked on the held copy, not served half-written
        copier.gate.set()
        reader.join(timeout=10)
        assert torch.equal(result[0], _records(pool, slots, 2))
        assert staging.stats()["device_staging_hits"] == 2
    finally:
        copier.gate.set()
        staging.close()


def test_an_evicted_entry_is_not_reused_while_its_copy_runs(pool):
    copier = GatedCopier()
    staging = _staging(pool, entries=2, copier=copier, layer_quota_entries=2)
    try:
        staging.want(0, [0, 1])  # both entries in flight (held)
        staging.want(0, [2, 3])  # 0 and 1 leave, but their entries are still being written
        st = staging.stats()
        assert st["device_staging_issued"] == 2
        assert st["device_staging_bytes"] == st["device_staging_capacity_bytes"]
        copier.gate.set()
        copier.wait(2)
        staging.want(0, [2, 3])  # now the entries are reusable
        assert staging.stats()["device_staging_issued"] == 4
        slots = torch.tensor([[2, 3], [3, 0]])
        assert torch.equal(staging.gather(0, slots), _records(pool, slots, 0))
        assert staging.stats()["device_staging_hits"] == 3
    finally:
        copier.gate.set()
        staging.close()


def test_close_joins_the_thread_and_later_gathers_read_the_host(pool):
    staging = _staging(pool, entries=8)
    copier = staging.copier
    assert isinstance(copier, ThreadCopier)
    staging.want(0, [1, 2])
    staging.close()
    assert not copier._thread.is_alive()
    staging.want(0, [3])  # a no-op now
    slots = torch.tensor([[1, 3], [2, 1]])
    assert torch.equal(staging.gather(0, slots), _records(pool, slots, 0))
    assert staging.stats()["device_staging_hits"] == 0
    staging.close()  # idempotent


def test_zero_capacity_reads_everything_on_demand_and_bad_settings_raise(pool):
    staging = _staging(pool, entries=0)
    try:
        staging.want(0, [1, 2])
        slots = torch.tensor([[1], [2]])
        assert torch.equal(staging.gather(0, slots), _records(pool, slots, 0))
        assert staging.stats()["device_staging_capacity_bytes"] == 0
    finally:
        staging.close()
    with pytest.raises(ConfigError):
        DeviceStaging(pool, CPU, -1)
    staging = _staging(pool, entries=2)
    try:
        with pytest.raises(IndexError):
            staging.want(LAYERS, [0])
        with pytest.raises(IndexError):
            staging.want(0, [SLOTS])
    finally:
        staging.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stream_copier_serves_pinned_l1_records_bit_identically():
    from flashmemory.kvcache.prefetch.copiers import CudaStreamCopier

    codec = level_codecs("mixed", BLOCK, DIM)[Level.HOST]
    pool = TensorPool(Level.HOST, codec, SLOTS, LAYERS, HEADS, BLOCK, DIM, CPU, pin_memory=True)
    for slot in range(SLOTS):
        pool.put(slot, codec.encode(*_kv(slot)))
    device = torch.device("cuda")
    staging = DeviceStaging(pool, device, LAYERS * SLOTS * HEADS * pool.record_bytes)
    try:
        assert isinstance(staging.copier, CudaStreamCopier)
        staging.want(1, [0, 1, 2, 3])
        slots = torch.tensor([[0, 7, 1], [9, 3, 2]])
        got = staging.gather(1, slots)
        assert got.device.type == "cuda"
        assert torch.equal(got.cpu(), _records(pool, slots, 1))
        pool.put(1, codec.encode(*(t.to(device) for t in _kv(4321))))  # asynchronous write into pinned memory
        staging.want(1, [1])
        torch.cuda.synchronize()
        assert torch.equal(staging.gather(1, slots).cpu(), _records(pool, slots, 1))
        assert staging.stats()["device_staging_hits"] > 0
    finally:
        staging.close()


def test_engine_decodes_the_same_with_l1_staged_on_the_device(tiny_llama):
    """The cache's torch decode path (the GPU path) reads selected L1 blocks through the staging area, filled by
    the prefetcher's per-step L1 ranking; the answers do not change and the staged blocks are really used."""
    from flashmemory import FlashMemoryEngine

    levels = dict(block_size=8, active_window=16, warm_tokens=48, prefill_chunk_tokens=32, cpu_memory_gb=0.01,
                  cold_zone_gb=0.01, semantic_truncate_threshold=0.3, warm_budget_tokens=16,
                  prefetch_strategy="adaptive")
    ids = torch.randint(3, 300, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    outputs, stats = [], []
    for knobs in ({}, {"device_staging_mb": 1.0}):
        engine = FlashMemoryEngine(model_path=str(tiny_llama), **levels, **knobs)
        engine.cache.use_attention_backend("torch")  # the torch decode path, which a GPU runs
        outputs.append(engine.score_tokens(ids, num_teacher_forced=30).decode_logprobs)
        stats.append(engine.stats())
        engine.close()
    assert torch.equal(outputs[0], outputs[1])
    assert "device_staging_hits" not in stats[0]
    assert stats[1]["device_staging_issued"] > 0 and stats[1]["device_staging_hits"] > 0
    assert stats[1]["L0_bytes_capacity"] == stats[0]["L0_bytes_capacity"] + stats[1]["device_staging_capacity_bytes"]


def test_device_staging_needs_a_prefetcher_and_counts_in_the_device_budget(tiny_llama):
    from flashmemory import FlashMemoryEngine
    from flashmemory.config import EngineConfig

    knobs = dict(model_path=str(tiny_llama), max_gpu_memory_mb=48, block_size=8, active_window=16,
                 prefetch_strategy="adaptive")
    without, with_staging = FlashMemoryEngine(**knobs), FlashMemoryEngine(**knobs, device_staging_mb=1)
    try:
        slot = without.cache.device_pool.bytes_per_slot
        fewer = without.cache.cfg.device_slots - with_staging.cache.cfg.device_slots
        assert abs(fewer * slot - 2**20) < slot  # the area's MiB came out of L0
    finally:
        without.close()
        with_staging.close()

    with pytest.raises(ConfigError, match="device_staging_mb=8 needs a prefetcher"):
        EngineConfig(device_staging_mb=8)
    with pytest.raises(ConfigError, match="device_staging_mb"):
        EngineConfig(device_staging_mb=-1, prefetch_strategy="adaptive")
