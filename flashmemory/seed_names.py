"""Names the seed documents (and users of transformers or vLLM) pass to FlashMemoryEngine that are not settings
here: what replaces each, or why it does not apply, so an unknown keyword fails with the fix (stdlib only).

Every keyword of the seeds' FlashMemoryEngine examples that is a setting works as written (model_path,
max_gpu_memory_mb, kv_precision="mixed", active_window, semantic_truncate_threshold, cpu_memory_gb,
prefetch_strategy="adaptive", rope_sharding=True, cold_zone_enabled=False, guardrail_path,
guardrail_offload=True, guardrail_timeout_ms);
docs/seed-names.md has the table.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flashmemory.errors import ConfigError

# name -> (the value that is always so here, why): accepted as written with that value (the seeds'
# code runs unchanged), refused with the reason for any other.
ALWAYS: dict[str, tuple[Any, str]] = {
    "guardrail_offload": (True, "the guardrail (guardrail_path) always runs on CPU threads "
                                "beside the engine, INT8 by default, and holds no device memory"),
}

# name -> what to use instead (or why there is nothing to set); a sentence that completes "<name>: ..."
REPLACED: dict[str, str] = {
    # seed 000 §4.2: multimodal input is not supported (our decoder takes text).
    "image_downscale_ratio": "image input is not supported (the engine runs text-only Llama-family models); "
                             "pin a span of the prompt with pinned_spans=[(start, end)] to keep it on the device",
    # seed 000 §4.1 and §3.2 prose, transformers and vLLM habits.
    "disable_swap": "use lock_host_memory=True (flag --disable-swap or --lock-host-memory): the "
                    "host KV level is locked in RAM with mlock; `flashmemory doctor` reports swap "
                    "and RLIMIT_MEMLOCK",
    "batch_size": "there is no fixed batch: use max_num_seqs (sequences alive at once; admission follows the KV "
                  "memory each level has left)",
    "tensor_parallel": "one device per engine: multi-GPU tensor parallelism is not supported",
    "device_map": "use device='auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'",
    "torch_dtype": "use dtype='auto', 'float32', 'bfloat16' or 'float16'",
    "use_cache": "the engine always caches KV: choose kv_cache='tiered' (the hierarchy) or 'contiguous' (exact)",
    "use_paged_attention": "KV is always paged: kv_cache='tiered' (the default) stores it in blocks of block_size",
    "page_size": "use block_size (tokens per KV block: 8, 16, 32, 64, 128 or 'auto')",
    "max_context_length": "use max_seq_len (prompt + generated tokens)",
    "max_model_len": "use max_seq_len (prompt + generated tokens)",
    "gradient_checkpointing": "FlashMemory only runs inference: there is no gradient path to checkpoint",
    "max_new_tokens": "max_new_tokens is an option of generate/stream/chat, not of the engine: "
                      "engine.generate(prompt, max_new_tokens=64)",
    "temperature": "temperature is an option of generate/stream/chat, not of the engine",
}


def drop_always_true(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` less the ALWAYS names that state what is so; ConfigError for one that does not."""
    for name, (value, why) in ALWAYS.items():
        if name in kwargs and kwargs[name] != value:
            raise ConfigError(f"{name}={kwargs[name]!r} is not supported: {why}; drop {name} or "
                              f"set it {value!r}")
    return {k: v for k, v in kwargs.items() if k not in ALWAYS}


def unknown_settings_message(unknown: Iterable[str], valid: Iterable[str]) -> str:
    """The ConfigError text for keywords that are not settings: what replaces each known one, then the valid
    settings when some are unknown to us too."""
    unknown = sorted(unknown)
    known = [f"{name}: {REPLACED[name]}" for name in unknown if name in REPLACED]
    other = [name for name in unknown if name not in REPLACED]
    parts = []
    if other:
        parts.append(f"unknown engine setting(s) {', '.join(other)}; valid settings: {', '.join(valid)}")
    parts += known
    return "; ".join(parts)
