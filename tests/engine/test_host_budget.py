"""Start-up host checks (engine/sizing.py): the L1 pool against the free RAM, the L2 file against the free disk,
refused before any weight is loaded with both numbers and the setting to change; skipped where nothing can be read."""

from __future__ import annotations

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.config import EngineConfig
from flashmemory.engine import engine as engine_module
from flashmemory.engine import sizing
from flashmemory.engine.sizing import GIB, HostFigure, available_ram, check_host_budget, free_disk
from flashmemory.errors import ConfigError, HostBudgetError

RAM_8G = HostFigure(8 * GIB, "available (MemAvailable in /proc/meminfo)")
DISK_20G = HostFigure(20 * GIB, "free on the disk of /tmp")


@pytest.fixture()
def machine(monkeypatch):
    """A machine with 8 GiB of RAM available and 20 GiB of free disk."""
    monkeypatch.setattr(sizing, "available_ram", lambda: RAM_8G)
    monkeypatch.setattr(sizing, "free_disk", lambda folder: DISK_20G)


def test_cpu_memory_beyond_the_available_ram_is_refused_naming_both_numbers_and_the_setting(machine):
    with pytest.raises(HostBudgetError) as e:
        check_host_budget(EngineConfig(cpu_memory_gb=12))
    message = str(e.value)
    assert "cpu_memory_gb=12" in message and "8.0 GiB" in message and "MemAvailable" in message
    assert isinstance(e.value, ConfigError)


def test_cold_zone_beyond_the_free_disk_is_refused_naming_both_numbers_and_the_setting(machine):
    with pytest.raises(HostBudgetError) as e:
        check_host_budget(EngineConfig(cpu_memory_gb=4, cold_zone_gb=32))
    message = str(e.value)
    assert "cold_zone_gb=32" in message and "20.0 GiB" in message and "cold_zone_dir" in message


def test_budgets_within_the_machine_pass_and_a_disabled_cold_zone_is_not_checked(machine):
    check_host_budget(EngineConfig(cpu_memory_gb=7.5, cold_zone_gb=19))
    check_host_budget(EngineConfig(cpu_memory_gb=4, cold_zone_enabled=False, cold_zone_gb=1000))


def test_unset_budgets_fit_themselves_to_a_small_machine(monkeypatch):
    monkeypatch.setattr(sizing, "available_ram", lambda: HostFigure(3 * GIB, "available"))
    monkeypatch.setattr(sizing, "free_disk", lambda folder: HostFigure(10 * GIB, "free"))
    check_host_budget(EngineConfig())  # the defaults never refuse to start
    assert sizing.host_budget_gb(EngineConfig()) == sizing.HostBudget(1.5, 5.0)  # half of what is free
    assert sizing.host_budget_gb(EngineConfig(cpu_memory_gb=2, cold_zone_gb=7)) == sizing.HostBudget(2, 7)


def test_unset_budgets_on_a_large_machine_are_the_documented_defaults(machine):
    assert sizing.host_budget_gb(EngineConfig()) == sizing.HostBudget(4.0, 10.0)  # 16 GiB capped at half of 20


def test_nothing_is_refused_where_ram_and_disk_cannot_be_read(monkeypatch):
    monkeypatch.setattr(sizing, "available_ram", lambda: None)
    monkeypatch.setattr(sizing, "free_disk", lambda folder: None)
    check_host_budget(EngineConfig(cpu_memory_gb=10**6, cold_zone_gb=10**9))


def test_available_ram_is_memavailable_from_proc_meminfo(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684092 kB\nMemFree:         1000000 kB\nMemAvailable:    2097152 kB\n")
    monkeypatch.setattr(sizing, "MEMINFO", meminfo)
    ram = available_ram()
    assert ram is not None and ram.num_bytes == 2 * GIB and "MemAvailable" in ram.source


def test_available_ram_falls_back_to_sysconf_without_meminfo(monkeypatch, tmp_path):
    monkeypatch.setattr(sizing, "MEMINFO", tmp_path / "absent")
    pages = {"SC_PHYS_PAGES": 1024, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(sizing.os, "sysconf", lambda name: pages[name])
    ram = available_ram()
    assert ram is not None and ram.num_bytes == 4 * 2**20 and "sysconf" in ram.source


def test_available_ram_is_none_where_neither_can_be_read(monkeypatch, tmp_path):
    monkeypatch.setattr(sizing, "MEMINFO", tmp_path / "absent")

    def no_sysconf(name):
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(sizing.os, "sysconf", no_sysconf)
    assert available_ram() is None


def test_free_disk_of_a_folder_not_created_yet_is_read_from_its_nearest_parent(tmp_path):
    disk = free_disk(str(tmp_path / "not" / "yet"))
    assert disk is not None and disk.num_bytes > 0 and str(tmp_path) in disk.source


def test_the_engine_refuses_before_loading_weights(machine, monkeypatch, tiny_llama):
    def must_not_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the host check")

    monkeypatch.setattr(engine_module, "build_model", must_not_load)
    with pytest.raises(HostBudgetError, match="cpu_memory_gb=64"):
        FlashMemoryEngine(model_path=str(tiny_llama), cpu_memory_gb=64)
    # The contiguous cache has no host pool and no cold zone: nothing to check.
    with pytest.raises(AssertionError, match="weights were loaded"):
        FlashMemoryEngine(model_path=str(tiny_llama), kv_cache="contiguous", cpu_memory_gb=64)

