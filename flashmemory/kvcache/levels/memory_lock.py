"""Host memory locked in RAM (mlock), so the kernel never swaps it out: the seeds' --disable-swap
for the L1 level (lock_host_memory). Stdlib only.

Locking commits every page at once (the pool no longer grows as it is touched) and counts against
RLIMIT_MEMLOCK unless the process may lock without limit (CAP_IPC_LOCK, root): a pool over the
limit is refused before anything is locked, with both numbers and the fix."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from flashmemory.errors import HostBudgetError

MIB = 2**20
FIX = ("raise the limit (`ulimit -l unlimited` in the shell that starts it, "
       "LimitMEMLOCK=infinity in a systemd unit, `--ulimit memlock=-1` for docker) or lower "
       "cpu_memory_gb")


def memlock_limit_bytes() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes; None when unlimited, or where there is no such limit."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def locked_bytes() -> int | None:
    """Bytes this process has locked now (Linux: VmLck), None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmLck:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def may_lock_without_limit() -> bool:
    """CAP_IPC_LOCK in the effective set (root has it): RLIMIT_MEMLOCK does not apply."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & (1 << 14))  # CAP_IPC_LOCK = 14
    except (OSError, ValueError):
        pass
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _libc() -> ctypes.CDLL:
    if sys.platform == "win32":
        raise HostBudgetError("lock_host_memory needs mlock, which this platform (Windows) lacks; "
                              "turn lock_host_memory off")
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mlock.argtypes = libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def lock(address: int, nbytes: int, what: str) -> None:
    """Lock `nbytes` at `address` in RAM; HostBudgetError naming the limit and the fix when it
    cannot be."""
    limit = memlock_limit_bytes()
    already = locked_bytes() or 0
    if limit is not None and already + nbytes > limit and not may_lock_without_limit():
        raise HostBudgetError(
            f"lock_host_memory: {what} is {nbytes / MIB:.1f} MiB but RLIMIT_MEMLOCK allows "
            f"{limit / MIB:.1f} MiB ({already / MIB:.1f} MiB locked already); {FIX}")
    if _libc().mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) != 0:
        errno = ctypes.get_errno()
        shown = "unlimited" if limit is None else f"{limit / MIB:.1f} MiB"
        raise HostBudgetError(
            f"lock_host_memory: mlock of {what} ({nbytes / MIB:.1f} MiB) failed: "
            f"{os.strerror(errno)} (RLIMIT_MEMLOCK {shown}); {FIX}")


def unlock(address: int, nbytes: int) -> None:
    _libc().munlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))
