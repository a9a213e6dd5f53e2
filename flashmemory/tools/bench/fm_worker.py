"""FlashMemory in a worker process: speed (through generate) and fidelity (through `flashmemory eval`'s scoring)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from flashmemory.tools.bench.engines import REFERENCE_ENGINE
from flashmemory.tools.bench.jobs import FidelityJob, FidelityResult, SpeedJob, SpeedResult, read_token_ids
from flashmemory.tools.bench.prefetch_figures import prefetch_figures
from flashmemory.engine.stats import peak_memory

WARMUP_PROMPT_TOKENS = 16


def peak_rss_bytes() -> int:
    """Peak resident set of this process (the worker runs one engine, so this is that engine's)."""
    return peak_memory(torch.device("cpu"))[0]


def kv_bytes(kv_stats: dict[str, Any]) -> dict[str, int]:
    """Device (allocated and used), host and disk KV bytes from the cache's counters as the request ended."""
    if "kv_bytes_allocated" in kv_stats:  # the contiguous cache: one buffer per sequence, all on the device
        return {"device": int(kv_stats["kv_bytes_allocated"]), "device_used": int(kv_stats["kv_bytes_used"]),
                "host": 0, "disk": 0}
    return {
        # The L0 arena is allocated whole at start-up (max_gpu_memory_mb or the window), so it is what the
        # device holds for KV, whatever part of it the sequence fills.
        "device": int(kv_stats.get("L0_bytes_capacity", kv_stats.get("L0_bytes", 0))),
        "device_used": int(kv_stats.get("L0_bytes", 0)),
        "host": int(kv_stats.get("L1_bytes", 0)),
        "disk": int(kv_stats.get("L2_bytes", 0)),
    }


def measure_speed(job: SpeedJob) -> SpeedResult:
    from flashmemory.engine.engine import FlashMemoryEngine

    engine = FlashMemoryEngine(model_path=job.folder, dtype=job.dtype, num_threads=job.num_threads, **job.settings)
    try:
        ids = read_token_ids(job.ids_path, job.prompt_tokens)
        engine.generate_token_ids(ids[:WARMUP_PROMPT_TOKENS], max_new_tokens=2, ignore_eos=True)
        before = dict(engine.cache.stats())  # cumulative counters (prefetch) without the warm-up's share
        engine.generate_token_ids(ids, max_new_tokens=job.decode_tokens, ignore_eos=True)
        stats, kv_stats = engine.last_stats, dict(engine.last_kv_stats)
    finally:
        engine.close()
    kv = kv_bytes(kv_stats)
    prefetch = prefetch_figures(before, kv_stats, decode_steps=max(0, stats.num_generated_tokens - 1))
    return SpeedResult(
        engine=job.engine, prompt_tokens=len(ids), num_generated_tokens=stats.num_generated_tokens,
        prefill_tok_s=stats.prefill_tokens_per_s, ttft_s=stats.time_to_first_token_s,
        decode_tok_s=stats.decode_tokens_per_s, peak_rss_bytes=peak_rss_bytes(),
        device_kv_bytes=kv["device"], device_kv_bytes_used=kv["device_used"], host_kv_bytes=kv["host"],
        disk_kv_bytes=kv["disk"], num_threads=torch.get_num_threads(), device=str(engine.device),
        detail={k: float(v) for k, v in kv_stats.items()}, prefetch=asdict(prefetch) if prefetch else None,
    )


def measure_fidelity(job: FidelityJob) -> list[FidelityResult]:
    """The exact FP16 cache first (saved as the reference for the other families), then every engine listed."""
    from flashmemory.engine.engine import FlashMemoryEngine
    from flashmemory.tools.eval import BASELINE_KNOBS, score_config

    engine = FlashMemoryEngine(model_path=job.folder, dtype=job.dtype, num_threads=job.num_threads,
                               kv_cache="contiguous")
    ids = read_token_ids(job.ids_path, job.context_tokens)
    results: list[FidelityResult] = []
    try:
        reference, exact_lp, _ = score_config(engine, ids, job.teacher_forced_tokens, "reference", BASELINE_KNOBS)
        torch.save(exact_lp, job.reference_path)
        for name, knobs in job.engines:
            if name == REFERENCE_ENGINE:  # the reference itself: the same scoring, so it is not run twice
                results.append(FidelityResult(name, reference.decode_ppl, 0.0, 1.0, REFERENCE_ENGINE,
                                              prefill_ppl=reference.prefill_ppl,
                                              device_kv_bytes=reference.device_kv_bytes))
                continue
            try:
                r, _, _ = score_config(engine, ids, job.teacher_forced_tokens, name, knobs, exact_lp)
            except Exception as e:  # noqa: BLE001 - one configuration failing must not hide the others
                results.append(FidelityResult(name, 0.0, 0.0, 0.0, REFERENCE_ENGINE, error=f"{type(e).__name__}: {e}"))
                continue
            results.append(FidelityResult(name, r.decode_ppl, r.mean_kl, r.top1_agreement, REFERENCE_ENGINE,
                                          prefill_ppl=r.prefill_ppl, device_kv_bytes=r.device_kv_bytes))
    finally:
        engine.close()
    return results
