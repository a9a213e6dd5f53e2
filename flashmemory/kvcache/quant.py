"""KV codecs: asymmetric min/max group quantization (KIVI layout) at INT4 / INT2, and fp16 pass-through.

Keys are grouped per channel (min/max over `key_group_tokens` consecutive tokens of one channel), values per
token (min/max over `value_group_channels` consecutive channels of one token). Scales and zero points are
fp16. Codes are packed along head_dim: two INT4 or four INT2 codes per byte (planar: see `pack`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Every codec turns keys and values [..., tokens, head_dim] into named parts and back.
Parts = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Codec:
    """How one level stores a block's keys and values."""

    bits: int  # 16 (fp16 pass-through), 4 or 2
    key_group_tokens: int = 16  # tokens sharing one per-channel scale/zero of the keys
    value_group_channels: int = 32  # channels sharing one per-token scale/zero of the values

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 16):
            raise ValueError(f"unsupported bit width {self.bits}")

    @property
    def name(self) -> str:
        return "fp16" if self.bits == 16 else f"int{self.bits}"

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
        kc, ks, kz = quantize(k, self.bits, axis=-2, group=self.key_group_tokens)
        vc, vs, vz = quantize(v, self.bits, axis=-1, group=self.value_group_channels)
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


def quantize(x: torch.Tensor, bits: int, axis: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of x [..., T, D] in groups of `group` along `axis` (-2 tokens, -1 channels).

    Returns (packed codes [..., T, D*bits/8] uint8, scale, zero) with scale/zero fp16 of shape
    [..., T/group, D] (axis -2) or [..., T, D/group] (axis -1).
    """
    levels = (1 << bits) - 1
    xg, red = _grouped(x.float().contiguous(), axis, group)
    lo = xg.amin(dim=red, keepdim=True)
    hi = xg.amax(dim=red, keepdim=True)
    scale = ((hi - lo) / levels).to(torch.float16)
    zero = lo.to(torch.float16)
    # Quantize against the fp16-rounded scale/zero that decoding will use, so rounding is not paid twice.
    s = scale.float().clamp_min(1e-8)
    codes = ((xg - zero.float()) / s).round_().clamp_(0, levels).to(torch.uint8).reshape(x.shape)
    return pack(codes, bits), scale.squeeze(red), zero.squeeze(red)


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
