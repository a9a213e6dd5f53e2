"""ServerState: what the routes share — settings, the engine worker, metrics, the count of pending sequences and the
requests in flight (for the drain at shutdown)."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from flashmemory.serve.api_errors import APIError, without_paths
from flashmemory.serve.config import ServerConfig
from flashmemory.serve.metrics import ServerMetrics
from flashmemory.serve.worker import EngineWorker


@dataclass
class ServerState:
    """Owns the per-server objects; lives on app.state.server and is touched only from the event loop."""

    config: ServerConfig
    worker: EngineWorker
    metrics: ServerMetrics
    model_name: str
    num_pending: int = 0  # sequences accepted and not yet finished or aborted
    created: int = field(default_factory=lambda: int(time.time()))  # unix time the server started
    shutting_down: bool = False  # set by the drain (serve/shutdown.py): nothing new is admitted
    # RequestStreams with sequences submitted (generation.py); weak, since a response that never started leaves
    # nothing to end and must not be kept alive by this set.
    streams: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)

    def require_ready(self) -> None:
        """503 unless the engine is up and the server is not shutting down."""
        if self.shutting_down:
            raise self.shutting_down_error()
        state = self.worker.state
        if state == "loading":
            raise APIError(503, "the model is still loading; retry when GET /health returns 200",
                           code="model_loading", headers={"Retry-After": "5"})
        if state != "ready":
            detail = f": {without_paths(self.worker.error)}" if self.worker.error else ""
            raise APIError(503, f"the engine is not running{detail}", code="engine_dead")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def shutting_down_error(self, message: str = "the server is shutting down and takes no new requests") -> APIError:
        return APIError(503, f"{message}; retry against another replica or once it is back", code="shutting_down",
                        headers={"Retry-After": "5"})

    def reserve(self, num_seqs: int) -> None:
        """Count new sequences as pending, or 503 when the queue is full or the server is shutting down."""
        if self.shutting_down:  # it began while this request was being tokenized
            raise self.shutting_down_error()
        limit = self.config.max_pending_requests
        if num_seqs > limit:  # could never be served: not a reason to retry
            raise APIError(400, f"this request asks for {num_seqs} sequences (prompts x n); the server takes at most "
                           f"{limit} at once (--max-pending-requests)", param="n", code="invalid_value")
        if self.num_pending + num_seqs > limit:
            raise APIError(503, f"the server is busy: {self.num_pending} sequences are pending and the limit is "
                           f"{limit} (--max-pending-requests); retry later", code="server_overloaded",
                           headers={"Retry-After": "1"})
        self.num_pending += num_seqs

    def release(self, num_seqs: int) -> None:
        self.num_pending -= num_seqs
