"""`flashmemory doctor`: is this machine ready to run FlashMemory, and what to fix (see checks.py and
docs/doctor.md)."""

from flashmemory.tools.doctor.report import DoctorReport, run_doctor

__all__ = ["DoctorReport", "run_doctor"]
