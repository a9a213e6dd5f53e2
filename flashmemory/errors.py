"""Typed errors: everything a user, a file or the disk can cause raises one of these."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class FlashMemoryError(Exception):
    """Base class of every error FlashMemory raises on purpose."""

    seq_id: int | None = None  # the sequence being served when it was raised (set by the cache), if one


class ConfigError(FlashMemoryError, ValueError):
    """An engine or CLI setting is unknown or out of range."""


class ModelNotFoundError(FlashMemoryError, FileNotFoundError):
    """The model path does not exist, is unreadable, or holds no model."""


class UnsupportedModelError(FlashMemoryError, ValueError):
    """The checkpoint's architecture, tensor type or config is not one we run."""


class CorruptWeightsError(FlashMemoryError, ValueError):
    """A weights file is truncated, malformed, or misses tensors the config requires."""


class PromptTooLongError(FlashMemoryError, ValueError):
    """The prompt (plus requested tokens) does not fit the model's context."""

    def __init__(self, message: str, *, max_model_len: int, num_prompt_tokens: int) -> None:
        super().__init__(message)
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens


class KVSnapshotError(FlashMemoryError, ValueError):
    """A KV snapshot file is truncated, corrupt, or was made by another model, settings or token sequence."""


class SamplingParamsError(FlashMemoryError, ValueError):
    """A sampling parameter (temperature, top_p, ...) is invalid."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class ColdBlockError(FlashMemoryError, OSError):
    """A block on the disk level is missing, truncated or corrupt; it is never served."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # "missing" | "truncated" | "checksum" | "header"


class RemoteUnavailableError(FlashMemoryError, ConnectionError):
    """The shared KV level (remote_kv_url) cannot be reached and remote_kv_required is set."""


class MemoryBudgetError(ConfigError):
    """The device-memory budget cannot hold the weights, the workspace and the hot KV window."""


class HostBudgetError(ConfigError):
    """cpu_memory_gb or cold_zone_gb asks for more RAM or disk than the machine has free."""


class SessionsUnavailableError(ConfigError):
    """Named sessions were asked of a KV cache that keeps none (contiguous, or no prefix cache)."""


class CapacityError(FlashMemoryError, MemoryError):
    """A KV level is full at run time and nothing can be demoted (e.g. host memory with the cold zone off)."""


class ColdZoneFullError(CapacityError):
    """The cold-zone disk has no room for a block (ENOSPC, a quota): the slot was released, nothing half-written."""


class ColdZoneWriteError(FlashMemoryError, OSError):
    """A block could not be written to the cold zone (an I/O error other than a full disk)."""


class EngineBusyError(FlashMemoryError, RuntimeError):
    """An operation that needs an idle engine (clear_cache, reconfigure_kv) met running sequences."""


class DeviceLostError(FlashMemoryError, RuntimeError):
    """The compute device failed (a CUDA error poisons its context): the engine cannot go on and must restart."""


def blame_sequence(error: Exception, seq_id: int) -> None:
    """Name the sequence being served on an error raised while serving it (unless a deeper frame already did)."""
    if getattr(error, "seq_id", None) is None:
        try:
            error.seq_id = seq_id  # type: ignore[attr-defined]
        except AttributeError:  # an exception type that takes no attributes: the engine fails the whole step
            pass


@contextmanager
def serving_sequence(seq_id: int) -> Iterator[None]:
    """Blame what the block raises on sequence `seq_id` (one sequence's work in a batch's call)."""
    try:
        yield
    except Exception as e:
        blame_sequence(e, seq_id)
        raise
