"""`flashmemory eval`: fidelity of KV configurations against the exact cache on a long real text.

For each configuration, in one process with the weights loaded once:
  - prefill perplexity over the window (chunked prefill, as a long prompt is read);
  - decode-mode perplexity over the last N tokens, fed one at a time (teacher forcing), so selection and
    quantized levels act as in generation;
  - mean KL(exact || config) and top-1 agreement of the next-token distributions at those N positions;
  - device KV bytes at the end of the window, and decode tokens/s;
  - passkey retrieval: a number hidden at several depths of a haystack, asked for at the end.
With a KV snapshot file (--kv-snapshot), a long prompt is prefilled once by the exact cache and restored for every
configuration and run (engine/kv_snapshot.py; docs/eval.md says what is restored and what is measured fresh).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashmemory.errors import ConfigError

BASELINE = "exact-fp16"
BASELINE_KNOBS: dict[str, Any] = {"kv_cache": "contiguous", "kv_precision": "fp16"}
DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "mixed": {"kv_cache": "tiered"},  # the defaults: INT4 L0 window 2048, FP16 L1, INT4 L2, Quest
    "mixed-warm1024": {"kv_cache": "tiered", "warm_budget_tokens": 1024},  # reads fewer L1 blocks
    "mixed-cold": {"kv_cache": "tiered", "warm_tokens": 2048},  # pushes older KV to the disk level
    "mixed-all-blocks": {"kv_cache": "tiered", "selection": "exact"},  # quantization alone, no selection
}


@dataclass
class ConfigResult:
    """Measured figures of one configuration."""

    name: str
    knobs: dict[str, Any]
    prefill_ppl: float | None = 0.0  # None when the prompt's KV was restored from a snapshot (not computed here)
    decode_ppl: float = 0.0
    mean_kl: float = 0.0
    top1_agreement: float = 1.0
    device_kv_bytes: int = 0
    decode_tokens_per_s: float = 0.0
    passkey: dict[str, bool] = field(default_factory=dict)
    kv_stats: dict[str, float] = field(default_factory=dict)
    restored_tokens: int = 0  # prompt tokens whose exact KV came from the --kv-snapshot file
    peak_rss_bytes: int = 0  # the process's peak RSS while this configuration was scored (Linux; 0 elsewhere)


def default_text_path() -> Path | None:
    """../shared/data/alice29.txt next to the current folder or the repository, if present."""
    here = Path(__file__).resolve()
    for base in (Path.cwd(), *here.parents):
        candidate = base.parent / "shared" / "data" / "alice29.txt"
        if candidate.is_file():
            return candidate
    return None


def parse_config(spec: str) -> tuple[str, dict[str, Any]]:
    """NAME:key=value,key=value  (values parsed as int, float, true/false, or kept as text)."""
    if ":" not in spec:
        raise ConfigError(f"--config {spec!r}: write NAME:key=value[,key=value...]")
    name, _, body = spec.partition(":")
    knobs: dict[str, Any] = {}
    for item in filter(None, body.split(",")):
        key, eq, raw = item.partition("=")
        if not eq:
            raise ConfigError(f"--config {spec!r}: {item!r} is not key=value")
        value: Any = raw
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                pass
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        knobs[key.strip()] = value
    knobs.setdefault("kv_cache", "tiered")
    return name, knobs


def reset_peak_rss() -> None:
    """Start the process's peak-RSS count afresh (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """VmHWM of this process since the last reset_peak_rss (0 where /proc is not there)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else 0


def _device_kv_bytes(stats: dict[str, float]) -> int:
    return int(stats.get("L0_bytes", stats.get("kv_bytes_used", 0)))


