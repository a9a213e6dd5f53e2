"""`flashmemory doctor`: runs clean here, its JSON is what docs/doctor.md documents, and each check warns or fails
with the fix when the machine falls short (simulated where this machine cannot show it)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from flashmemory.cli import main
from flashmemory.config import EngineConfig
from flashmemory.engine import sizing
from flashmemory.model import cuda_weights
from flashmemory.tools import disk_probe
from flashmemory.tools.doctor import checks, run_doctor
from flashmemory.tools.doctor.checks import STATUSES

NAMES = ["python", "torch", "c_compiler", "native_kernels", "ram", "swap", "memlock", "numa",
         "cold_zone_disk", "cold_zone_iops",
         "cuda", "cuda_weights", "pinned_memory", "windows_driver_model", "default_model"]


def test_doctor_runs_clean_on_this_machine(capsys, tmp_path):
    rc = main(["doctor", "--disk-seconds", "0.2", "--cold-zone-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "FAIL" not in out
    assert all(f"  {name} " in out for name in NAMES)
    assert out.splitlines()[-1].endswith("not applicable")


def test_the_json_report_has_the_documented_shape(capsys, tmp_path):
    assert main(["doctor", "--json", "--disk-seconds", "0.1", "--cold-zone-dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"schema", "flashmemory_version", "platform", "settings", "checks", "counts", "ok"}
    assert report["schema"] == "flashmemory-doctor/1" and report["ok"] is True
    assert [c["name"] for c in report["checks"]] == NAMES
    for c in report["checks"]:
        assert set(c) == {"name", "status", "summary", "fix", "data"} and c["status"] in STATUSES
        assert (c["fix"] is None) == (c["status"] in ("pass", "n/a"))
    assert sum(report["counts"].values()) == len(NAMES)
    iops = next(c for c in report["checks"] if c["name"] == "cold_zone_iops")["data"]
    assert iops["random_iops_parallel"] > 0 and iops["method"] in ("O_DIRECT", "posix_fadvise(DONTNEED)")


def test_an_l1_pool_larger_than_the_ram_fails_with_the_setting_to_lower(monkeypatch, capsys):
    monkeypatch.setattr(sizing, "available_ram", lambda: sizing.HostFigure(2 * 2**30, "available (test)"))
    rc = main(["doctor", "--cpu-memory-gb", "3", "--disk-seconds", "0"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL  ram" in out and "fix: lower cpu_memory_gb below 2.0" in out
    assert checks.check_ram(EngineConfig(cpu_memory_gb=1.5)).status == "warn"  # over half the RAM


def test_a_slow_cold_zone_disk_warns_with_the_seeds_50k_rule(monkeypatch, tmp_path):
    slow = disk_probe.DiskSpeed(str(tmp_path), "ext4", "O_DIRECT", 2**26, 3000.0, 300.0, 900.0, 12000.0, 8, 150.0)
    monkeypatch.setattr(disk_probe, "probe_disk", lambda folder, seconds: slow)
    check = checks.check_disk_speed(EngineConfig(cold_zone_dir=str(tmp_path)), 1.0)
    assert check.status == "warn" and "12,000 IOPS" in check.summary
    assert "below 50,000 IOPS" in check.fix and "cold_zone_enabled=False" in check.fix and "--no-cold-zone" in check.fix


def test_a_cold_zone_on_a_ram_file_system_is_called_out(monkeypatch, tmp_path):
    ram = disk_probe.DiskSpeed(str(tmp_path), "tmpfs", "O_DIRECT", 2**26, 5e5, 1.0, 2.0, 4e5, 8, 5000.0)
    monkeypatch.setattr(disk_probe, "probe_disk", lambda folder, seconds: ram)
    check = checks.check_disk_speed(EngineConfig(cold_zone_dir=str(tmp_path)), 1.0)
    assert check.status == "warn" and "RAM file system" in check.summary


def test_with_the_cold_zone_off_the_disk_checks_do_not_apply():
    report = run_doctor(EngineConfig(cold_zone_enabled=False), disk_seconds=1.0)
    statuses = {c.name: c.status for c in report.checks}
    assert statuses["cold_zone_disk"] == statuses["cold_zone_iops"] == "n/a"


def test_kernels_turned_off_or_no_compiler_warn_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHMEMORY_NATIVE", "0")
    check = checks.check_native_kernels()
    assert check.status == "warn" and "FLASHMEMORY_NATIVE" in check.fix
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    check = checks.check_compiler()
    assert check.status == "warn" and "does not run" in check.summary


def test_the_windows_driver_model_is_checked_on_windows_only(monkeypatch):
    assert checks.check_driver_model().status == "n/a"
    monkeypatch.setattr(checks.sys, "platform", "win32")
    monkeypatch.setattr(checks, "_nvidia_smi", lambda *q: ["NVIDIA GeForce RTX 4060 Laptop GPU, WDDM"])
    check = checks.check_driver_model()
    assert check.status == "warn" and "TCC" in check.fix
    monkeypatch.setattr(checks, "_nvidia_smi", lambda *q: ["NVIDIA RTX A4000, TCC"])
    assert checks.check_driver_model().status == "pass"


def test_memlock_fails_only_when_locking_is_asked_and_the_limit_is_under_the_pool(monkeypatch):
    from flashmemory.kvcache.levels import memory_lock

    monkeypatch.setattr(memory_lock, "memlock_limit_bytes", lambda: 8 * 2**20)
    monkeypatch.setattr(memory_lock, "may_lock_without_limit", lambda: False)
    asked = checks.check_memlock(EngineConfig(cpu_memory_gb=1.0, lock_host_memory=True))
    assert asked.status == "fail" and "8.0 MiB is under the 1.0 GiB L1 pool" in asked.summary
    assert "ulimit -l" in asked.fix
    assert checks.check_memlock(EngineConfig(cpu_memory_gb=1.0)).status == "pass"
    small = EngineConfig(cpu_memory_gb=0.005, lock_host_memory=True)
    assert checks.check_memlock(small).status == "pass"


def test_a_check_that_crashes_is_reported_and_the_others_run(monkeypatch):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(checks, "check_numa", broken)
    report = run_doctor(EngineConfig(cold_zone_enabled=False))
    numa = next(c for c in report.checks if c.name == "numa")
    assert numa.status == "fail" and "boom" in numa.summary and len(report.checks) == len(NAMES)


def test_the_disk_probe_reads_real_blocks_and_cleans_up(tmp_path):
    speed = disk_probe.probe_disk(tmp_path, file_mb=4, seconds=0.05, threads=2)
    assert speed.random_iops_qd1 > 0 and speed.random_iops_parallel > 0 and speed.sequential_mb_s > 0
    assert speed.random_latency_us_p50 <= speed.random_latency_us_p99
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    assert disk_probe.filesystem_of("/") is not None


@pytest.mark.parametrize("status", STATUSES)
def test_every_status_prints_in_the_text_report(status):
    from flashmemory.tools.doctor.checks import Check
    from flashmemory.tools.doctor.report import DoctorReport

    text = DoctorReport([Check("x", status, "found", None if status in ("pass", "n/a") else "do this")], {}, {}).text()
    assert text.startswith(status.upper()) and ("fix: do this" in text) == (status in ("warn", "fail"))


def test_cuda_weight_only_is_not_applicable_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check = checks.check_cuda_weights()
    assert check.status == "n/a" and "no CUDA device" in check.summary and check.fix is None


def test_cuda_weight_only_without_torchao_warns_with_the_install_command(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now raises ImportError
    check = checks.check_cuda_weights()
    assert check.status == "warn" and "pip install torchao==0.18.0" in check.fix


def test_cuda_weight_only_on_a_gpu_older_than_sm80_offers_int8_only(monkeypatch):
    pytest.importorskip("torchao", reason="torchao is not installed: pip install torchao==0.18.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    monkeypatch.setattr(cuda_weights, "torchao_version", lambda: cuda_weights.TORCHAO_VERSION)
    check = checks.check_cuda_weights()
    assert check.status == "warn" and "Tesla T4 (sm 7.5)" in check.summary and "q8_0" in check.fix
