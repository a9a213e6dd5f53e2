"""The seeds' settings as written: every keyword of their FlashMemoryEngine examples is accepted, and every name
they (or transformers / vLLM habits) use that is not a setting fails with a ConfigError saying what replaces it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from flashmemory.config import EngineConfig
from flashmemory.errors import ConfigError
from flashmemory.seed_names import ALWAYS, REPLACED

DOC = Path(__file__).resolve().parents[1] / "docs" / "seed-names.md"

# The keyword arguments of seed 000's FlashMemoryEngine(...) examples and configuration lists, with their values.
SEED_KEYWORDS = {
    "model_path": "Qwen2.5-7B", "max_gpu_memory_mb": 3800, "kv_precision": "mixed", "active_window": 1024,
    "semantic_truncate_threshold": 0.15, "cpu_memory_gb": 12.0, "prefetch_strategy": "adaptive",
    "rope_sharding": True, "cold_zone_enabled": False,
    # seed 000 §4.3 (its guardrail_path names NeMo Guardrails; ours is a classifier we can run)
    "guardrail_path": "toxic-comment-classifier", "guardrail_offload": True,
    "guardrail_timeout_ms": 50,
}


def test_every_seed_keyword_that_is_a_setting_is_accepted_as_written():
    config = EngineConfig.from_kwargs(**SEED_KEYWORDS)
    assert all(getattr(config, name) == value for name, value in SEED_KEYWORDS.items()
               if name not in ALWAYS)
    EngineConfig.from_kwargs(active_window=4096, cpu_memory_gb=48.0, prefetch_strategy="adaptive",
                             rope_sharding=True)  # seed 000 §3.2's list


@pytest.mark.parametrize("name", sorted(REPLACED))
def test_a_seed_name_that_is_not_a_setting_says_what_replaces_it(name):
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_kwargs(**{name: 1})
    message = str(e.value)
    assert message == f"{name}: {REPLACED[name]}"
    assert "valid settings" not in message  # the fix is named, not a list to search


@pytest.mark.parametrize("name", sorted(ALWAYS))
def test_a_seed_name_that_is_always_so_is_accepted_with_that_value_and_refused_with_another(name):
    value, why = ALWAYS[name]
    assert name not in dataclasses.asdict(EngineConfig.from_kwargs(**{name: value}))
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_kwargs(**{name: not value})
    fix = f"drop {name} or set it {value!r}"
    assert str(e.value) == f"{name}={not value!r} is not supported: {why}; {fix}"


def test_unknown_and_replaced_names_together_name_both():
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_kwargs(tensor_parallel=2, no_such_knob=3)
    message = str(e.value)
    assert "unknown engine setting(s) no_such_knob; valid settings: model_path" in message
    assert "tensor_parallel: one device per engine" in message


def test_the_seed_names_table_lists_every_keyword_and_every_replaced_name():
    doc = DOC.read_text(encoding="utf-8")
    for name in [*SEED_KEYWORDS, *REPLACED, *ALWAYS]:
        assert f"| `{name}`" in doc, name


def test_rope_sharding_off_builds_one_table_at_start_and_gives_the_same_logits(tiny_llama):
    from flashmemory import FlashMemoryEngine

    ids = list(range(3, 40))
    logits = {}
    for sharded in (True, False):
        engine = FlashMemoryEngine(model_path=str(tiny_llama), rope_sharding=sharded, kv_cache="contiguous")
        assert engine.model.rotary.num_cached_positions == (0 if sharded else engine.max_seq_len)
        logits[sharded] = engine.prompt_logits(ids)
        # one 512-position shard when sharded; the table made at start (the model's 256 positions) when not
        assert engine.model.rotary.num_cached_positions == (512 if sharded else engine.max_seq_len)
        engine.close()
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=1e-6)
