"""The longest context each engine serves under a fixed device-KV budget, from the bytes it was measured holding.

Peers' caches grow with the context: device bytes = fixed + per_token x tokens, fitted to the bytes counted at
each measured length (exact for these layouts), then solved for the budget. FlashMemory's tiered cache holds a
fixed L0 arena on the device whatever the length; older KV moves to host and disk, so it reaches the model's
limit when the arena fits the budget (the full run checks this by running at the limit under the budget).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashmemory.tools.bench.engines import FLASHMEMORY, LLAMA_CPP, EngineSpec
from flashmemory.tools.bench.summary import EngineRow

MIB = 2**20
KIB = 2**10


@dataclass
class CapacityRow:
    """One engine's longest context under the budget, and why it stops there."""

    engine: str
    bytes_per_token: float | None  # device KV growth per context token (0 for a fixed arena)
    fixed_bytes: float | None  # device KV held whatever the length
    longest_tokens: int | None  # None: not measured
    reaches_limit: bool
    why: str
    verified: str = ""  # how the figure was checked: a run at that length, or "computed"


@dataclass
class LimitCheck:
    """FlashMemory run at the model's limit under the fixed budget (or why that did not happen)."""

    engine: str
    prompt_tokens: int
    kv_budget_bytes: int
    device_kv_bytes: int | None
    decode_tok_s: float | None
    error: str | None = None


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed, per_token) least-squares line through (tokens, bytes); one point: a line through the origin."""
    if len({x for x, _ in points}) < 2:
        x, y = points[0]
        return 0.0, y / x
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def _layout(spec: EngineSpec, dtype: str) -> str:
    s = spec.settings
    if spec.family == LLAMA_CPP:
        return f"{s['kv_type']} K/V cells allocated for the whole n_ctx up front"
    if spec.family == FLASHMEMORY:
        kv_dtype = "FP16" if s.get("kv_precision") == "fp16" else dtype
        return f"{kv_dtype} K/V of every token in one device buffer"
    if s["cache"] == "quantized":
        return f"{s['nbits']}-bit K/V plus up to 128 recent tokens in {dtype}"
    if s["cache"] == "static":
        return f"{dtype} K/V preallocated for prompt + decode"
    return f"{dtype} K/V of every token"


def longest_contexts(specs: list[EngineSpec], rows: list[EngineRow], unavailable: dict[str, str], budget_bytes: int,
                     limit_tokens: int, dtype: str, limit_check: LimitCheck | None) -> list[CapacityRow]:
    out = []
    for spec in specs:
        if spec.name in unavailable:
            out.append(CapacityRow(spec.name, None, None, None, False, unavailable[spec.name]))
            continue
        measured = [r for r in rows if r.engine == spec.name and r.status == "ok"]
        failed = [r for r in rows if r.engine == spec.name and r.status != "ok"]
        if not measured:
            out.append(CapacityRow(spec.name, None, None, None, False, failed[0].reason if failed else "n/a: not run"))
            continue
        not_run = (f"; did not run at {', '.join(str(r.prompt_tokens) for r in failed)} tokens (see the speed table)"
                   if failed else "")
        if spec.family == FLASHMEMORY and spec.settings.get("kv_cache") == "tiered":
            out.append(_tiered_row(spec, measured, budget_bytes, limit_tokens, limit_check))
            continue
        # FlashMemory's contiguous buffer grows in doubling steps; its layout (bytes of the tokens held) is what a
        # right-sized exact cache needs. The peers' bytes are what they allocated.
        use_layout = spec.family == FLASHMEMORY
        # x = tokens held as the request ended: the prompt and every generated token but the last.
        points = [(float(r.prompt_tokens + r.num_generated_tokens - 1),
                   float(r.device_kv_bytes_used if use_layout else r.device_kv_bytes)) for r in measured]
        fixed, per_token = linear_fit(points)
        # (+1e-6: a fitted slope that is a float's rounding below the layout's must not lose a token)
        longest = limit_tokens if per_token <= 0 else int(max(0.0, budget_bytes - fixed) / per_token + 1e-6)
        longest = min(longest, limit_tokens)
        fits = longest >= limit_tokens
        why = (f"{_layout(spec, dtype)}: {per_token / KIB:.2f} KiB per token"
               + (f" + {fixed / MIB:.1f} MiB" if fixed > 0.05 * MIB else "")
               + ("; its bytes fit the model's limit" if fits else
                  f"; {budget_bytes / MIB:.1f} MiB holds {longest} tokens")
               + not_run)
        reaches = fits and not failed  # bytes that would fit do not count for an engine that failed to run
        out.append(CapacityRow(spec.name, per_token, fixed, longest, reaches, why,
                               f"computed from the bytes counted at {len(points)} length(s)"))
    return out


def _tiered_row(spec: EngineSpec, measured: list[EngineRow], budget_bytes: int, limit_tokens: int,
                limit_check: LimitCheck | None) -> CapacityRow:
    longest_run = max(measured, key=lambda r: r.prompt_tokens)
    if spec.budgeted:
        # Under the fixed budget its arena is sized to fit it by construction; the limit run shows it.
        arena = limit_check.device_kv_bytes if limit_check and limit_check.device_kv_bytes else budget_bytes
    else:
        arena = max(r.device_kv_bytes for r in measured)
    host_per_token = longest_run.host_kv_bytes / max(1, longest_run.prompt_tokens)
    if arena > budget_bytes:
        return CapacityRow(spec.name, 0.0, arena, 0, False,
                           f"its L0 arena (window {spec.settings.get('active_window', 2048)} tokens) needs "
                           f"{arena / MIB:.1f} MiB, more than the budget; fm-mixed-budget shrinks the window to fit",
                           "computed")
    why = (f"fixed L0 arena of {arena / MIB:.1f} MiB (newest window + sink block + filling block); older KV moves "
           f"to host ({host_per_token / KIB:.1f} KiB/token FP16) and disk, so the device does not grow with "
           "the context: reaches the model's limit")
    at_limit = longest_run.prompt_tokens + longest_run.num_generated_tokens >= limit_tokens - 1
    verified = (f"ran {longest_run.prompt_tokens} tokens with {longest_run.device_kv_bytes / MIB:.1f} MiB on the "
                "device" if at_limit and not spec.budgeted else "computed")
    if limit_check is not None and spec.name == limit_check.engine:
        verified = (f"ran {limit_check.prompt_tokens} tokens under {limit_check.kv_budget_bytes / MIB:.1f} MiB: "
                    f"{limit_check.device_kv_bytes / MIB:.1f} MiB on the device"
                    if limit_check.error is None and limit_check.device_kv_bytes is not None
                    else f"the run at the limit failed: {limit_check.error}")
        if limit_check.error is not None:
            return CapacityRow(spec.name, 0.0, arena, None, False, why, verified)
    return CapacityRow(spec.name, 0.0, arena, limit_tokens, True, why, verified)
