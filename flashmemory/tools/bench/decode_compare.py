"""`flashmemory bench --decode-only`: decode speed side by side, fairly. One persistent worker process per engine
(decode_worker.py) holds the same GGUF, prefills the same token ids, then runs teacher-forced decode steps in
interleaved rounds (every engine's round r covers the same positions), so machine noise falls on all alike.
Each engine runs with the threading it measures best at: llama.cpp with OpenMP's default wait policy, ours as
configured (recorded); peak RSS is read in each worker, which holds only its engine (no torch in llama.cpp's).

With a KV snapshot (`--kv-snapshot`, written by `flashmemory eval --kv-snapshot`), every engine restores the same
exact FP16 KV of the context but its last prefill chunk (ours through the cache's write path, llama.cpp through
its sequence state, transformers as a DynamicCache), prefills that chunk itself, then decodes; restored: the
prompt's KV; measured fresh: the last chunk's prefill, every decode step, and peak RSS from the end of the restore
on.

Fidelity rides along (decode_fidelity.py): each worker saves the log-softmax of every teacher-forced step after
timing it, and each engine gets its decode PPL over those steps and its KL / top-1 against the reference engines
in the run: fm-exact (our exact FP16 cache) for every engine, and llama.cpp with f16 KV for llama.cpp's other KV
types (same weights and kernels, only the KV type differs)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashmemory.errors import ConfigError
from flashmemory.tools.bench.decode_fidelity import score_engines
from flashmemory.tools.bench.decode_worker import REPLY_PREFIX
from flashmemory.tools.bench.engines import FLASHMEMORY, LLAMA_CPP, REFERENCE_ENGINE, TRANSFORMERS, select_engines
from flashmemory.tools.bench.llamacpp_open import EXTRA_BUFTS_ENV, load_choice, machine_record

MIB = 2**20
# Restored context: a multiple of this (the engine's default prefill_chunk_tokens, as `flashmemory eval` restores).
SNAPSHOT_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class DecodeEngine:
    """One engine of the comparison: its family and settings, and its OMP_WAIT_POLICY (None = OpenMP's default)."""

    name: str
    family: str  # "flashmemory" | "llama.cpp" | "transformers"
    settings: dict[str, Any] = field(default_factory=dict)
    omp_wait_policy: str | None = None
    threads: int | None = None  # None: the run's thread count


def default_engines(fm_wait_policy: str | None) -> tuple[DecodeEngine, ...]:
    """Ours as the GGUF is stored (decode_activations="auto": 8-bit activation dots by format where
    the CPU has AVX2), ours with float32 activations, and llama.cpp (f16 KV) when it is installed."""
    f32act = {"decode_activations": "float32"}
    engines = (DecodeEngine("fm", "flashmemory", {}, fm_wait_policy),
               DecodeEngine("fm-f32act", "flashmemory", f32act, fm_wait_policy))
    if importlib.util.find_spec("llama_cpp") is not None:
        engines += (DecodeEngine("llamacpp", "llama.cpp", {}, None),)
    return engines


def snapshot_engines(fm_wait_policy: str | None, threads: int) -> tuple[DecodeEngine, ...]:
    """From a long snapshot: our default tiered configuration and the exact cache, and llama.cpp (f16 KV) at the
    run's threads and at one thread."""
    engines = (DecodeEngine("fm-mixed", "flashmemory", {"kv_cache": "tiered", "kv_precision": "mixed",
                                                        "max_num_seqs": 1}, fm_wait_policy),
               DecodeEngine("fm-exact", "flashmemory", {"kv_cache": "contiguous", "kv_precision": "fp16",
                                                        "max_num_seqs": 1}, fm_wait_policy))
    if importlib.util.find_spec("llama_cpp") is not None:
        engines += (DecodeEngine(f"llamacpp-{threads}t", "llama.cpp", {}, None, threads),)
        if threads > 1:
            engines += (DecodeEngine("llamacpp-1t", "llama.cpp", {}, None, 1),)
    return engines


def named_engines(names: list[str], fm_wait_policy: str | None,
                  budget: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> tuple[DecodeEngine, ...]:
    """Engines of engines.py by name (`--engines`) as the decode comparison runs them: FlashMemory's KV
    configurations (fm-mixed-budget with `budget`: its settings to the settings under the device-KV budget),
    llama.cpp with f16 or q8_0 KV, transformers' DynamicCache; ConfigError for the others."""
    out = []
    for spec in select_engines(names):
        settings = dict(spec.settings)
        if spec.budgeted and spec.family == FLASHMEMORY:
            if budget is None:
                raise ConfigError(f"{spec.name} runs under a device-KV budget: pass --budget-mb MiB")
            settings = budget(settings)
        runnable = (spec.family == FLASHMEMORY and not spec.disk_fraction
                    or spec.family == LLAMA_CPP and settings["kv_type"] in ("f16", "q8_0")
                    or spec.family == TRANSFORMERS and settings == {"cache": "dynamic"})
        if not runnable:
            raise ConfigError(f"--decode-only does not run {spec.name}; it runs FlashMemory's KV configurations "
                              "without a disk fraction, llamacpp-f16(-fa), llamacpp-q8_0-fa and hf-dynamic")
        out.append(DecodeEngine(spec.name, spec.family, settings, fm_wait_policy if spec.family == FLASHMEMORY
                                else None))
    return tuple(out)


def fidelity_references(engines: tuple[DecodeEngine, ...]) -> dict[str, list[str]]:
    """Whom each engine is compared with: fm-exact when it runs, and for llama.cpp with a quantized KV cache the
    first llama.cpp engine with f16 KV (the same weights and kernels: only the KV type differs)."""
    names = {e.name for e in engines}
    f16 = next((e.name for e in engines if e.family == LLAMA_CPP and e.settings.get("kv_type", "f16") == "f16"), None)
    out: dict[str, list[str]] = {}
    for e in engines:
        refs = [REFERENCE_ENGINE] if REFERENCE_ENGINE in names and e.name != REFERENCE_ENGINE else []
        if e.family == LLAMA_CPP and e.settings.get("kv_type", "f16") != "f16" and f16 is not None:
            refs.append(f16)
        out[e.name] = refs
    return out


@dataclass
class DecodeRow:
    """One engine at one context length: medians over every measured step, and its decode-mode fidelity."""

    context_tokens: int
    engine: str
    ms_per_token: float
    decode_tok_s: float
    prefill_tok_s: float  # of the tokens prefilled (with a snapshot: the last chunk only)
    peak_rss_mib: float  # with a snapshot: from the end of the restore on
    vs_llamacpp: float | None  # the fastest llama.cpp f16 engine's ms/token over this one's (None: no llama.cpp)
    step_ms: list[float]
    omp_wait_policy: str
    threads: int = 0
    restored_tokens: int = 0  # context tokens whose KV came from the snapshot
    restore_s: float = 0.0
    restore_peak_rss_mib: float = 0.0  # peak RSS through loading and restoring (the restore's transient buffers)
    kv_bytes: dict[str, int] = field(default_factory=dict)  # device / host / disk, as the engine counts its KV
    fidelity: dict[str, Any] | None = None  # decode_fidelity.Fidelity over the teacher-forced steps


def _env(engine: DecodeEngine, threads: int) -> dict[str, str]:
    package_root = str(Path(__file__).resolve().parents[3])
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")})
    if engine.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = engine.omp_wait_policy
    return env


class _Worker:
    """A running decode_worker process and its command pipe."""

    def __init__(self, engine: DecodeEngine, spec_path: Path, threads: int) -> None:
        self.engine = engine
        self.proc = subprocess.Popen([sys.executable, "-m", "flashmemory.tools.bench.decode_worker", str(spec_path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=_env(engine, threads))

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY_PREFIX):
                return json.loads(line[len(REPLY_PREFIX):])
        status = self.proc.wait()
        hint = ""
        crashed = status == -signal.SIGSEGV and self.engine.family == LLAMA_CPP
        if crashed and load_choice().extra_buffer_types:
            hint = (f"; llama.cpp crashed with its extra buffer types on: run again with "
                    f"{EXTRA_BUFTS_ENV}=off (its AMX weight repack is known to segfault)")
        raise RuntimeError(f"{self.engine.name}: the worker exited (status {status}) "
                           f"without replying{hint}")

    def send(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()


def run_decode_compare(gguf_path: Path, ids_path: Path, lengths: list[int], rounds: int, steps: int, threads: int,
                       engines: tuple[DecodeEngine, ...], work_dir: Path,
                       log: Callable[[str], None] = lambda m: None, kv_snapshot: Path | None = None,
                       restore_chunk_tokens: int = 0) -> dict[str, Any]:
    """kv_snapshot: restore each length's context but its last restore_chunk_tokens-aligned chunk from it."""
    rows: list[DecodeRow] = []
    load_before = os.getloadavg()
    ids = json.loads(ids_path.read_text())
    references = fidelity_references(engines)
    for length in lengths:
        workers: list[_Worker] = []
        start: dict[str, dict[str, Any]] = {}
        restore_tokens = (length - 1) // restore_chunk_tokens * restore_chunk_tokens if kv_snapshot else 0
        for engine in engines:  # one at a time: loading and prefilling do not overlap
            spec = {"family": engine.family, "gguf_path": str(gguf_path), "ids_path": str(ids_path),
                    "context_tokens": length, "max_steps": rounds * steps, "threads": engine.threads or threads,
                    "settings": engine.settings, "restore_tokens": restore_tokens,
                    "kv_snapshot": str(kv_snapshot) if kv_snapshot else None}
            spec_path = work_dir / f"decode-{engine.name}-{length}.json"
            spec_path.write_text(json.dumps(spec))
            worker = _Worker(engine, spec_path, engine.threads or threads)
            start[engine.name] = worker.read()
            log(f"{length} tokens: {engine.name} restored {restore_tokens} in {start[engine.name]['restore_s']:.1f} "
                f"s, prefilled {length - restore_tokens} in {start[engine.name]['prefill_s']:.1f} s")
            workers.append(worker)
        times: dict[str, list[float]] = {e.name: [] for e in engines}
        logprob_files: dict[str, list[Path]] = {e.name: [] for e in engines}
        for r in range(rounds):
            order = workers[r % len(workers):] + workers[: r % len(workers)]  # who goes first rotates
            for worker in order:
                path = work_dir / f"logprobs-{worker.engine.name}-{length}-r{r}.npy"
                reply = worker.send({"cmd": "steps", "num": steps, "logprobs_path": str(path)})
                times[worker.engine.name] += reply["ms"]
                logprob_files[worker.engine.name].append(path)
            log(f"{length} tokens, round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {statistics.median(t):.1f} ms" for n, t in times.items()))
        last = {w.engine.name: w.send({"cmd": "quit"}) for w in workers}
        for w in workers:
            w.proc.wait(timeout=60)
        logprobs = {name: np.concatenate([np.load(p) for p in paths]) for name, paths in logprob_files.items()}
        fidelity = score_engines(logprobs, ids[length + 1:length + 1 + rounds * steps], references)
        reference = _llamacpp_reference_ms(engines, times)
        for engine in engines:
            ms, first = statistics.median(times[engine.name]), start[engine.name]
            rows.append(DecodeRow(
                length, engine.name, ms, 1e3 / ms, (length - restore_tokens) / first["prefill_s"],
                last[engine.name]["peak_rss_bytes"] / MIB, None if reference is None else reference / ms,
                times[engine.name], engine.omp_wait_policy or "default", engine.threads or threads, restore_tokens,
                first["restore_s"], first["restore_peak_rss_bytes"] / MIB, last[engine.name]["kv_bytes"],
                fidelity[engine.name]))
    return {"rows": [asdict(r) for r in rows], "threads": threads, "rounds": rounds, "steps_per_round": steps,
            "load_average_before": load_before, "load_average_after": os.getloadavg(), "gguf": str(gguf_path),
            "kv_snapshot": None if kv_snapshot is None else str(kv_snapshot), **machine_record(),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def _llamacpp_reference_ms(engines: tuple[DecodeEngine, ...], times: dict[str, list[float]]) -> float | None:
    """The fastest llama.cpp f16 engine's median ms/token (any llama.cpp engine's when none has f16 KV): at its
    best threading, since on a loaded machine its spinning barriers can make 2 threads the slower."""
    llama = [e for e in engines if e.family == LLAMA_CPP]
    f16 = [e for e in llama if e.settings.get("kv_type", "f16") == "f16"] or llama
    return min((statistics.median(times[e.name]) for e in f16), default=None)


def check_snapshot(path: Path, checkpoint: Any, ids: list[int]) -> int:
    """The snapshot's token count, once it is checked whole against the model (its identity and KV geometry, not
    the dtype that computed it) and the text's token ids; KVSnapshotError naming the difference otherwise."""
    import torch

    from flashmemory.engine.kv_snapshot import model_fingerprint, model_identity
    from flashmemory.kvcache.snapshot import SnapshotReader

    fingerprint = model_identity(model_fingerprint(checkpoint.path, checkpoint.config, torch.float32, "auto"))
    with SnapshotReader(path, fingerprint, ids) as reader:
        return reader.num_tokens


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / MIB:,.1f}"


def _kv_cell(kv: dict[str, int]) -> str:
    """Device KV MiB, with host and disk KV after it where the engine keeps any there."""
    if not kv:
        return "—"
    rest = [f"{_mib(kv[k])} {k}" for k in ("host", "disk") if kv.get(k)]
    return _mib(kv.get("device", 0)) + "".join(f" + {r}" for r in rest)


def _agreement_cells(fidelity: dict[str, Any] | None, reference: str) -> list[str]:
    """ΔPPL, KL and top-1 against `reference` (— when not compared with it, n/a with the reason)."""
    found = next((a for a in (fidelity or {}).get("against", []) if a["reference"] == reference), None)
    if found is None:
        return ["—"] * 3
    if found["na"]:
        return [f"n/a: {found['na']}"] + ["n/a"] * 2
    steps = fidelity["scored_steps"]
    return [f"{found['delta_ppl']:+.3f}", f"{found['mean_kl']:.3g}", f"{round(found['top1'] * steps)}/{steps}"]


def to_markdown(report: dict[str, Any]) -> str:
    restored = bool(report.get("kv_snapshot"))
    rows = report["rows"]
    names = {r["engine"] for r in rows}
    ref = REFERENCE_ENGINE if REFERENCE_ENGINE in names else None
    second = sorted({a["reference"] for r in rows for a in (r.get("fidelity") or {}).get("against", [])
                     if a["reference"] != ref})
    extra = " restored tokens | restore s | load + restore peak RSS MiB |" if restored else ""
    fid = "" if ref is None else f" ΔPPL vs {ref} | KL vs {ref} | top-1 vs {ref} |"
    fid += "".join(f" vs {name}: ΔPPL / KL / top-1 |" for name in second)
    header = (f"| context | engine | threads | decode ms/token | decode tok/s | vs llama.cpp | prefill tok/s | "
              f"peak RSS MiB | KV MiB (as counted) | decode PPL |{fid}{extra} OMP_WAIT_POLICY |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        ratio = "—" if r["vs_llamacpp"] is None else f"{r['vs_llamacpp']:.2f}x"
        fidelity = r.get("fidelity")
        ppl = "—" if not fidelity else f"{fidelity['decode_ppl']:.3f}"
        cells = "" if ref is None else "".join(f" {c} |" for c in _agreement_cells(fidelity, ref))
        for name in second:
            agreement = _agreement_cells(fidelity, name)
            cells += " — |" if agreement == ["—"] * 3 else f" {' / '.join(agreement)} |"
        if restored:
            cells += f" {r['restored_tokens']} | {r['restore_s']:.1f} | {r['restore_peak_rss_mib']:.0f} |"
        lines.append(f"| {r['context_tokens']} | {r['engine']} | {r.get('threads') or report['threads']} | "
                     f"{r['ms_per_token']:.1f} | {r['decode_tok_s']:.2f} | {ratio} | {r['prefill_tok_s']:.1f} | "
                     f"{r['peak_rss_mib']:.0f} | {_kv_cell(r.get('kv_bytes') or {})} | {ppl} |{cells} "
                     f"{r['omp_wait_policy']} |")
    before = ", ".join(f"{x:.1f}" for x in report["load_average_before"])
    after = ", ".join(f"{x:.1f}" for x in report["load_average_after"])
    steps = report["rounds"] * report["steps_per_round"]
    lines.append("")
    lines.append(f"{report['threads']} threads per engine unless the row says; {report['rounds']} interleaved rounds "
                 f"of {report['steps_per_round']} teacher-forced steps (medians of every step; vs llama.cpp: the "
                 f"fastest llama.cpp f16 row's ms/token over this row's); load average "
                 f"{before} before, {after} after; {Path(report['gguf']).name}.")
    if "cpu" in report:  # reports written before the CPU was recorded have neither
        load = report["llamacpp_load"]
        lines.append(f"CPU: {report['cpu']['model']} ({', '.join(report['cpu']['flags'])}); "
                     f"llama.cpp's extra buffer types "
                     f"{'on' if load['extra_buffer_types'] else 'off'}: {load['why']}.")
    lines.append(f"Fidelity over the {steps} teacher-forced steps (each step's next id scored; decode PPL over "
                 f"{steps} tokens is noisy): KL(reference || engine) in nats, mean over the steps; top-1: steps "
                 "whose argmax agrees with the reference's. llama.cpp's own matmuls differ from ours (its Q4_K path "
                 "quantizes activations to 8 bits), so its KL against fm-exact mixes the weights' path and the KV; "
                 "against llama.cpp f16 only the KV type differs.")
    if restored:
        lines.append(f"KV of the first 'restored tokens' from {Path(report['kv_snapshot']).name} (exact FP16); "
                     "measured fresh: the rest of the context's prefill (prefill tok/s), every decode step, and "
                     "peak RSS from the end of the restore on.")
    return "\n".join(lines)
