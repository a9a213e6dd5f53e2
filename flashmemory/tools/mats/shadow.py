"""The shadow: an FP16 copy of every key and value the stress suites wrote, kept outside the cache, and the
synthetic tokens they write (deterministic from the run's seed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_DTYPE = torch.float16  # what the cache stores unquantized, so what a read must give back bit for bit


@dataclass(frozen=True)
class Geometry:
    """The small model shape the cache is stressed with (no checkpoint: keys and values are synthetic)."""

    num_layers: int = 2
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # grouped-query attention, 2 query heads per KV head
    head_dim: int = 32  # one value group (32 channels) per token and head
    block_size: int = 8  # tokens per block (and per key quantization group)


@dataclass
class Tokens:
    """q, k, v of some new tokens of one sequence: q [layers, n, heads, D]; k, v [layers, n, kv_heads, D] (fp16)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.q.shape[1]


class ShadowSequence:
    """Owns the FP16 keys and values written so far for one sequence, and its token generator's key offsets."""

    def __init__(self, geometry: Geometry, max_tokens: int, generator: torch.Generator) -> None:
        g = geometry
        self.geometry = geometry
        self.max_tokens = max_tokens
        self.k = torch.zeros(g.num_layers, max_tokens, g.num_kv_heads, g.head_dim, dtype=KV_DTYPE)
        self.v = torch.zeros_like(self.k)
        self.num_tokens = 0
        # Real keys carry a per-channel offset (RoPE'd channels differ in scale): so a block's min/max box, and
        # with it Quest's selection and the key quantization, see realistic structure.
        self.key_offset = 2 * torch.randn(g.num_layers, 1, g.num_kv_heads, g.head_dim, generator=generator)
        self.key_scale = 0.5 + torch.rand(g.num_layers, 1, g.num_kv_heads, g.head_dim, generator=generator)

    def new_tokens(self, n: int, generator: torch.Generator) -> Tokens:
        """q, k, v of the next n tokens (not yet written)."""
        g = self.geometry
        q = torch.randn(g.num_layers, n, g.num_heads, g.head_dim, generator=generator)
        k = torch.randn(g.num_layers, n, g.num_kv_heads, g.head_dim, generator=generator) * self.key_scale
        v = torch.randn(g.num_layers, n, g.num_kv_heads, g.head_dim, generator=generator)
        return Tokens(q, (k + self.key_offset).to(KV_DTYPE), v.to(KV_DTYPE))

    def replay(self, start: int, end: int, generator: torch.Generator) -> Tokens:
        """The already written tokens [start, end) again, with fresh queries (a recompute writes the same KV)."""
        g = self.geometry
        q = torch.randn(g.num_layers, end - start, g.num_heads, g.head_dim, generator=generator)
        return Tokens(q, self.k[:, start:end].clone(), self.v[:, start:end].clone())

    def append(self, tokens: Tokens) -> None:
        n = tokens.num_tokens
        self.k[:, self.num_tokens : self.num_tokens + n] = tokens.k
        self.v[:, self.num_tokens : self.num_tokens + n] = tokens.v
        self.num_tokens += n

    def block(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of full block `index`, as a level stores them: each [layers, kv_heads, block_size, D]."""
        bs = self.geometry.block_size
        if (index + 1) * bs > self.num_tokens:
            raise IndexError(f"block {index} is not full: the sequence has {self.num_tokens} tokens")
        k = self.k[:, index * bs : (index + 1) * bs].transpose(1, 2)
        v = self.v[:, index * bs : (index + 1) * bs].transpose(1, 2)
        return k, v

    def upto(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens [0, end): each [layers, end, kv_heads, D]."""
        return self.k[:, :end], self.v[:, :end]
