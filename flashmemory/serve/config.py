"""ServerConfig: the HTTP server's settings (the engine's are EngineConfig's), validated with the fix in the message."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from flashmemory.errors import ConfigError

DEFAULT_MAX_NUM_SEQS = 16  # the server's default for EngineConfig.max_num_seqs (the Python API's is 4)


@dataclass
class ServerConfig:
    """Settings of one OpenAI-compatible server."""

    host: str = "127.0.0.1"  # interface to bind; anything but loopback needs api_key or allow_unauthenticated
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # Bearer key for every route but /health; never logged
    allow_unauthenticated: bool = False  # permit a non-loopback host without api_key (a trusted network)
    enable_streaming: bool = True  # False: stream=true is a 400
    served_model_name: str | None = None  # the model id clients send; None = the checkpoint's file or folder name
    max_body_bytes: int = 8 * 2**20  # larger request bodies get 413
    max_n: int = 8  # choices per request (n) at most
    max_tokens_limit: int = 4096  # max_tokens at most (also the default for chat, capped by the context)
    max_pending_requests: int = 256  # sequences accepted and unfinished at once; more get 503
    max_num_batched_tokens: int | None = None  # tokens in one forward (decodes + prefill chunks); None = prefill chunk
    stats_log_interval_s: float = 10.0  # seconds between stats lines (none while idle); 0 = off
    log_level: str = "info"

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        need(isinstance(self.port, int) and 1 <= self.port <= 65535, f"port={self.port!r} must be in 1..65535")
        for name in ("max_body_bytes", "max_n", "max_tokens_limit", "max_pending_requests"):
            value = getattr(self, name)
            need(isinstance(value, int) and value >= 1, f"{name}={value!r} must be a positive integer")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens={self.max_num_batched_tokens!r} must be a positive integer")
        need(self.stats_log_interval_s >= 0, f"stats_log_interval_s={self.stats_log_interval_s!r} must be >= 0")
        need(self.api_key is None or len(self.api_key) > 0, "api_key must not be empty (omit it to run without a key)")
        need(self.log_level.lower() in ("critical", "error", "warning", "info", "debug", "trace"),
             f"log_level={self.log_level!r}: use debug, info, warning, error or critical")
        need(self.api_key is not None or self.allow_unauthenticated or is_loopback(self.host),
             f"refusing to listen on {self.host} without an API key: anyone who can reach it could use the model. "
             "Set --api-key (or FLASHMEMORY_API_KEY), bind 127.0.0.1, or pass --allow-unauthenticated on a trusted "
             "network")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything
