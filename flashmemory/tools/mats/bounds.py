"""How far a quantized level may stray from what was written: the codec's error bound, derived from each group's
own min and max (never from a tolerance picked to make a test pass).

The codec (kvcache/quant.py) stores a group of values x with lo = min x, hi = max x as
    scale = fp16((hi - lo) / levels),  zero = fp16(lo),  code = clamp(round((x - zero) / scale), 0, levels)
and decodes x' = code * scale + zero in float32. With u = 2**-11 (fp16's unit roundoff) and t = 2**-24 (its
smallest subnormal step), an unclamped code is off by at most half a step, scale / 2 <= s/2 (1 + u) + t/2 with
s = (hi - lo) / levels; a code clamped at `levels` (scale rounded down) is off by at most levels (u s + t) +
u |lo| + t; one clamped at 0 by at most u |lo| + t. Their sum, plus float32 rounding of the decode, bounds every
element.

With the "mse" range the group's range is [lo, hi] shrunk about its midpoint by one factor f of the codec's list:
an element inside it is off by half of the shrunk step, one outside it (clamped to its end) by at most
(1 - f) (hi - lo) / 2. The bound takes the larger over the list's factors (which one a group chose is the
encoder's business; the checker also compares the stored parts with the codec's own encoding).
"""

from __future__ import annotations

import torch

FP16_UNIT_ROUNDOFF = 2.0**-11
FP16_TINY = 2.0**-24  # fp16's smallest subnormal step: where relative rounding stops
FP32_SLACK = 4 * 2.0**-24  # float32 rounding of code * scale + zero, relative to the magnitudes involved


def group_error_bound(x: torch.Tensor, bits: int, axis: int, group: int,
                      shrink: tuple[float, ...] = (1.0,)) -> torch.Tensor:
    """Largest decode error the codec may make on each element of x [..., T, D] (float64, same shape), quantized in
    groups of `group` consecutive elements along `axis` (-2: tokens, as keys are; -1: channels, as values are),
    each group's range its min/max shrunk by one of the factors in `shrink` (quant.RANGE_SHRINK)."""
    levels = (1 << bits) - 1
    x = x.double()
    *lead, t, d = x.shape
    if axis == -2:
        grouped, reduce = x.view(*lead, t // group, group, d), -2  # [..., T/g, g, D]
    else:
        grouped, reduce = x.view(*lead, t, d // group, group), -1  # [..., T, D/g, g]
    lo = grouped.amin(dim=reduce, keepdim=True)
    hi = grouped.amax(dim=reduce, keepdim=True)
    u, tiny = FP16_UNIT_ROUNDOFF, FP16_TINY
    worst = torch.zeros_like(lo)
    for factor in shrink:
        step = (hi - lo) * factor / levels
        outside = (hi - lo) * (1 - factor) * 0.5  # a value beyond the shrunk range, clamped to its end
        start = (lo + hi) * 0.5 - step * levels * 0.5  # the range's low end, the zero point before rounding
        half_step = 0.5 * step * (1 + u) + 0.5 * tiny
        clamped = levels * (u * step + tiny) + u * start.abs() + tiny
        arithmetic = FP32_SLACK * (start.abs() + hi.abs() + lo.abs() + levels * step)
        worst = torch.maximum(worst, torch.maximum(half_step, outside) + clamped + arithmetic)
    return worst.expand_as(grouped).reshape(x.shape)


def kv_error_bound(k: torch.Tensor, v: torch.Tensor, bits: int, key_group_tokens: int, value_group_channels: int,
                   key_shrink: tuple[float, ...] = (1.0,), value_shrink: tuple[float, ...] = (1.0,)) -> torch.Tensor:
    """Bounds [2, ..., T, D] for keys (grouped per channel over tokens) and values (per token over channels)."""
    return torch.stack((group_error_bound(k, bits, -2, key_group_tokens, key_shrink),
                        group_error_bound(v, bits, -1, value_group_channels, value_shrink)))
