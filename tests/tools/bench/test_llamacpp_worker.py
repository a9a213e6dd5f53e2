"""The llama.cpp adapter, driven through a stand-in `llama_cpp` module (the real one is an optional 15-min build)."""

from __future__ import annotations

import json
import sys

import pytest

from flashmemory.tools.bench import llamacpp_worker
from flashmemory.tools.bench.jobs import FidelityJob, SpeedJob
from flashmemory.tools.bench.kv_bytes import llama_cpp_kv_bytes
from tests.tools.bench import fake_llama_cpp


@pytest.fixture
def fake_llama(monkeypatch):
    fake_llama_cpp.created.clear()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp)
    return fake_llama_cpp


@pytest.fixture
def ids_path(tmp_path):
    ids = [(i * 13 + 5) % fake_llama_cpp.VOCAB for i in range(400)]
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(ids))
    return path, ids


def test_speed_decodes_greedily_and_counts_the_kv_cells_llama_cpp_allocates(fake_llama, ids_path):
    path, ids = ids_path
    job = SpeedJob("llamacpp-q8_0-fa", "llama.cpp", {"kv_type": "q8_0", "flash_attn": True}, "unused", "m.gguf",
                   str(path), prompt_tokens=100, decode_tokens=5, dtype="float32", num_threads=3)
    r = llamacpp_worker.measure_speed(job, model_layers=30, kv_width=192)
    llm = fake_llama.created[-1]
    assert llm.n_threads == 3 and r.num_threads == 3 and llm.closed
    assert llm.n_ctx() == 256  # 100 + 5 + slack, rounded up as llama.cpp does
    assert r.device_kv_bytes == llama_cpp_kv_bytes("q8_0", "q8_0", 256, 30, 192) == 256 * 30 * 2 * 6 * 34
    assert r.prompt_tokens == 100 and r.num_generated_tokens == 5
    # After the warm-up and reset: the prompt, then each greedy token fed back (the last one is not fed).
    assert llm.evaluated[:100] == ids[:100] and len(llm.evaluated) == 104
    assert llm.evaluated[100] == (ids[99] * 7 + 100) % fake_llama_cpp.VOCAB
    assert r.ttft_s > 0 and r.decode_tok_s > 0


def test_quantized_v_without_flash_attention_is_reported_with_the_reason(fake_llama, ids_path):
    path, _ = ids_path
    job = SpeedJob("llamacpp-q4_0", "llama.cpp", {"kv_type": "q4_0", "flash_attn": False}, "unused", "m.gguf",
                   str(path), prompt_tokens=50, decode_tokens=3, dtype="float32", num_threads=1)
    with pytest.raises(llamacpp_worker.LlamaCppError, match="needs flash attention for a quantized V cache"):
        llamacpp_worker.measure_speed(job, model_layers=2, kv_width=64)


def test_fidelity_is_measured_against_llama_cpp_own_f16_cache(fake_llama, ids_path):
    path, _ = ids_path
    engines = [("llamacpp-f16-fa", {"kv_type": "f16", "flash_attn": True}),
               ("llamacpp-q4_0", {"kv_type": "q4_0", "flash_attn": False}),
               ("llamacpp-q4_0-fa", {"kv_type": "q4_0", "flash_attn": True})]
    job = FidelityJob("llama.cpp", engines, "unused", "m.gguf", str(path), context_tokens=120,
                      teacher_forced_tokens=20, dtype="float32", num_threads=1, reference_path="unused")
    results = {r.engine: r for r in llamacpp_worker.measure_fidelity(job)}
    reference = fake_llama.created[0]
    assert reference.type_k == fake_llama_cpp.GGML_TYPE_F16
    assert abs(results["llamacpp-f16-fa"].mean_kl) < 1e-6 and results["llamacpp-f16-fa"].top1_agreement == 1.0
    assert "flash attention" in results["llamacpp-q4_0"].error
    q4 = results["llamacpp-q4_0-fa"]
    assert q4.error is None and q4.mean_kl > 1e-4 and q4.reference == "llamacpp-f16"
    assert q4.decode_ppl > 1
