"""SequenceKV: one sequence's state in the tiered cache besides its block table."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashmemory.kvcache.manager.blocks import Level
from flashmemory.kvcache.read.plan import LevelPlan
from flashmemory.kvcache.read.selection import DIGEST_DTYPE


@dataclass
class SequenceKV:
    """Owns a sequence's still-filling block row, its key digests and the keys/values of the forward in flight."""

    filling_row: int  # row of the cache's RecentRows arena: the newest full blocks kept FP16 and the filling block
    num_tokens: int = 0  # committed tokens (full blocks + the filling block)
    num_filling: int = 0  # tokens in the row: the sink blocks', the recent full blocks' and the filling block's
    num_recent: int = 0  # of those, tokens of the newest full blocks (written to the levels; attended from the row)
    num_sink: int = 0  # of those, tokens of the attention-sink blocks (likewise)
    digest: torch.Tensor | None = None  # [num_layers, num_kv_heads, capacity_blocks, boxes * 2 * head_dim] (key_digest)
    # Per level, the digests of its candidates gathered when they are not one run of blocks
    # (placement by locality leaves holes), kept until a block is (re)written.
    digest_gathers: dict = field(default_factory=dict)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer, this forward
    plan: dict[Level, LevelPlan] | None = None  # built at layer 0 of a forward, dropped at commit
    pinned_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) token ranges kept in L0
    token_ids: list[int] | None = field(default_factory=list)  # every committed token; None once one was not given
    last_block_name: int = 0  # chain hash of its last full block (prefix cache); 0 before the first
    filling_decoded: bool = False  # the filling block holds a token whose KV an approximate decode step computed
    # Per level and layer, [num_kv_heads, k] logical indices of the old blocks the last prefill chunk's final
    # queries score highest (the question of a prompt): decode steps always read them (read/hints.py).
    hints: dict[Level, dict[int, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_partial(self) -> int:
        """Tokens of the still-filling block (the row's tokens that belong to no full block yet)."""
        return self.num_filling - self.num_sink - self.num_recent

    def record_digest(self, index: int, digest: torch.Tensor) -> None:
        """Keep block `index`'s digest [num_layers, num_kv_heads, width] (in DIGEST_DTYPE), growing the store by
        doubling. The store is in host memory whatever the compute device: digests grow with the context (about
        a quarter of the FP16 KV's bytes with 4-key boxes) and only score L1 / L2 blocks, which live on the host
        too, so on a GPU they would take the device memory the hierarchy exists to save."""
        if self.digest is None or self.digest.shape[2] <= index:
            capacity = max(64, 2 * (index + 1))
            num_layers, heads, width = digest.shape
            grown = torch.empty((num_layers, heads, capacity, width), dtype=DIGEST_DTYPE, device="cpu")
            if self.digest is not None:
                grown[:, :, : self.digest.shape[2]] = self.digest
            self.digest = grown
        self.digest[:, :, index] = digest
        self.digest_gathers.clear()  # gathers made before may hold another digest at `index`
