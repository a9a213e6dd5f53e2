"""transformers' DynamicCache built from a KV snapshot decodes as transformers' own prefill does."""

from __future__ import annotations


import numpy as np
import pytest

from flashmemory.errors import KVSnapshotError


def _snapshot(model_path, ids: list[int], path) -> None:
    from flashmemory.engine.engine import FlashMemoryEngine

    engine = FlashMemoryEngine(model_path=str(model_path), kv_cache="contiguous", kv_precision="fp16")
    try:
        engine.score_tokens(ids, num_teacher_forced=4, kv_snapshot=path)  # KV of all but the last 4 saved
    finally:
        engine.close()


def test_a_restored_dynamic_cache_gives_the_logits_of_transformers_own_prefill(tiny_llama, tmp_path):
    from flashmemory.tools.bench.hf_decode_stepper import TransformersStepper

    ids = [(i * 7 + 3) % 300 + 3 for i in range(44)]
    _snapshot(tiny_llama, ids, tmp_path / "s.kvsnap")  # 40 tokens of KV
    spec = {"gguf_path": str(tiny_llama), "threads": 1, "settings": {"cache": "dynamic"}}
    own = TransformersStepper(spec, 64)
    own.open()
    own.feed(ids[:36])
    own.feed([ids[36]])
    restored = TransformersStepper(spec, 64)
    restored.open()
    restored.restore(tmp_path / "s.kvsnap", ids, 32)
    restored.feed(ids[32:36])  # the rest of the context, then one step, as the decode worker does
    restored.feed([ids[36]])
    # the restored KV went through FP16 (the snapshot's dtype), transformers' own is float32
    assert np.abs(restored.last_logprobs() - own.last_logprobs()).max() < 2e-3
    assert restored.cache.get_seq_length() == own.cache.get_seq_length() == 37
    assert restored.kv_bytes() == own.kv_bytes() and restored.kv_bytes()["device"] > 0


def test_a_snapshot_of_other_tokens_is_refused(tiny_llama, tmp_path):
    from flashmemory.tools.bench.hf_decode_stepper import TransformersStepper

    ids = list(range(3, 47))
    _snapshot(tiny_llama, ids, tmp_path / "s.kvsnap")
    stepper = TransformersStepper({"gguf_path": str(tiny_llama), "threads": 1, "settings": {}}, 64)
    stepper.open()
    with pytest.raises(KVSnapshotError, match="other tokens"):
        stepper.restore(tmp_path / "s.kvsnap", [5] + ids[1:], 32)


def test_only_a_dynamic_cache_is_run(tiny_llama):
    from flashmemory.errors import ConfigError
    from flashmemory.tools.bench.hf_decode_stepper import TransformersStepper

    with pytest.raises(ConfigError, match="DynamicCache only"):
        TransformersStepper({"gguf_path": str(tiny_llama), "threads": 1, "settings": {"cache": "static"}}, 64)
