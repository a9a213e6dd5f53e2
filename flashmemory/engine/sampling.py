"""SamplingParams (validated) and the sampler: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flashmemory.errors import SamplingParamsError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop."""

    max_new_tokens: int = 256  # upper bound on generated tokens
    temperature: float = 0.0  # 0 = greedy (argmax); > 0 divides the logits
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = no limit
    seed: int | None = None  # same seed, same prompt, same settings -> same text
    stop: tuple[str, ...] = field(default_factory=tuple)  # strings that end generation (not included in the output)
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> SamplingParamsError:
            return SamplingParamsError(f"{param}: {message}", param=param)

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be an integer >= 0 (0 or -1 = no limit), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", f"must be an integer or None, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise bad("stop", f"must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _is_real(x: object) -> bool:
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
        p = self.params
        if p.is_greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the tokens before it already reach top_p (the first token always stays).
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
