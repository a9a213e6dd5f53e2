"""Which drafts the target keeps: the first tokens it agrees with, then its own next token.

Greedy: a draft stays while it is the target's argmax at its position; the first that is not is
replaced by the argmax (or, all kept, the argmax after the last is added): the output is the
target's own greedy output. Sampling: speculative rejection sampling (Leviathan et al., Chen et
al., 2023): draft x drawn from q stays with probability min(1, p(x) / q(x)); the first rejected
is replaced by a draw from the residual max(p - q, 0) renormalised; all kept, one more is drawn
from p. Each emitted token is then distributed exactly as the target's sampler would draw it.
"""

from __future__ import annotations

import torch

from flashmemory.engine.sampling import Sampler
from flashmemory.engine.speculative.proposal import Proposal


def accept(proposal: Proposal, logits: torch.Tensor, sampler: Sampler) -> list[int]:
    """The tokens to emit, given the target's logits [len(drafts) + 1, vocab] (row i: after the
    sequence's last token and the first i drafts): the kept drafts, then one token of the
    target's. Their count is also the number of the forward's tokens whose KV stays."""
    drafts = proposal.tokens
    if sampler.params.is_greedy:
        best = logits.argmax(dim=-1).tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == best[kept]:
            kept += 1
        return drafts[:kept] + [best[kept]]
    out = []
    for i, token in enumerate(drafts):
        p = sampler.distribution(logits[i])
        q = None if proposal.probs is None else _aligned(proposal.probs[i], p)
        q_token = 1.0 if q is None else float(q[token])
        p_token = float(p[token]) if 0 <= token < p.shape[0] else 0.0
        u = float(torch.rand((), generator=sampler.generator, device=p.device))
        if q_token > 0 and u * q_token < p_token:  # u < p / q, without dividing
            out.append(token)
            continue
        residual = p.clone()
        if q is None:
            residual[token] = 0.0
        else:
            residual = (residual - q).clamp_(min=0.0)
        out.append(sampler.draw(residual if float(residual.sum()) > 0 else p))
        return out
    return out + [sampler.draw(sampler.distribution(logits[len(drafts)]))]


def _aligned(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The draft's distribution over the target's vocabulary (a longer one cut, a shorter padded:
    ids past either vocabulary have no probability there)."""
    q = q.to(p.device, p.dtype)[: p.shape[0]]
    return torch.nn.functional.pad(q, (0, p.shape[0] - q.shape[0]))
