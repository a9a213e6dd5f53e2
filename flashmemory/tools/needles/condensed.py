"""The seeds' pipeline on the needle trials: a small reader model condenses each trial's haystack
(flashmemory/pipeline), the engine answers from what it kept; each trial's line says whether its
needle survived the condensation, and what the two models cost."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from flashmemory.engine.engine import FlashMemoryEngine
from flashmemory.pipeline.condense import CondensePipeline, CondenseSettings
from flashmemory.tools.needles.runner import ConfigRun, TrialResult, is_right
from flashmemory.tools.needles.tasks import NeedleTrial


def condensed_name(reader_path: str) -> str:
    return f"condensed-by-{reader_path.rstrip('/').rsplit('/', 1)[-1]}"


def run_condensed(engine: FlashMemoryEngine, reader_path: str, trials: Sequence[NeedleTrial],
                  progress: Callable[[str, int, int], None] | None = None,
                  settings: CondenseSettings | None = None) -> ConfigRun:
    """Every trial answered by `engine` (its default KV settings) from what a reader loaded from
    `reader_path` kept of the trial's haystack."""
    engine.reconfigure_kv()
    reader = FlashMemoryEngine(reader_path, num_threads=engine.config.num_threads)
    pipeline = CondensePipeline(reader, engine, settings)
    name = condensed_name(reader_path)
    run = ConfigRun(name, {"reader": reader_path, **vars(pipeline.settings)})
    reader_s, answer_s, prompts, kept = [], [], [], []
    started = time.perf_counter()
    for i, trial in enumerate(trials):
        start, end = trial.document_span
        condensed = pipeline.condense(trial.token_ids[start:end], trial.question)
        prompt = trial.token_ids[:start] + condensed.ids + trial.token_ids[end:]
        t0 = time.perf_counter()
        ids = engine.generate_token_ids(prompt, max_new_tokens=trial.max_new_tokens,
                                        temperature=0.0)
        answer_s.append(time.perf_counter() - t0)
        reader_s.append(condensed.seconds)
        prompts.append(len(prompt))
        text = engine.tokenizer.decode(condensed.ids)
        survived = all(engine.tokenizer.decode(trial.token_ids[a:b]).strip() in text
                       for a, b in trial.target_spans)
        kept.append(survived)
        answer = engine.tokenizer.decode(ids)
        run.results.append(TrialResult(
            trial.key, trial.task, trial.length_tokens, trial.depth, list(trial.expected), answer,
            is_right(answer, trial.expected),
            {"condensed": True, "needle_kept": survived, "prompt_tokens": len(prompt),
             "kept_fraction": round(condensed.kept_fraction, 4),
             "reader_s": round(condensed.seconds, 2), "reader_chunks": condensed.num_chunks}))
        if progress is not None:
            progress(name, i + 1, len(trials))
    run.seconds = time.perf_counter() - started
    reader.close()
    run.kv_stats = _summary(reader_s, answer_s, prompts, kept)
    return run


def _summary(reader_s: list[float], answer_s: list[float], prompts: list[int],
             kept: list[bool]) -> dict[str, float]:
    if not kept:
        return {}
    out: dict[str, Any] = {
        "condense_needles_kept": sum(kept) / len(kept),
        "condense_reader_s_median": statistics.median(reader_s),
        "condense_answer_s_median": statistics.median(answer_s),
        "condense_prompt_tokens_median": statistics.median(prompts),
    }
    return {k: float(v) for k, v in out.items()}
