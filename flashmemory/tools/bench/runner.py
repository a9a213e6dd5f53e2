"""`flashmemory bench`: every engine on the same model, text and lengths, interleaved, then fidelity and capacity.

Speed runs go A B C ... A B C ... per length (each its own process), so drift of a shared machine hits every
engine alike and medians absorb the rest. Fidelity is scored once per engine at the longest length: FlashMemory's
engines and transformers' caches against the exact FP16 cache (same weights), llama.cpp against its own f16 KV.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashmemory.tools.bench.capacity import CapacityRow, LimitCheck, longest_contexts
from flashmemory.tools.bench.config import BenchConfig
from flashmemory.tools.bench.device_budget import knobs_for_kv_budget
from flashmemory.tools.bench.disk_tier import knobs_for_disk_fraction
from flashmemory.tools.bench.engines import (
    FLASHMEMORY,
    LLAMA_CPP,
    TRANSFORMERS,
    EngineSpec,
    select_engines,
    unavailable_reason,
)
from flashmemory.tools.bench.inputs import BenchInputs, load_inputs
from flashmemory.tools.bench.jobs import FidelityJob, SpeedJob
from flashmemory.tools.bench.launcher import WorkerLauncher
from flashmemory.tools.bench.llamacpp_open import machine_record
from flashmemory.tools.bench.summary import EngineRow, RunRecord, summarize
from flashmemory.errors import ConfigError

MIB = 2**20
BUDGET_REFERENCE_TOKENS = 2048  # default fixed budget: the bytes of an FP16 cache of this many tokens
BUDGET_FRACTION_OF_FP16 = 4  # fm-mixed-budget gets at most 1/4 of the FP16 cache of the length
SPEED_TIMEOUT_S = 3600.0
FIDELITY_TIMEOUT_S_PER_ENGINE = 3600.0

Log = Callable[[str], None]


@dataclass
class BenchReport:
    """Everything one benchmark measured, in the order the report prints it."""

    settings: dict[str, Any]
    engines: list[EngineSpec]
    unavailable: dict[str, str]  # engine -> "n/a: why" for engines that could not run here
    rows: list[EngineRow]
    runs: list[RunRecord]
    fidelity: list[dict[str, Any]] = field(default_factory=list)
    capacity: list[CapacityRow] = field(default_factory=list)
    limit_check: LimitCheck | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "engines": [{"name": e.name, "family": e.family, "description": e.description, "settings": e.settings}
                        for e in self.engines],
            "unavailable": self.unavailable,
            "rows": [asdict(r) for r in self.rows],
            "fidelity": self.fidelity,
            "capacity": [asdict(c) for c in self.capacity],
            "limit_check": asdict(self.limit_check) if self.limit_check else None,
            "runs": [asdict(r) for r in self.runs],
        }


def plan_lengths(cfg: BenchConfig, inputs: BenchInputs) -> list[tuple[int, int]]:
    """(requested, prompt) token pairs: prompts capped below the model's limit, duplicates after capping dropped."""
    out: list[tuple[int, int]] = []
    for requested in sorted(cfg.lengths_tokens):
        prompt = inputs.prompt_tokens(requested, cfg.decode_tokens)
        if len(inputs.token_ids) < prompt:
            raise ConfigError(f"{inputs.text_path} has {len(inputs.token_ids)} tokens; a {requested}-token context "
                              "needs more: pass a longer --text or shorter --lengths")
        if all(p != prompt for _, p in out):
            out.append((requested, prompt))
    return out


