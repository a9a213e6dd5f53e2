"""Rotary position embeddings with the scalings real checkpoints use, tabulated lazily in 512-position shards."""

from __future__ import annotations

import math
from typing import Any

import torch

SHARD_POSITIONS = 512  # cos/sin rows built at a time: memory O(positions x head_dim), never O(seq^2)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_position_embeddings: int,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin attention factor for one rope type.

    `seq_len` matters only for "dynamic" (NTK-aware) scaling, whose base grows with the context.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    assert scaling is not None
    factor = scaling.get("factor")
    if rope_type == "linear":
        return inv_freq / float(factor), 1.0
    if rope_type == "dynamic":
        seq_len = max(seq_len or 0, max_position_embeddings)
        base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base**exponents), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"unknown rope type {rope_type!r}")  # ModelConfig validates before we get here


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position_embeddings / original
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """Owns the cos/sin tables of one model and rotates queries and keys (rotate-half layout, as HF stores weights)."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_position_embeddings: int,
        device: torch.device,
    ) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.max_position_embeddings = max_position_embeddings
        self.device = device
        self.is_dynamic = (scaling or {}).get("rope_type") == "dynamic"
        self._inv_freq, self._attention_factor = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings)
        # Shards are appended as positions are first reached; the table is their concatenation.
        self._cos = torch.empty(0, head_dim, device=device)
        self._sin = torch.empty(0, head_dim, device=device)

    @property
    def num_cached_positions(self) -> int:
        return self._cos.shape[0]

    def _table_for(self, inv_freq: torch.Tensor, attention_factor: float, positions: torch.Tensor):
        # positions: [T] -> cos, sin: [T, head_dim] float32
        freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * attention_factor, emb.sin() * attention_factor

    def tabulate(self, num_positions: int) -> None:
        """Build the table for positions [0, num_positions) now, in one piece (rope_sharding=False: no shard is
        added while decoding, at the price of the whole table's memory from the start)."""
        if num_positions > self._cos.shape[0]:
            positions = torch.arange(num_positions, device=self.device)
            self._cos, self._sin = self._table_for(self._inv_freq, self._attention_factor, positions)

    def _extend_to(self, num_positions: int) -> None:
        while self._cos.shape[0] < num_positions:
            start = self._cos.shape[0]
            shard = torch.arange(start, start + SHARD_POSITIONS, device=self.device)
            cos, sin = self._table_for(self._inv_freq, self._attention_factor, shard)
            self._cos = torch.cat((self._cos, cos))
            self._sin = torch.cat((self._sin, sin))

    def cos_sin(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] float32 for `positions` [T]; `max_position` is the largest position among them."""
        if self.is_dynamic and max_position + 1 > self.max_position_embeddings:
            # NTK-aware scaling changes the base with the context length, so no table survives: compute directly.
            inv_freq, factor = rope_inv_freq(
                self.head_dim, self.theta, self.scaling, self.max_position_embeddings, seq_len=max_position + 1
            )
            return self._table_for(inv_freq, factor, positions)
        self._extend_to(max_position + 1)
        return self._cos[positions], self._sin[positions]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, head_dim] by cos/sin [T, head_dim]."""
        cos = cos[:, None, :].to(x.dtype)
        sin = sin[:, None, :].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
