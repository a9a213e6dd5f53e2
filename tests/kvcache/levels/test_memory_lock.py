"""lock_host_memory (--disable-swap): the L1 pool locked in RAM and unlocked on close; a pool over
RLIMIT_MEMLOCK refused before anything is locked, naming both numbers and the fix; the package
imports where Unix-only modules are missing (Windows)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flashmemory.errors import HostBudgetError
from flashmemory.kvcache.config import level_codecs
from flashmemory.kvcache.levels import memory_lock
from flashmemory.kvcache.levels.tensor_pool import TensorPool
from flashmemory.kvcache.manager.blocks import Level

pytestmark = pytest.mark.skipif(memory_lock.locked_bytes() is None, reason="needs Linux /proc")


def pool(num_slots: int, lock: bool) -> TensorPool:
    codec = level_codecs("mixed", 16, 64)[Level.HOST]  # FP16
    return TensorPool(Level.HOST, codec, num_slots, 2, 2, 16, 64, torch.device("cpu"),
                      lock_memory=lock)


def test_a_locked_pool_is_resident_and_unlocked_on_close():
    before = memory_lock.locked_bytes()
    if memory_lock.memlock_limit_bytes() is not None and not memory_lock.may_lock_without_limit():
        pytest.skip("RLIMIT_MEMLOCK is limited here and the process may not exceed it")
    p = pool(64, lock=True)
    assert p.locked_bytes == p.capacity_bytes == 64 * 2 * 2 * 16 * 64 * 2 * 2
    assert memory_lock.locked_bytes() - before >= p.capacity_bytes - 4096  # page rounding
    assert p.counters()["bytes_committed"] == p.capacity_bytes  # all of it, touched or not
    p.close()
    assert memory_lock.locked_bytes() <= before + 4096


def test_an_unlocked_pool_locks_nothing():
    before = memory_lock.locked_bytes()
    p = pool(64, lock=False)
    assert p.locked_bytes == 0 and memory_lock.locked_bytes() == before


def test_a_pool_over_the_limit_is_refused_naming_both_numbers_and_the_fix(monkeypatch):
    monkeypatch.setattr(memory_lock, "memlock_limit_bytes", lambda: 64 * 1024)
    monkeypatch.setattr(memory_lock, "may_lock_without_limit", lambda: False)
    with pytest.raises(HostBudgetError) as e:
        pool(64, lock=True)
    message = str(e.value)
    assert "the L1 pool is 1.0 MiB but RLIMIT_MEMLOCK allows 0.1 MiB" in message
    assert "ulimit -l unlimited" in message and "lower cpu_memory_gb" in message


def test_a_failing_mlock_says_why(monkeypatch):
    class Libc:
        @staticmethod
        def mlock(address, n):
            import ctypes

            ctypes.set_errno(12)
            return -1

    monkeypatch.setattr(memory_lock, "_libc", lambda: Libc)
    monkeypatch.setattr(memory_lock, "memlock_limit_bytes", lambda: None)
    with pytest.raises(HostBudgetError, match=r"mlock of the L1 pool \(1.0 MiB\) failed: Cannot "
                                              r"allocate memory \(RLIMIT_MEMLOCK unlimited\)"):
        pool(64, lock=True)


def test_the_engine_locks_its_l1_pool_with_the_seeds_flag_name(tiny_llama):
    from flashmemory import FlashMemoryEngine
    from flashmemory.cli import build_parser
    from flashmemory.config_args import engine_kwargs

    if memory_lock.memlock_limit_bytes() is not None and not memory_lock.may_lock_without_limit():
        pytest.skip("RLIMIT_MEMLOCK is limited here")
    args = build_parser().parse_args(["generate", "--disable-swap", "--prompt", "x"])
    assert engine_kwargs(args) == {"lock_host_memory": True}
    before = memory_lock.locked_bytes()
    engine = FlashMemoryEngine(model_path=str(tiny_llama), max_seq_len=128, cpu_memory_gb=0.01,
                               lock_host_memory=True)
    try:
        l1 = engine.cache.levels[Level.HOST]
        assert l1.locked_bytes > 0 and memory_lock.locked_bytes() - before >= l1.locked_bytes - 4096
        assert engine.generate("hello", max_new_tokens=4)  # it serves as before
    finally:
        engine.close()
    assert memory_lock.locked_bytes() <= before + 4096


def test_the_package_imports_without_unix_only_modules():
    code = ("import sys; sys.modules['resource'] = None; sys.modules['fcntl'] = None; "
            "import flashmemory, flashmemory.engine.engine, flashmemory.serve.app; "
            "import flashmemory.cli; "
            "from flashmemory.rss import peak_rss_bytes; print(peak_rss_bytes() >= 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
