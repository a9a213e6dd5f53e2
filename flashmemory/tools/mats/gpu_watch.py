"""GpuWatch: temperature, clocks, throttle reasons and ECC error counts of the GPUs through NVML (pynvml), sampled
while MATS-3 keeps the server busy. Where there is no GPU, or no NVML, it says so and measures nothing."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

SAMPLE_EVERY_S = 2.0
TEMPERATURE_WARN_C = 85  # the seed's threshold for GDDR/HBM: above it ECC corrections become likely
ECC_CORRECTED_WARN = 10  # corrected ECC errors during one run before a warning (the seed's example threshold)


@dataclass
class GpuSample:
    index: int
    temperature_c: int | None
    sm_clock_mhz: int | None
    memory_clock_mhz: int | None
    throttle_reasons: int | None  # NVML's bit mask (0: not throttled)
    ecc_corrected: int | None  # volatile counts since the driver loaded; None where ECC is off or unsupported
    ecc_uncorrected: int | None


@dataclass
class GpuSummary:
    """What one run's samples say, per GPU."""

    skipped: str | None = None  # why nothing was measured, e.g. "skipped: no GPU"
    gpus: list[dict] = field(default_factory=list)


class GpuWatch:
    """Owns the NVML handle and a sampling thread."""

    def __init__(self, nvml, handles: list) -> None:
        self.nvml = nvml
        self.handles = handles
        self.samples: list[GpuSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mats-gpu-watch", daemon=True)

    @classmethod
    def open(cls) -> tuple["GpuWatch | None", str | None]:
        """A watch over every GPU NVML sees, or (None, why not)."""
        try:
            import pynvml
        except ImportError:
            if _cuda_available():
                return None, "skipped: pynvml is not installed (pip install nvidia-ml-py)"
            return None, "skipped: no GPU"
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as e:  # noqa: BLE001 - pynvml raises NVMLError subclasses and OSError for a missing library
            return None, f"skipped: no GPU (NVML: {e})"
        if count == 0:
            return None, "skipped: no GPU (NVML sees none)"
        return cls(pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]), None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> GpuSummary:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.sample()
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        return self.summary()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self.sample()

    def sample(self) -> None:
        nv = self.nvml
        for i, h in enumerate(self.handles):
            self.samples.append(GpuSample(
                i, _read(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                _read(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                _read(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
                _read(getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                      or nv.nvmlDeviceGetCurrentClocksThrottleReasons, h),
                _read(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
                _read(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                      nv.NVML_VOLATILE_ECC)))

    def summary(self) -> GpuSummary:
        out = GpuSummary()
        for i in range(len(self.handles)):
            mine = [s for s in self.samples if s.index == i]
            out.gpus.append({
                "gpu": i, "samples": len(mine),
                "temperature_c_max": _max(s.temperature_c for s in mine),
                "sm_clock_mhz_min": _min(s.sm_clock_mhz for s in mine),
                "sm_clock_mhz_max": _max(s.sm_clock_mhz for s in mine),
                "memory_clock_mhz_min": _min(s.memory_clock_mhz for s in mine),
                "throttled_samples": sum(1 for s in mine if s.throttle_reasons),
                "ecc_corrected_delta": _delta([s.ecc_corrected for s in mine]),
                "ecc_uncorrected_delta": _delta([s.ecc_uncorrected for s in mine]),
            })
        return out


def _read(fn, *args):
    """One NVML reading, None where the GPU does not support it."""
    try:
        return int(fn(*args))
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends
        return None


def _max(values) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _min(values) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _delta(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return known[-1] - known[0] if len(known) >= 2 else None


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
