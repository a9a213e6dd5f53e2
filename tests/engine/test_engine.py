"""FlashMemoryEngine's public API on a tiny random model: config errors, prompt limits, generate/stream/chat."""

from __future__ import annotations

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.errors import ConfigError, PromptTooLongError, SamplingParamsError


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return FlashMemoryEngine(model_path=str(tiny_llama), max_seq_len=128)


def test_unknown_engine_keyword_lists_the_valid_ones(tiny_llama):
    with pytest.raises(ConfigError) as e:
        FlashMemoryEngine(model_path=str(tiny_llama), max_gpu_memory=100)
    assert "max_gpu_memory" in str(e.value)
    for valid in ("model_path", "device", "dtype", "max_seq_len"):
        assert valid in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"dtype": "int3"}, "dtype"), ({"device": "tpu"}, "device"), ({"max_seq_len": 0}, "max_seq_len"),
     ({"num_threads": 0}, "num_threads")],
)
def test_invalid_engine_setting_is_rejected(tiny_llama, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        FlashMemoryEngine(model_path=str(tiny_llama), **kwargs)


def test_cuda_requested_without_cuda_says_so(tiny_llama):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        FlashMemoryEngine(model_path=str(tiny_llama), device="cuda")


def test_max_seq_len_above_the_model_limit_is_rejected(tiny_llama):
    with pytest.raises(ConfigError, match="greater than the model's maximum context length"):
        FlashMemoryEngine(model_path=str(tiny_llama), max_seq_len=100_000)


def test_prompt_longer_than_the_context_says_both_numbers(engine):
    with pytest.raises(PromptTooLongError) as e:
        engine.generate(list(range(3, 200)), max_new_tokens=5)
    msg = str(e.value)
    assert "maximum context length is 128 tokens" in msg and "197 in the prompt" in msg
    assert e.value.max_model_len == 128 and e.value.num_prompt_tokens == 197


def test_empty_prompt_and_out_of_vocabulary_ids_are_rejected(engine):
    with pytest.raises(ConfigError, match="empty"):
        engine.generate([])
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.generate([5, 10**6])


def test_invalid_sampling_value_is_rejected_before_generation(engine):
    with pytest.raises(SamplingParamsError, match="top_p"):
        engine.generate("hello", top_p=0.0)
    with pytest.raises(ConfigError, match="unknown sampling setting"):
        engine.generate("hello", temprature=0.5)
    assert engine.cache.sequence_ids() == []


def test_generation_stops_at_the_context_limit(engine):
    ids = engine.generate_token_ids(list(range(3, 123)), max_new_tokens=50, ignore_eos=True)
    assert len(ids) == 8  # 120 prompt tokens + 8 = max_seq_len 128
    assert engine.last_stats.finish_reason == "length"


def test_stream_pieces_join_to_generate_output(engine):
    pieces = list(engine.stream("Alice was", max_new_tokens=20, ignore_eos=True))
    assert "".join(pieces) == engine.generate("Alice was", max_new_tokens=20, ignore_eos=True)
    stats = engine.last_stats
    assert stats.num_generated_tokens == 20 and stats.num_prompt_tokens > 0 and stats.peak_memory_bytes > 0


def test_same_seed_same_text(engine):
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    assert engine.generate("The capital", **kw) == engine.generate("The capital", **kw)
    assert engine.generate("The capital", **kw) != engine.generate("The capital", **{**kw, "seed": 12})


def test_stop_string_ends_generation_and_is_not_returned(engine):
    full = engine.generate("Alice", max_new_tokens=30, ignore_eos=True)
    stop = full[5:8]
    assert len(stop) == 3
    out = engine.generate("Alice", max_new_tokens=30, ignore_eos=True, stop=[stop])
    assert out == full[: full.index(stop)]
    assert engine.last_stats.finish_reason == "stop"


def test_chat_applies_the_template(engine):
    messages = [{"role": "user", "content": "hi"}]
    ids = engine.tokenizer.apply_chat_template(messages)
    assert engine.tokenizer.hf.decode(ids).endswith("<|im_start|>assistant\n")
    assert engine.chat(messages, max_new_tokens=8, ignore_eos=True) == engine.generate(
        ids, max_new_tokens=8, ignore_eos=True
    )


def test_malformed_chat_message_is_rejected(engine):
    with pytest.raises(ConfigError, match="role"):
        engine.chat([{"content": "no role"}])


def test_no_sequence_is_left_in_the_cache(engine):
    stream = engine.stream("Alice", max_new_tokens=10, ignore_eos=True)
    next(stream)
    stream.close()  # an abandoned stream frees its KV
    assert engine.cache.sequence_ids() == []


def test_reconfigure_kv_starts_from_the_defaults_each_time(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama))
    engine.reconfigure_kv(active_window=64, warm_tokens=64)
    assert engine.config.active_window == 64
    engine.reconfigure_kv(kv_precision="int4")
    assert engine.config.active_window == 2048 and engine.config.kv_precision == "int4"
    with pytest.raises(ConfigError, match="unknown KV setting"):
        engine.reconfigure_kv(dtype="float16")


def test_block_size_auto_grows_with_the_context():
    from flashmemory.config import EngineConfig

    cfg = EngineConfig(block_size="auto")
    assert [cfg.resolve_block_size(n) for n in (2048, 8192, 32768, 131072)] == [16, 16, 32, 64]
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"kv_precision": "int3"}, "kv_precision"), ({"kv_cache": "paged"}, "kv_cache"),
     ({"selection": "random"}, "selection"), ({"semantic_truncate_threshold": 0}, "semantic_truncate_threshold"),
     ({"cpu_memory_gb": -1}, "cpu_memory_gb"), ({"active_window": 8, "block_size": 16}, "active_window"),
     ({"max_gpu_memory_mb": 0}, "max_gpu_memory_mb")],
)
def test_invalid_kv_setting_is_rejected_with_its_name(tiny_llama, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        FlashMemoryEngine(model_path=str(tiny_llama), **kwargs)


def test_sliding_window_model_asks_for_the_contiguous_cache(tmp_path):
    from tests.helpers import write_tiny_model

    write_tiny_model(tmp_path, "MistralForCausalLM", sliding_window=16)
    with pytest.raises(ConfigError, match="kv_cache='contiguous'"):
        FlashMemoryEngine(model_path=str(tmp_path))
    engine = FlashMemoryEngine(model_path=str(tmp_path), kv_cache="contiguous")
    assert engine.generate_token_ids("Alice", max_new_tokens=3, ignore_eos=True)
