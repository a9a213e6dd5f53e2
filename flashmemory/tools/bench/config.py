"""BenchConfig: what one `flashmemory bench` invocation measures, with units in the names, validated."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from flashmemory.errors import ConfigError

DEFAULT_LENGTHS_TOKENS = (512, 2048, 8192)
QUICK_LENGTH_TOKENS = 512
QUICK_NUM_RUNS = 1
QUICK_DECODE_TOKENS = 8
QUICK_FIDELITY_TOKENS = 16


def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_length(text: str) -> int:
    """'512', '2K', '8k' -> tokens (K = 1024)."""
    raw = text.strip().lower()
    try:
        return int(raw[:-1]) * 1024 if raw.endswith("k") else int(raw)
    except ValueError:
        raise ConfigError(f"--lengths {text!r}: write a number of tokens such as 512, 2048 or 2K") from None


@dataclass
class BenchConfig:
    """Settings of one benchmark: engines, text, lengths, repetitions, budget, outputs."""

    model_path: str | None = None  # GGUF or HF folder; None = the embedded SmolLM2 (its GGUF feeds llama.cpp)
    text_path: Path | None = None  # long real text; None = ../shared/data/alice29.txt
    lengths_tokens: tuple[int, ...] = DEFAULT_LENGTHS_TOKENS  # prompt lengths, capped by the model's context limit
    num_runs: int = 3  # runs per (engine, length); the table shows medians
    decode_tokens: int = 32  # greedy tokens generated after each prompt
    engines: tuple[str, ...] = ()  # engine names (see engines.py); empty = every engine
    budget_mb: float | None = None  # fixed device-KV budget in MiB; None = the bytes of a 2K-token FP16 cache
    num_threads: int = field(default_factory=lambda: min(available_cores(), 8))  # CPU threads of every engine
    dtype: str = "float32"  # model dtype of the torch engines (float32: exact and fastest on CPU)
    fidelity_tokens: int = 128  # teacher-forced tokens scored against the exact cache; 0 = no fidelity
    verify_limit: bool = True  # run FlashMemory at the model's limit under the fixed budget (full runs)
    json_path: Path | None = None
    charts_dir: Path | None = None
    quick: bool = False  # one short length, one run, few tokens: a couple of minutes

    def __post_init__(self) -> None:
        if not self.lengths_tokens:
            raise ConfigError("--lengths needs at least one context length")
        for n in self.lengths_tokens:
            if not isinstance(n, int) or n < 2:
                raise ConfigError(f"context length {n!r} must be an integer >= 2 (tokens)")
        if not isinstance(self.num_runs, int) or self.num_runs < 1:
            raise ConfigError(f"--runs {self.num_runs!r} must be a positive integer")
        if not isinstance(self.decode_tokens, int) or self.decode_tokens < 2:
            raise ConfigError(f"--decode-tokens {self.decode_tokens!r} must be at least 2 (the first token comes "
                              "from the prefill; decode speed needs one more)")
        if not isinstance(self.fidelity_tokens, int) or self.fidelity_tokens < 0 or self.fidelity_tokens == 1:
            raise ConfigError(f"--fidelity-tokens {self.fidelity_tokens!r} must be 0 (off) or at least 2")
        if self.budget_mb is not None and not self.budget_mb > 0:
            raise ConfigError(f"--budget-mb {self.budget_mb!r} must be a positive number of MiB")
        if not isinstance(self.num_threads, int) or self.num_threads < 1:
            raise ConfigError(f"--threads {self.num_threads!r} must be a positive integer")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype {self.dtype!r}: use float32, bfloat16 or float16")
        if len(set(self.lengths_tokens)) != len(self.lengths_tokens):
            raise ConfigError(f"--lengths {list(self.lengths_tokens)} repeats a length")

    @classmethod
    def create(cls, quick: bool = False, **settings: object) -> "BenchConfig":
        """A config from the settings given (None = not given); --quick fills what is not given with its values:
        one short length, one run, few decode and fidelity tokens, no run at the model's limit."""
        given = {k: v for k, v in settings.items() if v is not None}
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - valid)
        if unknown:
            raise ConfigError(f"unknown bench setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
        if quick:
            given.setdefault("lengths_tokens", (QUICK_LENGTH_TOKENS,))
            given.setdefault("num_runs", QUICK_NUM_RUNS)
            given.setdefault("decode_tokens", QUICK_DECODE_TOKENS)
            given.setdefault("fidelity_tokens", QUICK_FIDELITY_TOKENS)
            given.setdefault("verify_limit", False)
        return cls(quick=quick, **given)  # type: ignore[arg-type]
