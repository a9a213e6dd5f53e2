"""KV codecs: asymmetric group quantization (KIVI layout) at INT4 / INT2, and fp16 pass-through.

Keys are grouped per channel (`key_group_tokens` consecutive tokens of one channel), values per token
(`value_group_channels` consecutive channels of one token). Scales and zero points are fp16. Codes are packed
along head_dim: two INT4 or four INT2 codes per byte (planar: see `pack`).

A group's range is its min/max shrunk toward its midpoint by the factor (of `RANGE_SHRINK[bits]`) that gives the
least squared error ("mse", the default): with four INT2 levels, min/max spends most codes on the few outliers
and the bulk of a group rounds coarsely. The stored format is the same as plain min/max ("minmax");
"mse-values" shrinks the values' ranges only (measured worse on retrieval: docs/needles.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType

import torch

# Every codec turns keys and values [..., tokens, head_dim] into named parts and back.
Parts = dict[str, torch.Tensor]
RecordLayout = Mapping[str, tuple[int, int, tuple[int, ...], torch.dtype]]  # part -> (offset, size, shape, dtype)

QUANT_RANGES = ("mse", "mse-values", "minmax")  # mse-values: values "mse", keys min/max
# Shrink factors of a group's min/max range tried by the "mse" range (1.0 = min/max itself).
RANGE_SHRINK = {2: (1.0, 0.9, 0.8, 0.7, 0.6, 0.5), 4: (1.0, 0.92, 0.84, 0.76)}


@dataclass(frozen=True)
class Codec:
    """How one level stores a block's keys and values."""

    bits: int  # 16 (fp16 pass-through), 4 or 2
    key_group_tokens: int = 16  # tokens sharing one per-channel scale/zero of the keys
    value_group_channels: int = 32  # channels sharing one per-token scale/zero of the values
    quant_range: str = "mse"  # "mse" (least-squares shrink of min/max), "mse-values" (values only) or "minmax"

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 16):
            raise ValueError(f"unsupported bit width {self.bits}")
        if self.quant_range not in QUANT_RANGES:
            raise ValueError(f"unknown quant_range {self.quant_range!r}; choose one of {QUANT_RANGES}")

    @property
    def name(self) -> str:
        return "fp16" if self.bits == 16 else f"int{self.bits}"

    @property
    def key_shrink(self) -> tuple[float, ...]:
        """The factors of a key group's min/max range its encoding tries (1.0 alone: min/max)."""
        return RANGE_SHRINK[self.bits] if self.quant_range == "mse" and self.bits < 16 else (1.0,)

    @property
    def value_shrink(self) -> tuple[float, ...]:
        """The factors of a value group's min/max range its encoding tries (1.0 alone: min/max)."""
        return RANGE_SHRINK[self.bits] if self.quant_range != "minmax" and self.bits < 16 else (1.0,)

    def part_shapes(self, lead: tuple[int, ...], tokens: int, head_dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the parts of one block whose keys/values are [*lead, tokens, head_dim].

        Keys and values share one tensor ("kv" or "codes", K first along the axis of size 2), so gathering
        and unpacking a level's blocks takes one operation for both.
        """
        if self.bits == 16:
            return {"kv": ((*lead, 2, tokens, head_dim), torch.float16)}
        packed = head_dim * self.bits // 8
        kg, vg = tokens // self.key_group_tokens, head_dim // self.value_group_channels
        return {
            "codes": ((*lead, 2, tokens, packed), torch.uint8),
            "k_scale": ((*lead, kg, head_dim), torch.float16),
            "k_zero": ((*lead, kg, head_dim), torch.float16),
            "v_scale": ((*lead, tokens, vg), torch.float16),
            "v_zero": ((*lead, tokens, vg), torch.float16),
        }

    def record_layout(self, tokens: int, head_dim: int) -> RecordLayout:
        """One KV head's block as a record: each part's (byte offset, byte size, shape, dtype), back to back in
        part order (the memory pools' records, and the layout the native decode kernel folds); its size is
        nbytes((), tokens, head_dim). Computed once per codec and geometry (the disk level's decode reads ask
        for it at every layer)."""
        return _record_layout(self, tokens, head_dim)

    def nbytes(self, lead: tuple[int, ...], tokens: int, head_dim: int) -> int:
        total = 0
        for shape, dtype in self.part_shapes(lead, tokens, head_dim).values():
            n = 1
            for d in shape:
                n *= d
            total += n * torch.empty((), dtype=dtype).element_size()
        return total

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        """k, v: [..., tokens, head_dim] (any float dtype) -> parts."""
        if self.bits == 16:
            return {"kv": torch.stack((k, v), dim=-3).to(torch.float16)}
        kc, ks, kz = quantize(k, self.bits, axis=-2, group=self.key_group_tokens, shrink=self.key_shrink)
        vc, vs, vz = quantize(v, self.bits, axis=-1, group=self.value_group_channels, shrink=self.value_shrink)
        return {"codes": torch.stack((kc, vc), dim=-3), "k_scale": ks, "k_zero": kz, "v_scale": vs, "v_zero": vz}

    def decode(self, parts: Parts, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """parts -> keys and values as one tensor [2, ..., tokens, head_dim] (K then V) in `dtype`.

        `out` (float32/float64, may be a strided view into a larger buffer) receives the result in place.
        """
        kv = parts["kv" if self.bits == 16 else "codes"].movedim(-3, 0)  # [2, ..., tokens, D or packed]
        if self.bits == 16:
            if out is None:
                return kv.to(dtype)
            return out.copy_(kv)
        compute = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        if out is None:
            *lead, width = kv.shape
            out = torch.empty((*lead, width * 8 // self.bits), dtype=compute, device=kv.device)
        unpack_into(kv, self.bits, out)
        # Scale and zero point, read as fp16 by the in-place ops (no converted copies).
        k, key_axis = _grouped(out[0], -2, self.key_group_tokens)
        k.mul_(parts["k_scale"].unsqueeze(key_axis)).add_(parts["k_zero"].unsqueeze(key_axis))
        v, value_axis = _grouped(out[1], -1, self.value_group_channels)
        v.mul_(parts["v_scale"].unsqueeze(value_axis)).add_(parts["v_zero"].unsqueeze(value_axis))
        return out if out.dtype == dtype else out.to(dtype)


def _grouped(x: torch.Tensor, axis: int, group: int) -> tuple[torch.Tensor, int]:
    """View x [..., T, D] with the group as its own axis; returns the view and the axis to reduce over.

    Always a view (never a copy), so in-place arithmetic on the result lands in x.
    """
    *lead, t, d = x.shape
    if axis == -2:
        return x.view(*lead, t // group, group, d), -2  # [..., T/g, g, D]
    return x.view(*lead, t, d // group, group), -1  # [..., T, D/g, g]


def quantize(x: torch.Tensor, bits: int, axis: int, group: int,
             shrink: tuple[float, ...] = (1.0,)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of x [..., T, D] in groups of `group` along `axis` (-2 tokens, -1 channels).

    Each group's range is its [min, max] shrunk about its midpoint by the factor in `shrink` that quantizes the
    group with the least squared error (values outside the range clamp to its ends); `(1.0,)` is plain min/max.
    Returns (packed codes [..., T, D*bits/8] uint8, scale, zero) with scale/zero fp16 of shape
    [..., T/group, D] (axis -2) or [..., T, D/group] (axis -1).
    """
    levels = (1 << bits) - 1
    xg, red = _grouped(x.float().contiguous(), axis, group)
    chosen = _native_range(xg, axis, bits, shrink) if len(shrink) > 1 else None
    if chosen is not None:
        scale, zero = chosen
    else:
        scale, zero = _torch_range(xg, red, levels, shrink)
    # Quantize against the fp16-rounded scale/zero that decoding will use, so rounding is not paid twice.
    codes = ((xg - zero.float()) / scale.float().clamp_min(1e-8)).round_().clamp_(0, levels)
    packed = pack(codes.to(torch.uint8).reshape(x.shape), bits)
    return packed, scale.squeeze(red), zero.squeeze(red)


def _torch_range(xg: torch.Tensor, red: int, levels: int,
                 shrink: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's fp16 (scale, zero): the factor with the least squared error, errors measured against the
    fp16-rounded scale and zero (what decoding sees); the first factor wins ties."""
    lo, hi = xg.amin(dim=red, keepdim=True), xg.amax(dim=red, keepdim=True)
    scale, zero = _range(lo, hi, shrink[0], levels)
    if len(shrink) == 1:
        return scale, zero
    err = _range_error(xg, red, levels, scale, zero)
    for factor in shrink[1:]:
        s_f, z_f = _range(lo, hi, factor, levels)
        e = _range_error(xg, red, levels, s_f, z_f)
        better = e < err
        err = torch.minimum(e, err)
        scale, zero = torch.where(better, s_f, scale), torch.where(better, z_f, zero)
    return scale, zero


def _range_error(xg: torch.Tensor, red: int, levels: int, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Squared error of each group quantized with the fp16 (scale, zero)."""
    s, z = scale.float().clamp_min(1e-8), zero.float()
    return ((xg - z) / s).round_().clamp_(0, levels).mul_(s).add_(z).sub_(xg).square_().sum(red, keepdim=True)


def _native_range(xg: torch.Tensor, axis: int, bits: int,
                  shrink: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The compiled kernel's choice of the same ranges (None where it cannot run). Imported here, at the call:
    the native package's decode path imports this module."""
    from flashmemory.kvcache.native.quant_range import native_quant_range

    return native_quant_range(xg, axis, bits, shrink)


def _range(lo: torch.Tensor, hi: torch.Tensor, factor: float, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, zero) of the range [lo, hi] shrunk about its midpoint by `factor` (1.0: min/max exactly)."""
    if factor == 1.0:
        return ((hi - lo) / levels).to(torch.float16), lo.to(torch.float16)
    half = (hi - lo) * (0.5 * factor)
    return (half * (2.0 / levels)).to(torch.float16), ((hi + lo) * 0.5 - half).to(torch.float16)


def unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Unpack codes [..., W] straight into the float tensor `out` [..., W * 8 / bits] (which may be a strided view).

    Written for speed on CPU: each bit plane is converted into its contiguous slice of the output (the planar
    layout of `pack`), so there is no intermediate code tensor and no gather.
    """
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    width = packed.shape[-1]
    for i in range(per_byte):
        plane = packed if i == 0 else packed >> (bits * i)
        out[..., i * width : (i + 1) * width] = plane & mask if i < per_byte - 1 else plane
    return out


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] (each < 2**bits) -> [..., D * bits / 8].

    Planar layout: byte j holds channels j, j + W, j + 2W, ... (W = D * bits / 8), lowest bits first, so
    unpacking writes whole contiguous slices.
    """
    per_byte = 8 // bits
    width = codes.shape[-1] // per_byte
    out = codes[..., :width].clone()
    for i in range(1, per_byte):
        out |= codes[..., i * width : (i + 1) * width] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: [..., W] -> uint8 codes [..., W * 8 / bits]."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * i)) & mask for i in range(per_byte)], dim=-1)


@cache
def _record_layout(codec: Codec, tokens: int, head_dim: int) -> RecordLayout:
    layout = {}
    offset = 0
    for name, (shape, dtype) in codec.part_shapes((), tokens, head_dim).items():
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        layout[name] = (offset, size, shape, dtype)
        offset += size
    return MappingProxyType(layout)  # shared by every caller: read-only
