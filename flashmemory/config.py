"""EngineConfig: every engine setting, with units in the names and its documentation, bounds and
flag in the field's Setting (flashmemory/settings.py); validated with the fix in the message. Where
and how the model runs is declared here (RunSettings); the KV hierarchy in kv_settings.py
(KVSettings, which the cache's config extends too)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

import torch

from flashmemory.errors import ConfigError
from flashmemory.guardrail_settings import GuardrailSettings
from flashmemory.kv_settings import KVSettings
from flashmemory.seed_names import drop_always_true, unknown_settings_message
from flashmemory.settings import check_settings, setting
from flashmemory.spec_settings import SpeculativeSettings

# float64 is for numerical verification (exactness tests), not for serving.
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


@dataclass
class RunSettings:
    """Where and how the model runs (the engine's settings before the KV hierarchy's)."""

    model_path: str | None = setting(
        None, "GGUF file or HF safetensors folder; None = the embedded SmolLM2-135M-Instruct",
        flags=("--model-path", "--model"))
    device: str = setting("auto", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    dtype: str = setting("auto", "auto (float32 on CPU, bfloat16 on CUDA when supported), float32, bfloat16 or "
                         "float16 (also fp32, bf16, fp16, half; float64 is for exactness tests)")
    weights_dtype: str = setting(
        "auto", "how weights are stored: auto (a GGUF's block formats Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q3_K/Q4_K/"
        "Q5_K/Q6_K/IQ4_NL/IQ4_XS and F16/BF16 as in the "
        "file, read by a native GEMV on the CPU; other formats and safetensors dense in dtype), float32 or bfloat16 "
        "(every weight dense), q8_0 or q4_0 (quantize a checkpoint's matrices at load: on the CPU into those GGUF "
        "blocks; on CUDA into torchao int8 per-row / int4 group-32 weight-only, pip install torchao==0.18.0)",
        choices=("auto", "float32", "bfloat16", "q8_0", "q4_0"))
    decode_activations: str = setting(
        "auto", "how the CPU's GEMV over block-format weights multiplies x: int8 (x rounded to 8 "
        "bits per 32 values, integer dot products, as llama.cpp does: 1.1-7x faster by format, "
        "logits off by ~0.5 % of a dot's size), float32 (x as it is: the float32-dequantized "
        "model's logits to summation error), auto (int8 for the K-quants, Q5_1 and IQ4, whose "
        "float path dequantizes each block; float32 for Q4_0/Q4_1/Q5_0/Q8_0 and without AVX2). "
        "The decoder layers' projections, prefill rows rounded alike; the LM head keeps float32 x "
        "where its format has a one-row float dot (Q4_0/Q4_1/Q5_0/Q8_0), else follows this",
        choices=("auto", "int8", "float32"))
    max_seq_len: int | None = setting(
        None, "longest sequence (prompt + generated); None = the model's limit", unit="tokens", ge=2)
    num_threads: int | None = setting(
        None, "torch intra-op threads on CPU; None = torch's default", ge=1, flags=("--threads",), dest="threads",
        env_aliases=("FLASHMEMORY_THREADS",))
    rope_sharding: bool = setting(
        True, "RoPE cos/sin tables built lazily in 512-position shards as positions are first reached (memory grows "
        "with the context); off: one table for max_seq_len positions built at start", negatable=True)
    parse_special_tokens_in_content: bool = setting(
        False, "let chat message content write control tokens: its control-token text (such as "
        "<|im_end|>) is read as those tokens, as tokenizing the rendered template in one pass "
        "does, so a message can forge a turn of another role; off: only the template's own "
        "control tokens are control tokens and content is plain text (the same ids for content "
        "without control-token text). Raw prompts (completions, generate) parse control tokens "
        "either way, as vLLM does")


# NOTE: the bases in this order keep the fields in their order of old (dataclasses collect them
# from the last base up): RunSettings' first, then KVSettings', SpeculativeSettings',
# GuardrailSettings'.
@dataclass
class EngineConfig(GuardrailSettings, SpeculativeSettings, KVSettings, RunSettings):
    """Settings of one FlashMemoryEngine; each field's Setting holds its help, bounds and flag."""

    def __post_init__(self) -> None:
        # NOTE: dtype and device take open spellings (aliases, cuda:N), so they are checked here, not by choices.
        if self.dtype in _DTYPE_ALIASES:
            self.dtype = _DTYPE_ALIASES[self.dtype]
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use one of: auto, {', '.join(_DTYPES)}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device={self.device!r} is not supported; use auto, cpu, cuda or cuda:N")
        check_settings(self)  # types, bounds and choices, as each field's Setting declares them
        self._check_cross_field()
        self._check_speculative()

    def _check_speculative(self) -> None:
        """The rules that tie the speculative settings together."""
        method, draft = self.speculative_method, self.draft_model_path
        if method == "draft" and draft is None:
            raise ConfigError("speculative_method='draft' needs draft_model_path (a smaller model "
                              "than the target); or use speculative_method='ngram'")
        if method in ("ngram", "off") and draft is not None:
            raise ConfigError(f"draft_model_path is set but speculative_method={method!r} does not "
                              "use it: drop draft_model_path, or set speculative_method='draft'")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min={self.prompt_lookup_min} is greater than "
                              f"prompt_lookup_max={self.prompt_lookup_max}; lower it or raise "
                              "prompt_lookup_max")

    @property
    def speculation(self) -> str:
        """What drafts tokens: "draft", "ngram" or "off" ("auto" resolved)."""
        if self.speculative_method == "auto":
            return "off" if self.draft_model_path is None else "draft"
        return self.speculative_method

    def resolve_block_size(self, max_seq_len: int) -> int:
        """Tokens per block; "auto" keeps block tables short for long contexts."""
        if self.block_size != "auto":
            return int(self.block_size)
        return 16 if max_seq_len <= 8192 else 32 if max_seq_len <= 32768 else 64

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments; an unknown one raises ConfigError listing the valid names."""
        kwargs = drop_always_true(kwargs)
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise ConfigError(unknown_settings_message(unknown, valid))
        return cls(**kwargs)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={self.device!r} but CUDA is not available on this machine; use device='cpu'")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
