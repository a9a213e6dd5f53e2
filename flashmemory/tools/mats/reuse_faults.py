"""MATS-2's engine case: EngineCore through the prefix-reuse path with a faulty cold zone.

Each trial starts an engine over a persistent cache that holds two documents, restarts it (the
recovered blocks live on L2 only, so every reuse reads the cold file), damages the cold file under
one document's blocks — a flipped byte in a record, the file truncated, the file deleted — and
drives EngineCore with three requests at once: one reusing the damaged document, one reusing the
other (damaged too when the whole file is), one sharing nothing. Nothing may escape a step; the two
requests the fault does not touch must give the tokens a cache-less engine gives; the damaged one
must give them too (computed again) or fail alone with a typed error, never other tokens; no KV
block may be held afterwards. Exact attention over FP16 on every level, so "the same tokens" is an
exact test.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from flashmemory.engine.request import SequenceRequest
from flashmemory.engine.sampling import SamplingParams
from flashmemory.kvcache.manager.blocks import Level
from flashmemory.tools.mats.report import Check, SuiteReport, Table

FAULT_KINDS = ("bit flip", "truncation", "deletion")
NEW_TOKENS = 6
KNOBS = dict(
    kv_precision="fp16",
    selection="exact",
    block_size=8,
    active_window=16,
    warm_tokens=16,
    recent_fp16_tokens=0,
    prefill_chunk_tokens=32,
    cpu_memory_gb=0.02,
    cold_zone_gb=0.02,
    max_num_seqs=4,
    persist_cache=True,
)
DOCUMENTS = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, "
    "and of having nothing "
    "to do: once or twice she had peeped into the book her sister was reading. ",
    "It was the best of times, it was the worst of times, it was the age of wisdom, "
    "it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity. ",
)
QUESTION = "Who is it about?"
INNOCENT = "The capital of France is"


@dataclass
class ReuseFaultTally:
    """What the trials found."""

    trials: int = 0
    faults: Counter[str] = field(default_factory=Counter)  # injected, by kind
    survived: Counter[str] = field(
        default_factory=Counter
    )  # no escape, nothing wrong served, nothing held
    engine_deaths: int = 0  # an exception escaped EngineCore.step
    innocent_harmed: int = 0  # a request the fault did not touch failed or changed
    wrong_answers: int = 0  # the damaged request served other tokens than a cache-less engine
    victims_recomputed: int = 0
    victims_failed: int = 0  # failed alone with a typed error (allowed)
    blocks_left: int = 0  # KV blocks (or sequences) still held once every request ended
    bad_blocks_dropped: int = 0  # prefix_cache_bad_blocks over all trials
    samples: list[str] = field(default_factory=list)

    def problem(self, message: str) -> None:
        if len(self.samples) < 10:
            self.samples.append(message)


def run_reuse_faults(
    model_path: str, folder: str, seed: int, deadline: float, min_trials: int
) -> ReuseFaultTally:
    """Trials until `deadline`: at least `min_trials`, one of each fault kind when there is time."""
    from flashmemory import FlashMemoryEngine

    tally = ReuseFaultTally()
    rng = random.Random(seed)
    root = Path(folder) / "reuse-faults"
    core_log = logging.getLogger("flashmemory.engine.core")
    level = core_log.level
    core_log.setLevel(logging.CRITICAL)  # each contained fault logs an error: expected here
    try:
        _trials(FlashMemoryEngine, model_path, root, rng, min_trials, deadline, tally)
    finally:
        core_log.setLevel(level)
    return tally


def _trials(
    engine_cls,
    model_path: str,
    root: Path,
    rng: random.Random,
    min_trials: int,
    deadline: float,
    tally: ReuseFaultTally,
) -> None:
    reference = engine_cls(
        model_path=model_path,
        cold_zone_dir=str(root / "reference"),
        **{**KNOBS, "persist_cache": False, "prefix_caching": False},
    )
    prompts = [d + QUESTION for d in DOCUMENTS] + [INNOCENT]
    ids = [reference.tokenizer.encode(p) for p in prompts]
    expected = [_greedy_ids(reference, [p])[0] for p in ids]
    reference.close()
    while tally.trials < min_trials or time.monotonic() < deadline:
        kind = FAULT_KINDS[tally.trials % len(FAULT_KINDS)]
        _trial(
            engine_cls, model_path, root / f"trial-{tally.trials}", kind, ids, expected, rng, tally
        )
        tally.trials += 1


def report_reuse_faults(report: SuiteReport, tally: ReuseFaultTally, model: str) -> None:
    """The engine case's table and checks, in MATS-2's report."""
    report.tables.append(
        Table(
            "Prefix reuse through EngineCore with a damaged cold zone (after a restart)",
            ["fault", "trials", "survived"],
            [[k, n, tally.survived[k]] for k, n in sorted(tally.faults.items())],
        )
    )
    report.checks += [
        Check(
            "engine deaths on the reuse path", tally.engine_deaths, "== 0", tally.engine_deaths == 0
        ),
        Check(
            "untouched requests harmed", tally.innocent_harmed, "== 0", tally.innocent_harmed == 0
        ),
        Check(
            "wrong tokens served after a fault",
            tally.wrong_answers,
            "== 0",
            tally.wrong_answers == 0,
        ),
        Check(
            "KV blocks held after the requests", tally.blocks_left, "== 0", tally.blocks_left == 0
        ),
    ]
    report.counters.update(
        {
            "reuse_trials": tally.trials,
            "reuse_victims_recomputed": tally.victims_recomputed,
            "reuse_victims_failed_alone": tally.victims_failed,
            "reuse_bad_blocks_dropped": tally.bad_blocks_dropped,
        }
    )
    report.notes.append(f"engine case: {tally.trials} trials on {model}")
    for sample in tally.samples:
        report.error_samples.append(f"reuse path: {sample}")


def _trial(
    engine_cls,
    model_path: str,
    folder: Path,
    kind: str,
    ids: list[list[int]],
    expected: list[list[int]],
    rng: random.Random,
    tally: ReuseFaultTally,
) -> None:
    first = engine_cls(model_path=model_path, cold_zone_dir=str(folder), **KNOBS)
    _greedy_ids(first, ids[:2])  # both documents cached, then written down at close
    first.close()
    engine = engine_cls(model_path=model_path, cold_zone_dir=str(folder), **KNOBS)
    try:
        blocks = engine.cache.prefix_cache.match(ids[0], count=False)
        cold = [b for b in blocks if set(b.slots) == {Level.DISK}]
        if not cold:
            tally.problem(f"trial {tally.trials}: no recovered block on L2 to damage")
            return
        # Every other trial the newest block, which the reuse restores into the window (read at
        # admission);
        # otherwise any, which may be read only by a later decode step.
        _damage(engine, cold[-1] if tally.trials % 2 == 0 else rng.choice(cold), kind)
        tally.faults[kind] += 1
        ok = _drive(engine, kind, ids, expected, tally)
        held = _blocks_held(engine)
        if held:
            tally.blocks_left += held
            tally.problem(f"{kind}: {held} KV blocks or sequences held after every request ended")
        if ok and not held:
            tally.survived[kind] += 1
        tally.bad_blocks_dropped += int(engine.stats().get("prefix_cache_bad_blocks", 0))
    finally:
        engine.close()


def _damage(engine, block, kind: str) -> None:
    pool = engine.cache.disk_pool
    offset = block.slots[Level.DISK] * pool.record_bytes
    if kind == "bit flip":
        with open(pool.path, "r+b") as f:
            f.seek(offset + pool.header_bytes + 1)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    elif kind == "truncation":
        os.truncate(pool.path, offset)
    else:
        os.unlink(pool.path)


def _drive(
    engine, kind: str, ids: list[list[int]], expected: list[list[int]], tally: ReuseFaultTally
) -> bool:
    """The three requests at once through EngineCore; True when every check held."""
    outs: dict[int, list] = {i: [] for i in range(len(ids))}
    core = engine.core
    for i, prompt in enumerate(ids):
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        core.add(SequenceRequest(i, prompt, params, time.perf_counter()), outs[i].append)
    try:
        while core.has_work():
            for sink, out in core.step():
                sink(out)
    except Exception as e:  # noqa: BLE001 - the defect this case exists to catch
        tally.engine_deaths += 1
        tally.problem(f"an exception escaped EngineCore.step: {type(e).__name__}: {e}")
        return False
    ok = True
    touched = (
        {0} if kind == "bit flip" else {0, 1}
    )  # a file-level fault hits both documents' blocks
    for i, out in outs.items():
        got = [o.token_id for o in out if o.token_id is not None]
        failed = bool(out) and out[-1].error is not None
        if i in touched and failed:
            tally.victims_failed += 1
        elif i in touched and got == expected[i]:
            tally.victims_recomputed += 1
        elif i in touched:
            tally.wrong_answers += 1
            ok = False
            tally.problem(
                f"{kind}: request {i} on damaged blocks gave {got}, "
                f"a cache-less engine {expected[i]}"
            )
        elif failed or got != expected[i]:
            tally.innocent_harmed += 1
            ok = False
            tally.problem(
                f"{kind}: request {i}, untouched by the fault, "
                + (f"failed: {out[-1].error}" if failed else f"gave {got} instead of {expected[i]}")
            )
    return ok


def _blocks_held(engine) -> int:
    held = sum(lv.blocks for lv in engine.cache.kv_stats().levels)
    return len(engine.cache.sequence_ids()) + held


def _greedy_ids(engine, prompts: list[list[int]]) -> list[list[int]]:
    outs: dict[int, list] = {i: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        engine.core.add(SequenceRequest(i, prompt, params, time.perf_counter()), outs[i].append)
    while engine.core.has_work():
        for sink, out in engine.core.step():
            sink(out)
    return [[o.token_id for o in outs[i] if o.token_id is not None] for i in range(len(prompts))]
