"""Weights held in 8 bits: each row of a matrix as int8 with one float32 scale (symmetric, the
row's largest magnitude maps to 127), dequantized where it is used. The classifiers' matrices are
small (an LSTM's 50 x 200, a vocabulary's 20,000 x 50): the rows a text touches are dequantized per
check, which costs far less than the check's recurrence."""

from __future__ import annotations

import torch


class Int8Rows:
    """A float matrix as int8 rows and a scale per row."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().to(torch.float32)
        if w.dim() != 2:
            raise ValueError(f"Int8Rows takes a matrix, got shape {tuple(w.shape)}")
        scale = w.abs().amax(dim=1, keepdim=True) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        self.q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
        self.scale = scale.squeeze(1).contiguous()

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The float32 rows at `index` (an embedding lookup)."""
        return self.q[index].to(torch.float32) * self.scale[index].unsqueeze(-1)

    def dequantize(self) -> torch.Tensor:
        return self.q.to(torch.float32) * self.scale.unsqueeze(1)

    def nbytes(self) -> int:
        q, s = self.q, self.scale
        return q.numel() * q.element_size() + s.numel() * s.element_size()
