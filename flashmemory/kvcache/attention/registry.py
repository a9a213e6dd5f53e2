"""Attention backends by name, and the choice of one for a cache: a new backend is one file plus one line here."""

from __future__ import annotations

from collections.abc import Callable

from flashmemory.errors import ConfigError
from flashmemory.kvcache.attention.backend import AttentionBackend
from flashmemory.kvcache.attention.native_cpu import NativeCpuAttention
from flashmemory.kvcache.attention.torch_backend import TorchAttention
from flashmemory.kvcache.config import TieredCacheConfig

# name -> (factory, whether it can run this configuration)
BACKENDS: dict[str, tuple[Callable[[], AttentionBackend], Callable[[TieredCacheConfig], bool]]] = {
    "native": (NativeCpuAttention, NativeCpuAttention.supports),
    "torch": (TorchAttention, lambda cfg: True),
}
AUTO_ORDER = ("native", "torch")  # "auto" takes the first that can run


def select_backend(name: str, cfg: TieredCacheConfig) -> AttentionBackend:
    """The backend called `name` ("auto": the fastest that runs here); ConfigError if it cannot run `cfg`."""
    if name == "auto":
        name = next(n for n in AUTO_ORDER if BACKENDS[n][1](cfg))
    if name not in BACKENDS:
        raise ConfigError(f"attention backend {name!r} is unknown; use auto or one of: {', '.join(BACKENDS)}")
    factory, runs = BACKENDS[name]
    if not runs(cfg):
        raise ConfigError(f"attention backend {name!r} cannot run here (device {cfg.device}, block_size "
                          f"{cfg.block_size}, head_dim {cfg.head_dim}, or no C compiler); use auto or torch")
    return factory()
