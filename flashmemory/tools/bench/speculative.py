"""`flashmemory bench-spec`: speculative decoding against the target alone, side by side.

Every engine (the target alone, the target with a draft model, the target with prompt lookup) is
loaded once; prompt by prompt, each run decodes the prompt with every engine in turn (interleaved,
so the machine's load falls on all alike; one prompt at a time, so acceptance is per task),
greedy. The table gives the median decode speed, the speed-up over the target alone in the same
runs, the acceptance, and the tokens that differ from the target's own output (0 is the rule).
Held-out prompts: two chat questions, a code completion and a summary of a window of a long text
(2K tokens by default).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

CHAT = [
    "Explain in a few sentences why the sky looks blue during the day and red at sunset.",
    "What are three practical differences between a process and a thread? Answer briefly.",
]
CODE = ('Complete this Python function.\n\n```python\ndef merge_intervals('
        'intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n    """Merge '
        'overlapping closed intervals; return them sorted."""\n')


@dataclass
class Cell:
    """One engine on one prompt over the runs."""

    decode_tok_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the first run's output
    differing: int = 0  # tokens that differ from the target alone (any run)


def prompts(engine, text_path: Path | None, summary_tokens: int) -> dict[str, list[int]]:
    """The benchmark's prompts as token ids through the target's chat template."""
    chat = {f"chat-{i + 1}": [{"role": "user", "content": q}] for i, q in enumerate(CHAT)}
    chat["code"] = [{"role": "user", "content": CODE}]
    if text_path is not None:
        ids = engine.tokenizer.encode(text_path.read_text(encoding="utf-8", errors="replace"))
        start = len(ids) // 3  # a window away from the front matter
        window = engine.tokenizer.decode(ids[start : start + summary_tokens])
        chat["summary"] = [{"role": "user", "content": "Summarise this passage in five "
                               f"sentences.\n\n{window}"}]
    return {name: engine.tokenizer.apply_chat_template(m) for name, m in chat.items()}


def run(engines: dict[str, object], prompt_ids: dict[str, list[int]], runs: int,
        new_tokens: int, log=print) -> dict[str, dict[str, Cell]]:
    """Interleaved: run r decodes every prompt with every engine in turn."""
    cells = {e: {p: Cell() for p in prompt_ids} for e in engines}
    for r in range(runs):
        for prompt, ids in prompt_ids.items():
            for name, engine in engines.items():
                started = time.perf_counter()
                out = engine.generate_token_ids(ids, max_new_tokens=new_tokens)
                cell = cells[name][prompt]
                cell.e2e_s.append(time.perf_counter() - started)
                cell.decode_tok_s.append(engine.last_stats.decode_tokens_per_s)
                if r == 0:
                    cell.tokens = out
                reference = cells["target"][prompt].tokens
                cell.differing += sum(a != b for a, b in zip(out, reference)) + abs(
                    len(out) - len(reference))
            log(f"run {r + 1}/{runs} {prompt}: " + ", ".join(
                f"{n} {cells[n][prompt].decode_tok_s[-1]:.2f} tok/s" for n in engines))
    return cells


def table(cells: dict[str, dict[str, Cell]], acceptance: dict[str, dict[str, float]]) -> str:
    """Per prompt and engine: median decode speed, its ratio to the target alone's in the same
    runs, end-to-end time, acceptance, differing tokens."""
    lines = ["| prompt | engine | decode tok/s (median) | speed-up | end-to-end s | acceptance "
             "| differing tokens |", "|---|---|---:|---:|---:|---:|---:|"]
    for prompt in cells["target"]:
        base = statistics.median(cells["target"][prompt].decode_tok_s)
        for name in cells:
            c = cells[name][prompt]
            rate = f"{acceptance[name][prompt]:.0%}" if prompt in acceptance[name] else "–"
            speed = statistics.median(c.decode_tok_s)
            lines.append(f"| {prompt} | {name} | {speed:.2f} | {speed / base:.2f}x | "
                         f"{statistics.median(c.e2e_s):.1f} | {rate} | {c.differing} |")
    return "\n".join(lines)


def main(args) -> int:
    from flashmemory.engine.engine import FlashMemoryEngine

    torch.set_num_threads(args.threads)
    common = dict(model_path=args.model, num_threads=args.threads, max_seq_len=args.max_seq_len)
    engines = {"target": FlashMemoryEngine(**common)}
    for i, draft in enumerate(args.draft_model):
        name = "draft" if i == 0 else Path(draft).name.removesuffix(".gguf")
        engines[f"{name} K={args.k}"] = FlashMemoryEngine(
            **common, draft_model_path=draft, num_speculative_tokens=args.k)
    if args.ngram:
        engines[f"ngram K={args.k}"] = FlashMemoryEngine(
            **common, speculative_method="ngram", num_speculative_tokens=args.k)
    prompt_ids = prompts(engines["target"], Path(args.text) if args.text else None,
                         args.summary_tokens)
    acceptance: dict[str, dict[str, float]] = {n: {} for n in engines}

    def log(message: str) -> None:
        print(message, flush=True)

    cells: dict[str, dict[str, Cell]] = {e: {} for e in engines}  # filled prompt by prompt
    for prompt, ids in prompt_ids.items():  # per prompt, so acceptance is per task
        before = {n: _counts(e) for n, e in engines.items()}
        part = run(engines, {prompt: ids}, args.runs, args.new_tokens, log)
        for n, e in engines.items():
            cells[n][prompt] = part[n][prompt]
            drafted, kept = (a - b for a, b in zip(_counts(e), before[n]))
            if drafted:
                acceptance[n][prompt] = kept / drafted
    report = table(cells, acceptance)
    print(report)
    profile = None
    if args.draft_model and args.profile:  # where a step's time goes, at the code prompt's length
        from flashmemory.tools.bench.spec_profile import profile_step

        profile = profile_step(engines[f"draft K={args.k}"], prompt_ids["code"], args.k)
        parts = ", ".join(f"{name} {ms:.1f}" for name, ms in profile.items())
        print(f"one step, ms (median of 5): {parts}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "draft_model": args.draft_model, "threads": args.threads,
            "runs": args.runs, "new_tokens": args.new_tokens, "k": args.k,
            "load": os.getloadavg(), "table": report, "profile_ms": profile,
            "cells": {n: {p: vars(c) for p, c in cs.items()} for n, cs in cells.items()},
            "acceptance": acceptance}, indent=1))
    for e in engines.values():
        e.close()
    return 0


def _counts(engine) -> tuple[int, int]:
    spec = engine.speculator
    if spec is None:
        return (0, 0)
    return (spec.stats.spec_decode_draft_tokens, spec.stats.spec_decode_accepted_tokens)