def passkey_prompt(tokenizer, filler: str, total_tokens: int, depth: float, key: int) -> list[int]:
    """A haystack of `filler` text of about total_tokens tokens with the key sentence at `depth` (0..1)."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = " What is the pass key? The pass key is"
    ids = tokenizer.encode(filler, add_special_tokens=False)
    budget = total_tokens - len(tokenizer.encode(needle + question, add_special_tokens=False))
    body = ids[:budget]
    cut = int(len(body) * depth)
    text = tokenizer.decode(body[:cut]) + needle + tokenizer.decode(body[cut:]) + question
    return tokenizer.encode(text, add_special_tokens=False)


def perplexity(token_logprobs: torch.Tensor) -> float:
    """exp of the mean negative log-probability of the actual next tokens."""
    return math.exp(-token_logprobs.mean().item())


def compare_distributions(exact_lp: torch.Tensor, dist: torch.Tensor) -> tuple[float, float]:
    """(mean KL(exact || dist), top-1 agreement) of next-token log-softmax rows [positions, vocab]."""
    if exact_lp.shape != dist.shape:
        raise ConfigError(f"cannot compare distributions of shapes {tuple(exact_lp.shape)} and {tuple(dist.shape)}: "
                          "score the same tokens with the same number of teacher-forced steps")
    mean_kl = (exact_lp.exp() * (exact_lp - dist)).sum(-1).mean().item()
    top1 = (exact_lp.argmax(-1) == dist.argmax(-1)).float().mean().item()
    return mean_kl, top1


def score_config(engine, ids: list[int], decode_tokens: int, name: str, knobs: dict[str, Any],
                 exact_lp: torch.Tensor | None = None,
                 kv_snapshot: Path | None = None) -> tuple[ConfigResult, torch.Tensor, dict[str, Any]]:
    """Score `ids` with the KV configuration `knobs`; returns its figures, its decode log-softmax rows and the
    notes of the KV snapshot it restored (empty when none).

    Against `exact_lp` (the exact cache's rows for the same ids) when given; otherwise this is the baseline.
    With `kv_snapshot`, the prompt before its last prefill chunk is restored from that file (written by the
    first run that finds it missing): the decode steps are measured as always, the prefill PPL is not.
    """
    engine.reconfigure_kv(**knobs)
    reset_peak_rss()
    score = engine.score_tokens(ids, num_teacher_forced=decode_tokens, kv_snapshot=kv_snapshot)
    n_pre = score.num_prefill_tokens - score.num_restored_tokens
    lp = score.token_logprobs
    r = ConfigResult(name, knobs, restored_tokens=score.num_restored_tokens, peak_rss_bytes=peak_rss_bytes())
    r.prefill_ppl = perplexity(lp[:n_pre]) if not score.num_restored_tokens else None
    r.decode_ppl = perplexity(lp[n_pre:])
    dist = score.decode_logprobs
    if exact_lp is not None:
        r.mean_kl, r.top1_agreement = compare_distributions(exact_lp, dist)
    r.device_kv_bytes = _device_kv_bytes(score.kv_stats)
    r.decode_tokens_per_s = score.num_decode_steps / score.decode_seconds if score.decode_seconds else 0.0
    r.kv_stats = {k: float(v) for k, v in score.kv_stats.items()}
    return r, dist, score.snapshot_notes


def run_eval(engine, text: str, window_tokens: int, decode_tokens: int, configs: dict[str, dict[str, Any]],
             passkey_depths: list[float], passkey_tokens: int, passkey_window: int, log=print,
             kv_snapshot: Path | None = None) -> dict[str, Any]:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    window_tokens = min(window_tokens, engine.max_seq_len - 1, len(ids))
    if decode_tokens >= window_tokens:
        raise ConfigError(f"--decode-tokens {decode_tokens} must be smaller than the window ({window_tokens})")
    ids = ids[:window_tokens]
    rng = random.Random(0)
    keys = {depth: rng.randint(10000, 99999) for depth in passkey_depths}
    results: list[ConfigResult] = []
    exact_lp: torch.Tensor | None = None
    snapshot_notes: dict[str, Any] = {}
    for name, knobs in [(BASELINE, BASELINE_KNOBS), *configs.items()]:
        log(f"[{name}] {knobs}")
        t0 = time.perf_counter()
        r, dist, notes = score_config(engine, ids, decode_tokens, name, knobs, exact_lp, kv_snapshot)
        snapshot_notes = snapshot_notes or notes
        if exact_lp is None:
            exact_lp = dist
        if passkey_depths:
            # A short haystack with a small window, so the needle must come back from L1/L2 (tiered configs).
            small = dict(knobs)
            if small.get("kv_cache", "tiered") == "tiered":
                small.update(active_window=min(passkey_window, knobs.get("active_window", 2048)),
                             warm_tokens=min(passkey_window, knobs.get("warm_tokens", 16384)))
            engine.reconfigure_kv(**small)
            for depth in passkey_depths:
                prompt = passkey_prompt(engine.tokenizer, text, passkey_tokens, depth, keys[depth])
                answer = engine.generate(prompt, max_new_tokens=8)
                r.passkey[f"{depth:g}"] = str(keys[depth]) in answer
        log(f"[{name}] done in {time.perf_counter() - t0:.0f} s: decode PPL {r.decode_ppl:.3f}, "
            f"KL {r.mean_kl:.4f}, top-1 {r.top1_agreement:.3f}")
        results.append(r)
    baseline = results[0]
    return {
        "window_tokens": window_tokens,
        "decode_tokens": decode_tokens,
        "passkey_tokens": passkey_tokens,
        "passkey_window": passkey_window,
        "baseline": BASELINE,
        "kv_snapshot": None if kv_snapshot is None else {"path": str(kv_snapshot), "made_by": snapshot_notes},
        "results": [asdict(r) for r in results],
        "table": format_table(results, baseline),
    }


def format_table(results: list[ConfigResult], baseline: ConfigResult) -> str:
    head = ("| config | prefill PPL | decode PPL | Δ decode PPL | mean KL | top-1 | device KV MiB | "
            "device KV vs exact | decode tok/s | peak RSS MiB | passkey |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for r in results:
        delta = (r.decode_ppl / baseline.decode_ppl - 1) * 100
        share = r.device_kv_bytes / baseline.device_kv_bytes * 100 if baseline.device_kv_bytes else 0.0
        keys = " ".join(f"{d}:{'ok' if ok else 'MISS'}" for d, ok in r.passkey.items()) or "-"
        prefill = "restored" if r.prefill_ppl is None else f"{r.prefill_ppl:.3f}"
        rows.append(f"| {r.name} | {prefill} | {r.decode_ppl:.3f} | {delta:+.2f} % | {r.mean_kl:.4f} | "
                    f"{r.top1_agreement:.1%} | {r.device_kv_bytes / 2**20:.1f} | {share:.1f} % | "
                    f"{r.decode_tokens_per_s:.2f} | {r.peak_rss_bytes / 2**20:.0f} | {keys} |")
    return head + "\n" + "\n".join(rows)


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
