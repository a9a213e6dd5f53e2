"""The measured workload of a diagnose run: one prompt prefilled and a few greedy tokens decoded through the
engine core (the path the API and the server take), every step timed by part, the cache looked at as it ends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashmemory.engine.request import SequenceRequest
from flashmemory.engine.sampling import SamplingParams
from flashmemory.errors import ConfigError
from flashmemory.kvcache.device_budget import read_counter
from flashmemory.kvcache.kv_stats import KVStats
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.tools.diagnose.pools import PoolLayout, pool_layouts
from flashmemory.tools.diagnose.timers import PhaseClock, instrument, timer_cost_s

LICENSES = Path("/usr/share/common-licenses")


def long_text() -> str:
    """Long English prose for a prompt of N tokens: ../shared/data/alice29.txt when present, else the licences
    every Debian machine has, else a generated text."""
    from flashmemory.tools.eval import default_text_path

    path = default_text_path()
    if path is not None:
        return path.read_text(encoding="utf-8", errors="replace")
    if LICENSES.is_dir():
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(LICENSES.iterdir()) if p.is_file()]
        if texts:
            return "\n\n".join(texts)
    words = "the memory hierarchy keeps hot keys on the device warm ones in host memory and cold ones on disk".split()
    return " ".join(words[(i * 7) % len(words)] for i in range(200_000))


def prompt_ids(engine, length_tokens: int, text: str | None = None) -> list[int]:
    """`length_tokens` tokens of `text` (or of long_text()), repeated when the text is shorter."""
    ids = engine.tokenizer.encode(text if text is not None else long_text())
    if not ids:
        raise ConfigError("the prompt text has no tokens")
    while len(ids) < length_tokens:
        ids = ids + ids
    return ids[:length_tokens]


@dataclass
class StepRecord:
    """One engine step: what kind, how many tokens went through the model, how long, and its parts (seconds)."""

    kind: str  # "prefill" (a chunk of the prompt) or "decode" (one token)
    tokens: int
    seconds: float
    parts: dict[str, float]


@dataclass
class Measurement:
    """Everything one diagnose run measured."""

    num_prompt_tokens: int
    num_decode_tokens: int
    steps: list[StepRecord]
    stats_before: KVStats  # cache.kv_stats() before the run
    stats_after_prefill: KVStats  # after the last prefill step
    stats_end: KVStats  # just before the sequence was freed
    pools: dict[Level, PoolLayout]  # every level's slots just before the sequence was freed
    peak_l0_slots: int  # most L0 slots in use after any step
    reads_decode: dict[Level, int]  # blocks (per KV head) decode steps read from each level
    timer_events: int
    timer_cost_s: float  # one timer's cost, measured before the run
    output_ids: list[int] = field(default_factory=list)
    row_reads_decode: int = 0  # of reads_decode[L0]: blocks attended from the FP16 rows of the newest tokens

    def steps_of(self, kind: str) -> list[StepRecord]:
        return [s for s in self.steps if s.kind == kind]

    def seconds(self, kind: str) -> float:
        return sum(s.seconds for s in self.steps_of(kind))


def run_workload(engine, ids: list[int], decode_tokens: int) -> Measurement:
    """Prefill `ids` and decode `decode_tokens` greedy tokens (end-of-sequence ignored) with the timers on."""
    engine.check_prompt(ids, decode_tokens)
    cache = engine.cache
    tiered = hasattr(cache, "blocks")
    sync = (lambda: torch.cuda.synchronize(engine.device)) if engine.device.type == "cuda" else (lambda: None)
    cost = timer_cost_s()
    clock = PhaseClock(sync=sync)
    backend = getattr(cache, "attention", None)  # restored afterwards unless a budget controller counts reads
    counter = read_counter(cache) if tiered else None
    reads_before = dict(counter.reads) if counter else {}
    row_reads_before = counter.row_reads if counter else 0
    core = engine.core
    outputs: list = []
    request = SequenceRequest(0, list(ids), SamplingParams(max_new_tokens=decode_tokens, ignore_eos=True),
                              time.perf_counter())
    end_state: dict = {}
    free = cache.free_sequence

    def snapshot_then_free(seq_id: int) -> None:
        end_state["stats"] = cache.kv_stats()
        end_state["pools"] = pool_layouts(cache) if tiered else {}
        end_state["reads"] = dict(counter.reads) if counter else {}
        end_state["row_reads"] = counter.row_reads if counter else 0
        free(seq_id)

    stats_before = cache.kv_stats()
    stats_after_prefill = stats_before
    steps: list[StepRecord] = []
    peak = 0
    cache.free_sequence = snapshot_then_free
    try:
        with instrument(engine, clock) as last, torch.inference_mode():
            core.add(request, outputs.append)
            while core.has_work():
                clock.take_step()
                started = time.perf_counter()
                deliveries = engine.step_core(core)
                sync()
                seconds = time.perf_counter() - started
                kind = "prefill" if last["tokens"] > 1 else "decode"
                steps.append(StepRecord(kind, last["tokens"], seconds, clock.take_step()))
                for sink, out in deliveries:
                    sink(out)
                if tiered:
                    peak = max(peak, cache.blocks.allocators[Level.DEVICE].num_used)
                if kind == "prefill" and "stats" not in end_state:
                    stats_after_prefill = cache.kv_stats()
    finally:
        del cache.free_sequence
        if tiered:
            cache.attention = backend
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise ConfigError(f"the diagnose workload failed: {errors[0]}")
    reads_end = end_state.get("reads", {})
    reads = {level: reads_end.get(level, 0) - reads_before.get(level, 0) for level in reads_end}
    return Measurement(len(ids), decode_tokens, steps, stats_before, stats_after_prefill,
                       end_state.get("stats") or cache.kv_stats(), end_state.get("pools", {}),
                       peak, reads,
                       clock.events, cost, [o.token_id for o in outputs if o.token_id is not None],
                       end_state.get("row_reads", row_reads_before) - row_reads_before)
