"""GenerationStats: what one generate/stream call cost, for the CLI summary line and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmemory.rss import peak_rss_bytes


@dataclass
class GenerationStats:
    """Counts and timings of one generation."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    prefill_seconds: float = 0.0  # prompt forward until the first token's logits
    time_to_first_token_s: float = 0.0  # call start -> first token sampled (includes tokenization)
    decode_seconds: float = 0.0  # first token -> last token
    peak_memory_bytes: int = 0  # peak RSS of the process (CPU) or peak allocated device memory (CUDA)
    memory_kind: str = "RSS"
    finish_reason: str = ""  # "stop" (EOS or stop string) | "length" | "content_filter"
    stop_reason: str = ""  # content_filter: what the guardrail flagged ("guardrail: toxic (0.93)")
    first_token_at_s: float = 0.0  # time.perf_counter() when the first token was sampled (0 = not yet)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from the prefill; the rest from decode steps.
        steps = self.num_generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    def summary(self) -> str:
        return (
            f"prompt {self.num_prompt_tokens} tokens | TTFT {self.time_to_first_token_s:.2f} s "
            f"(prefill {self.prefill_tokens_per_s:.0f} tok/s) | decode {self.decode_tokens_per_s:.1f} tok/s "
            f"({self.num_generated_tokens} tokens, {self.finish_reason}) | "
            f"peak {self.memory_kind} {self.peak_memory_bytes / 2**20:.0f} MiB"
        )


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): the process's peak RSS on CPU, peak allocated device memory on CUDA."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "GPU"
    return peak_rss_bytes(), "RSS"
