"""Decode-mode fidelity in the decode comparison (decode_compare.py): every worker keeps the log-softmax of its
logits at each teacher-forced step (float32, full vocabulary, .npy files in the run's work dir), and each engine
is scored on the steps' next ids (decode PPL) and against reference engines at the same steps: mean
KL(reference || engine) and top-1 agreement. numpy only (the comparison's parent process needs no torch for it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log-softmax of one step's [vocab] logits (computed in float64)."""
    x = np.asarray(logits, dtype=np.float64)
    return (x - np.logaddexp.reduce(x)).astype(np.float32)


def decode_ppl(logprobs: np.ndarray, next_ids: np.ndarray) -> float:
    """exp of the mean negative log-probability of each step's actual next token; logprobs [steps, vocab]."""
    picked = logprobs[np.arange(len(next_ids)), next_ids].astype(np.float64)
    return float(np.exp(-picked.mean()))


def compare(reference: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """(mean KL(reference || other), top-1 agreement) of log-softmax rows [steps, vocab]."""
    ref = reference.astype(np.float64)
    kl = (np.exp(ref) * (ref - other.astype(np.float64))).sum(axis=-1)
    return float(kl.mean()), float((reference.argmax(-1) == other.argmax(-1)).mean())


@dataclass
class Agreement:
    """One engine against one reference engine at the same steps; `na` says why it was not computed."""

    reference: str
    delta_ppl: float | None = None  # engine's decode PPL minus the reference's
    mean_kl: float | None = None  # mean over the steps of KL(reference || engine), nats
    top1: float | None = None  # fraction of steps whose argmax agrees
    na: str | None = None


@dataclass
class Fidelity:
    """One engine's decode PPL over the scored steps and its agreement with each reference engine in the run."""

    scored_steps: int
    decode_ppl: float
    against: list[Agreement] = field(default_factory=list)


def score_engines(logprobs: dict[str, np.ndarray], next_ids: list[int],
                  references: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Each engine's Fidelity as a dict. logprobs: engine name -> [steps, vocab] float32; next_ids: the id each step
    predicts; references: engine name -> the engines it is compared with (those absent from logprobs are left out).
    """
    targets = np.asarray(next_ids, dtype=np.int64)
    ppl = {}
    for name, rows in logprobs.items():
        if rows.shape[0] != len(targets):
            raise ValueError(f"{name}: {rows.shape[0]} log-softmax rows for {len(targets)} scored steps")
        ppl[name] = decode_ppl(rows, targets) if targets.max(initial=0) < rows.shape[1] else float("nan")
    out = {}
    for name, rows in logprobs.items():
        fidelity = Fidelity(len(targets), ppl[name])
        for ref in references.get(name, []):
            if ref not in logprobs or ref == name:
                continue
            if logprobs[ref].shape != rows.shape:
                fidelity.against.append(Agreement(ref, na=f"vocabularies differ ({logprobs[ref].shape[1]} vs "
                                                          f"{rows.shape[1]} logits)"))
                continue
            mean_kl, top1 = compare(logprobs[ref], rows)
            fidelity.against.append(Agreement(ref, ppl[name] - ppl[ref], mean_kl, top1))
        out[name] = asdict(fidelity)
    return out
