"""EnduranceRun: one MATS-3 server run — the baseline at the first request, the load, the idle time after it —
and what was measured along the way (RSS and cold-zone disk every second, KV levels from /metrics at each mark)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from flashmemory.tools.mats.options import MatsOptions
from flashmemory.tools.mats.progress import Progress
from flashmemory.tools.mats.server_process import ServerProcess
from flashmemory.tools.mats.traffic import RequestRecord, Traffic

SAMPLE_EVERY_S = 1.0
CALIBRATION_WORDS = 200  # words tokenized once to size long prompts in tokens


@dataclass
class Sample:
    """The server seen from outside at one moment."""

    t_s: float  # seconds since the first request's answer
    rss_bytes: int | None
    disk_bytes: int  # allocated bytes of its cold-zone folder


class EnduranceRun:
    """Owns one server's run: its baseline, the load, the samples taken along the way."""

    def __init__(self, server: ServerProcess, options: MatsOptions) -> None:
        self.server = server
        self.options = options
        self.samples: list[Sample] = []  # RSS and disk every second, from the first request on
        self.marks: dict[str, Sample] = {}  # "first request", "end of load", "idle"
        self.kv: dict[str, dict[str, float]] = {}  # the same marks: KV blocks and committed bytes per tier
        self.records: list[RequestRecord] = []
        self.first: RequestRecord | None = None
        self.load_s = 0.0
        self.loaded_s = 0.0  # seconds the load really ran
        self.server_died = False
        self.failure: str | None = None
        self.exit_status: int | None = None
        self.log_tail = ""
        self.traffic: Traffic | None = None
        self._t0 = time.monotonic()

    def start(self) -> None:
        self.load_s = self.server.start(self.options.startup_timeout_s)
        with httpx.Client(base_url=self.server.url, timeout=60) as client:
            card = client.get("/v1/models").json()["data"][0]
            sample = " ".join(random.Random(0).choice(("the", "sea", "river", "light")) for _ in range(200))
            count = client.post("/tokenize", json={"prompt": sample}).json()["count"]
            self.traffic = Traffic(self.server.url, card["id"], int(card["max_model_len"]), count / CALIBRATION_WORDS,
                                   self.options.concurrency, self.options.seed)
            self.first = self.traffic.one(client, "chat", random.Random(self.options.seed))
        self._t0 = time.monotonic()
        self._mark("first request")

    def load(self) -> None:
        assert self.traffic is not None
        stop = threading.Event()
        progress = Progress("MATS-3", self.options.duration_s, self.options.progress)
        started = time.monotonic()
        threads = self.traffic.run(started + self.options.duration_s, stop)
        next_sample = started
        while any(t.is_alive() for t in threads):
            if time.monotonic() >= next_sample:
                self._sample()
                next_sample += SAMPLE_EVERY_S
            if not self.server.alive():
                self.server_died = True
                stop.set()
            records = self.traffic.records
            progress.update(len(records), sum(1 for r in records if not r.ok), rss_mib=_mib(self.samples))
            time.sleep(0.2)
        progress.close()
        self.loaded_s = time.monotonic() - started
        self.records = list(self.traffic.records)
        self._mark("end of load")

    def idle(self) -> None:
        """Leave the server alone for idle_s seconds (aborted sequences drain, memory settles), then read it."""
        deadline = time.monotonic() + self.options.idle_s
        while time.monotonic() < deadline and self.server.alive():
            self._sample()
            time.sleep(min(SAMPLE_EVERY_S, max(0.0, deadline - time.monotonic())))
        self._mark("idle")

    # ---- measurements -------------------------------------------------------------------------------------------

    def _sample(self) -> Sample:
        sample = Sample(time.monotonic() - self._t0, self.server.rss_bytes(), self.server.disk_bytes())
        self.samples.append(sample)
        return sample

    def _mark(self, name: str) -> None:
        if not self.server.alive():
            self.server_died = True
            return
        self.marks[name] = self._sample()
        self.kv[name] = kv_levels(self.server.url)


def kv_levels(url: str) -> dict[str, float]:
    """KV blocks held and bytes committed per tier, from the server's /metrics (empty if it cannot be read)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("flashmemory:kv_blocks", "flashmemory:kv_bytes_committed"):
            what = family.name.split(":")[1]
            for s in family.samples:
                out[f"{what} {s.labels.get('tier', '?')}"] = s.value
    return out


def _mib(samples: list[Sample]) -> str:
    return f"{samples[-1].rss_bytes / 2**20:.0f}" if samples and samples[-1].rss_bytes else "?"
