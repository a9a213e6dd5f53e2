"""SamplingParams (validated) and the sampler: greedy, temperature, top-k, top-p, seeded.

The sampler works on float32 logits, so the accepted ranges are the ones float32 can carry:

- temperature: 0 or any number up to FLOAT32_MAX (above it the divisor would be inf in float32). Below
  GREEDY_BELOW_TEMPERATURE (1e-5, vLLM's sampling epsilon) sampling is greedy: that is the limit of the
  distribution, and dividing logits by a smaller number only tests float32's overflow.
- top_p: in [FLOAT32_TINY, 1]. A smaller positive top_p rounds to 0 (or to a subnormal a CPU may flush to 0)
  in float32, where the comparison with the cumulative probabilities would drop every token. Any top_p below
  1 / vocabulary size keeps the most likely token only.
- seed: 0 <= seed < 2**64, the range of torch.Generator.manual_seed. Choice i of n uses choice_seed(seed, i).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashmemory.errors import SamplingParamsError

FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # 3.4e38: the largest accepted temperature
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # 1.2e-38: the smallest normal float32, the least top_p
GREEDY_BELOW_TEMPERATURE = 1e-5  # a smaller positive temperature samples greedily (as vLLM's _SAMPLING_EPS)
SEED_MODULUS = 2**64  # seeds are 64-bit: 0 <= seed < SEED_MODULUS


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed`: distinct per choice, reproducible, in range."""
    return (seed + index) % SEED_MODULUS


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop."""

    max_new_tokens: int = 256  # upper bound on generated tokens
    temperature: float = 0.0  # 0 (and anything below 1e-5) = greedy; otherwise divides the logits; at most 3.4e38
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p; in [1.2e-38, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = no limit (as does any k >= the vocabulary size)
    seed: int | None = None  # 0 <= seed < 2**64; same seed, same prompt, same settings -> same text
    stop: tuple[str, ...] = field(default_factory=tuple)  # strings that end generation (not included in the output)
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> SamplingParamsError:
            return SamplingParamsError(f"{param}: {message}", param=param)

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise bad("temperature", f"must be a number in [0, {FLOAT32_MAX:.7g}] (0 = greedy; the upper bound is "
                      f"float32's largest), got {self.temperature!r}")
        if not _is_real(self.top_p) or not FLOAT32_TINY <= self.top_p <= 1:
            raise bad("top_p", f"must be a number in [{FLOAT32_TINY:.7g}, 1] (smaller values are 0 in float32; 1 = "
                      f"no limit), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", f"must be an integer >= 0 (0 or -1 = no limit), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_MODULUS):
            raise bad("seed", f"must be an integer in [0, 2**64), or None, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise bad("stop", f"must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    # NOTE: NaN and inf fail the range checks above, so no separate isfinite test is needed.
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Sampler:
    """Owns one request's random generator; turns float32 logits [vocab] into a token id."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.is_greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def sample(self, logits: torch.Tensor) -> int:
        if self.params.is_greedy:
            return int(torch.argmax(logits))
        return self.draw(self.distribution(logits))

    def draw(self, probs: torch.Tensor) -> int:
        """One token from probabilities [vocab] (they need not sum to 1), with this request's
        generator."""
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The probabilities [vocab] `sample` draws from (after top-k, temperature and top-p); a
        sampling request only."""
        p = self.params
        logits = logits.float()  # [vocab]
        if 0 < p.top_k < logits.shape[-1]:
            # Before the temperature: a huge temperature would turn distinct logits into ties.
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        # Rank by the logits before the temperature: a huge temperature turns distinct logits into ties, and the
        # nucleus must still start from the most likely token.
        order = torch.argsort(logits, descending=True, stable=True) if p.top_p < 1.0 else None
        # NOTE: shifting by the max first makes every scaled logit <= 0 with the best one exactly 0, so a small
        # temperature can overflow only to -inf (probability 0), never to +inf (inf - inf = NaN in the softmax).
        logits = (logits - logits.max()) / p.temperature
        if order is not None:
            sorted_logits = logits[order]
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the tokens before it already reach top_p.
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            drop[0] = False  # the most likely token always stays, whatever float32 makes of a tiny top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        return torch.softmax(logits, dim=-1)
