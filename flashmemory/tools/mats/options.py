"""MatsOptions: what one `flashmemory-test mats` run was asked to do."""

from __future__ import annotations

from dataclasses import dataclass, field

LEVELS = {1: "MATS-1", 2: "MATS-2", 3: "MATS-3"}
RSS_REQUESTS = 640  # the endurance figure: RSS after this many mixed requests vs the first request's
RSS_TOLERANCE = 0.10  # ... within 10 %


@dataclass
class MatsOptions:
    """One run's settings (the command line's flags, checked there)."""

    level: int = 1  # which suite: 1 temporal stress, 2 level coherence, 3 endurance
    duration_s: float = 60.0  # how long the suite keeps the load on
    seed: int = 0  # every random choice derives from it
    workdir: str | None = None  # where cold-zone files go; None = a private temporary folder, removed after
    progress: bool = False  # draw a tqdm bar (on a terminal)
    model: str | None = None  # MATS-2's engine case, MATS-3's server; None = the embedded SmolLM2-135M-Instruct
    # MATS-3 only
    server_args: list[str] = field(default_factory=list)  # extra flags for `python -m flashmemory.serve`
    concurrency: int = 6  # clients sending requests at once
    window_s: float | None = None  # latency window length in seconds; None = a tenth of the duration
    idle_s: float = 15.0  # seconds the server is left idle before its idle RSS is read
    rss_requests: int = RSS_REQUESTS
    rss_tolerance: float = RSS_TOLERANCE
    startup_timeout_s: float = 300.0  # seconds the server may take to load its model