class Bench:
    """Owns one benchmark's inputs, engines and worker launcher; run() measures everything."""

    def __init__(self, cfg: BenchConfig, log: Log = lambda message: None) -> None:
        self.cfg = cfg
        self.log = log
        self.specs = select_engines(cfg.engines)  # a typo fails before the model is opened
        self.inputs = load_inputs(cfg.model_path, cfg.text_path)
        cuda = torch.cuda.is_available()
        has_gguf = self.inputs.gguf_path is not None
        self.unavailable = {s.name: r for s in self.specs if (r := unavailable_reason(s, has_gguf, cuda)) is not None}
        self.runnable = [s for s in self.specs if s.name not in self.unavailable]
        self.budget_bytes = (int(cfg.budget_mb * MIB) if cfg.budget_mb is not None
                             else self.inputs.fp16_kv_bytes(BUDGET_REFERENCE_TOKENS))
        self.lengths = plan_lengths(cfg, self.inputs)
        if cfg.fidelity_tokens >= self.lengths[-1][1]:  # checked before hours of speed runs, not after
            raise ConfigError(f"--fidelity-tokens {cfg.fidelity_tokens} must be smaller than the longest prompt "
                              f"({self.lengths[-1][1]} tokens)")
        self.limit_prompt_tokens = self.inputs.prompt_tokens(self.inputs.max_context_tokens, cfg.decode_tokens)

    # ---- engine settings ---------------------------------------------------------------------------------------

    def kv_budget_for(self, requested_tokens: int) -> int:
        """fm-mixed-budget's device KV budget for a requested context length: a quarter of the FP16 cache of that
        length, at most the fixed budget (so at 8K with the default budget it is exactly the fixed one)."""
        return min(self.budget_bytes, self.inputs.fp16_kv_bytes(requested_tokens) // BUDGET_FRACTION_OF_FP16)

    def settings_for(self, spec: EngineSpec, requested_tokens: int, kv_budget_bytes: int | None = None) -> dict:
        if spec.disk_fraction:
            return knobs_for_disk_fraction(requested_tokens, spec.disk_fraction, spec.settings)
        if not spec.budgeted:
            return dict(spec.settings)
        budget = kv_budget_bytes if kv_budget_bytes is not None else self.kv_budget_for(requested_tokens)
        return knobs_for_kv_budget(self.inputs.model_config, self.cfg.dtype, budget, spec.settings).knobs

    def _speed_job(self, spec: EngineSpec, prompt_tokens: int, ids_path: Path, settings: dict) -> SpeedJob:
        return SpeedJob(spec.name, spec.family, settings, str(self.inputs.folder),
                        str(self.inputs.gguf_path) if self.inputs.gguf_path else None, str(ids_path), prompt_tokens,
                        self.cfg.decode_tokens, self.cfg.dtype, self.cfg.num_threads)

    # ---- phases ------------------------------------------------------------------------------------------------

    def run(self) -> BenchReport:
        started = time.perf_counter()
        for name, reason in self.unavailable.items():
            self.log(f"{name}: {reason}")
        with tempfile.TemporaryDirectory(prefix="flashmemory-bench-") as tmp:
            run_dir = Path(tmp)
            ids_path = self.inputs.write_token_ids(run_dir / "ids.json")
            launcher = WorkerLauncher(run_dir, self.cfg.num_threads, SPEED_TIMEOUT_S)
            runs = self._speed_runs(launcher, ids_path)
            rows = summarize(runs, self.runnable, self.lengths)
            limit_check = self._limit_check(launcher, ids_path, rows) if self.cfg.verify_limit else None
            fidelity = self._fidelity(launcher, ids_path, run_dir) if self.cfg.fidelity_tokens else []
        capacity = longest_contexts(self.specs, rows, self.unavailable, self.budget_bytes,
                                    self.inputs.max_context_tokens, self.cfg.dtype, limit_check)
        settings = self._settings(time.perf_counter() - started)
        return BenchReport(settings, self.specs, self.unavailable, rows, runs, fidelity, capacity, limit_check)

    def _speed_runs(self, launcher: WorkerLauncher, ids_path: Path) -> list[RunRecord]:
        runs: list[RunRecord] = []
        for requested, prompt in self.lengths:
            failed: set[str] = set()
            settings: dict[str, dict] = {}
            for spec in self.runnable:
                try:
                    settings[spec.name] = self.settings_for(spec, requested)
                except ConfigError as e:  # e.g. a budget too small for this model: that engine's row says so
                    runs.append(RunRecord(spec.name, requested, prompt, 0, None, str(e), 0.0))
                    failed.add(spec.name)
                    self.log(f"  {spec.name:20s} {prompt:5d} tok: n/a: {e}")
            for run_index in range(self.cfg.num_runs):
                for spec in self.runnable:  # interleaved: A B C ... A B C ...
                    if spec.name in failed:
                        continue
                    t0 = time.perf_counter()
                    result, error = launcher.run(self._speed_job(spec, prompt, ids_path, settings[spec.name]))
                    wall = time.perf_counter() - t0
                    runs.append(RunRecord(spec.name, requested, prompt, run_index, result, error, wall))
                    if error is not None:
                        failed.add(spec.name)  # the same engine at the same length would fail the same way
                        self.log(f"  run {run_index + 1}/{self.cfg.num_runs} {spec.name:20s} {prompt:5d} tok: "
                                 f"n/a: {error}")
                        continue
                    pf = result.get("prefetch")
                    prefetch = f", prefetch hit rate {pf['hit_rate']:.0%} of {pf['hits'] + pf['misses']}" if pf else ""
                    self.log(f"  run {run_index + 1}/{self.cfg.num_runs} {spec.name:20s} {prompt:5d} tok: prefill "
                             f"{result['prefill_tok_s']:.0f} tok/s, decode {result['decode_tok_s']:.2f} tok/s, "
                             f"device KV {result['device_kv_bytes'] / MIB:.1f} MiB, peak RSS "
                             f"{result['peak_rss_bytes'] / MIB:.0f} MiB{prefetch} ({wall:.0f} s)")
        return runs

    def _limit_check(self, launcher: WorkerLauncher, ids_path: Path, rows: list[EngineRow]) -> LimitCheck | None:
        """fm-mixed-budget at the model's limit under the fixed budget: reuse the speed runs when they were exactly
        that, else one more run."""
        spec = next((s for s in self.runnable if s.budgeted), None)
        if spec is None:
            return None
        prompt = self.limit_prompt_tokens
        at_limit = [r for r in rows if r.engine == spec.name and r.prompt_tokens == prompt]
        if at_limit and self.kv_budget_for(at_limit[0].requested_tokens) == self.budget_bytes:
            row = at_limit[0]
            ok = row.status == "ok"
            return LimitCheck(spec.name, prompt, self.budget_bytes, int(row.device_kv_bytes) if ok else None,
                              row.decode_tok_s if ok else None, None if ok else row.reason)
        if len(self.inputs.token_ids) < prompt:
            return LimitCheck(spec.name, prompt, self.budget_bytes, None, None,
                              f"the text has only {len(self.inputs.token_ids)} tokens")
        self.log(f"  limit check: {spec.name} at {prompt} tokens under {self.budget_bytes / MIB:.1f} MiB of device KV")
        try:
            settings = self.settings_for(spec, prompt, kv_budget_bytes=self.budget_bytes)
        except ConfigError as e:
            return LimitCheck(spec.name, prompt, self.budget_bytes, None, None, str(e))
        result, error = launcher.run(self._speed_job(spec, prompt, ids_path, settings))
        if error is not None:
            return LimitCheck(spec.name, prompt, self.budget_bytes, None, None, error)
        return LimitCheck(spec.name, prompt, self.budget_bytes, result["device_kv_bytes"], result["decode_tok_s"])

    def _fidelity(self, launcher: WorkerLauncher, ids_path: Path, run_dir: Path) -> list[dict[str, Any]]:
        """One job per family at the longest length; FlashMemory's first, since it writes the reference rows."""
        requested, context = self.lengths[-1]
        forced = self.cfg.fidelity_tokens
        reference_path = run_dir / "reference.pt"
        out: list[dict[str, Any]] = []
        reference_error: str | None = None
        for family in (FLASHMEMORY, TRANSFORMERS, LLAMA_CPP):
            specs = [s for s in self.runnable if s.family == family]
            needs_reference = family == FLASHMEMORY and any(s.family == TRANSFORMERS for s in self.runnable)
            if not specs and not needs_reference:
                continue
            if family == TRANSFORMERS and reference_error is not None:
                out += [self._fidelity_failure(s.name, f"no reference: {reference_error}", context) for s in specs]
                continue
            engines = []
            for spec in specs:
                try:
                    engines.append((spec.name, self.settings_for(spec, requested)))
                except ConfigError as e:
                    out.append(self._fidelity_failure(spec.name, str(e), context))
                    specs = [s for s in specs if s is not spec]
            job = FidelityJob(family, engines, str(self.inputs.folder),
                              str(self.inputs.gguf_path) if self.inputs.gguf_path else None, str(ids_path), context,
                              forced, self.cfg.dtype, self.cfg.num_threads, str(reference_path))
            self.log(f"  fidelity: {family} ({', '.join(n for n, _ in engines) or 'reference only'}) at {context} "
                     f"tokens, last {forced} teacher-forced")
            t0 = time.perf_counter()
            results, error = launcher.run(job, timeout_s=FIDELITY_TIMEOUT_S_PER_ENGINE * max(1, len(engines)))
            if error is not None:
                if family == FLASHMEMORY:
                    reference_error = error
                out += [self._fidelity_failure(s.name, error, context) for s in specs]
                continue
            for r in results:
                r.update(context_tokens=context, teacher_forced_tokens=forced)
                self.log(f"    {r['engine']:20s} " + (f"n/a: {r['error']}" if r["error"] else
                         f"decode PPL {r['decode_ppl']:.3f}, KL {r['mean_kl']:.4f}, top-1 {r['top1_agreement']:.3f}"))
            self.log(f"    ({time.perf_counter() - t0:.0f} s)")
            out += results
        order = {s.name: i for i, s in enumerate(self.specs)}
        return sorted(out, key=lambda r: order.get(r["engine"], len(order)))

    def _fidelity_failure(self, engine: str, error: str, context: int) -> dict[str, Any]:
        return {"engine": engine, "decode_ppl": 0.0, "mean_kl": 0.0, "top1_agreement": 0.0, "reference": "",
                "prefill_ppl": None, "device_kv_bytes": None, "error": error, "context_tokens": context,
                "teacher_forced_tokens": self.cfg.fidelity_tokens}

    def _settings(self, wall_s: float) -> dict[str, Any]:
        import transformers

        cfg, inputs = self.cfg, self.inputs
        return {
            "command_settings": {
                "lengths_tokens": list(cfg.lengths_tokens), "runs": cfg.num_runs, "decode_tokens": cfg.decode_tokens,
                "fidelity_tokens": cfg.fidelity_tokens, "threads": cfg.num_threads, "dtype": cfg.dtype,
                "quick": cfg.quick, "engines": [s.name for s in self.specs],
            },
            "prompts_tokens": [p for _, p in self.lengths],
            "model": str(inputs.gguf_path or inputs.folder),
            "weights_folder": str(inputs.folder),
            "model_limit_tokens": inputs.max_context_tokens,
            "fp16_kv_bytes_per_token": inputs.model_config.kv_bytes_per_token(2),
            "budget_bytes": self.budget_bytes,
            "text": str(inputs.text_path),
            "text_tokens": len(inputs.token_ids),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "PASSIVE") + " (llama.cpp: OpenMP default)",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "machine": f"{platform.machine()} {platform.processor()}".strip(),
            "cpu_count": os.cpu_count(), **machine_record(),
            "cuda": torch.cuda.is_available(),
            "wall_s": round(wall_s, 1),
        }


def run_bench(cfg: BenchConfig, log: Log = lambda message: None) -> BenchReport:
    return Bench(cfg, log).run()
