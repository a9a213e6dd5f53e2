"""A FlashMemory KV snapshot as llama.cpp's sequence state: the byte layout (numpy only), then, where
llama-cpp-python and the 32K model (Qwen2.5-Coder-0.5B GGUF) are present, llama.cpp itself reading it back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashmemory.errors import KVSnapshotError
from flashmemory.tools.bench.llamacpp_state import (
    SequenceState,
    decode_state,
    encode_state,
    restore_into,
    to_llama_rows,
)
from tests.helpers import _llama_cpp_permute


def _state(v_trans: bool, num_layers: int = 3, num_cells: int = 5, width: int = 8) -> SequenceState:
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, num_layers, num_cells, width)).astype(np.float16)
    return SequenceState(np.arange(num_cells, dtype=np.int32), kv[0], kv[1], v_trans)


@pytest.mark.parametrize("v_trans", [True, False])
def test_a_state_round_trips_through_encode_and_decode(v_trans):
    state = _state(v_trans)
    back = decode_state(encode_state(state).tobytes())
    assert back.v_trans == v_trans and back.seq_id == 0
    assert np.array_equal(back.positions, state.positions)
    assert np.array_equal(back.keys, state.keys) and np.array_equal(back.values, state.values)


def test_llama_keys_are_permuted_as_the_gguf_converter_permutes_k_rows():
    """llama.cpp's llama-arch K rows come from q/k weights the converter permuted to interleaved pairs."""
    heads, head_dim = 2, 8
    k = torch.randn(heads * head_dim)
    ours = k.reshape(1, heads, 1, head_dim).numpy()  # [num_layers, num_kv_heads, num_tokens, head_dim]
    converted = _llama_cpp_permute(k[:, None], heads)[:, 0].numpy().astype(np.float16)
    assert np.array_equal(to_llama_rows(ours, rope_interleaved=True).reshape(-1), converted)
    assert np.array_equal(to_llama_rows(ours, rope_interleaved=False).reshape(-1), k.numpy().astype(np.float16))


def test_a_cache_type_other_than_f16_or_q8_0_is_refused_with_the_fix():
    data = bytearray(encode_state(_state(True)).tobytes())
    k_type_at = 16 + 5 * 12 + 8  # header, 5 cells of meta, v_trans and n_layer
    data[k_type_at:k_type_at + 4] = (2).to_bytes(4, "little")  # GGML_TYPE_Q4_0
    with pytest.raises(KVSnapshotError, match="type_k = type_v = f16, or q8_0 with flash attention"):
        decode_state(bytes(data))


def test_a_q8_0_state_round_trips_through_encode_and_decode():
    from flashmemory.tools.bench.ggml_rows import quantize_q8_0

    f16 = _state(False, width=64)
    state = SequenceState(f16.positions, quantize_q8_0(f16.keys), quantize_q8_0(f16.values), v_trans=False)
    data = encode_state(state).tobytes()
    assert len(data) == 16 + 5 * 12 + 8 + 3 * 2 * (12 + 5 * 68)  # 68 bytes a row: two 34-byte blocks
    back = decode_state(data)
    assert back.keys.dtype == state.keys.dtype and not back.v_trans
    assert back.keys.tobytes() == state.keys.tobytes() and back.values.tobytes() == state.values.tobytes()
    assert encode_state(back).tobytes() == data


def test_a_transposed_q8_0_value_cache_is_refused():
    from flashmemory.tools.bench.ggml_rows import quantize_q8_0

    f16 = _state(True, width=32)
    with pytest.raises(KVSnapshotError, match="flash attention"):
        encode_state(SequenceState(f16.positions, quantize_q8_0(f16.keys), quantize_q8_0(f16.values), True))


def test_restoring_into_an_unsupported_architecture_is_refused():
    class Gemma:
        metadata = {"general.architecture": "gemma3"}

    kv = np.zeros((1, 1, 2, 4), dtype=np.float16)
    with pytest.raises(KVSnapshotError, match="not 'gemma3'"):
        restore_into(Gemma(), [1, 2], kv, kv)


def _snapshot(path, num_tokens: int = 6, dtype: torch.dtype = torch.float16):
    from flashmemory.kvcache.snapshot import KVSnapshot, save_snapshot

    kv = torch.randn(2, 2, 1, num_tokens, 4).to(dtype)  # [k/v, num_layers, num_kv_heads, num_tokens, head_dim]
    save_snapshot(path, KVSnapshot(list(range(10, 10 + num_tokens)), kv[0], kv[1], {"model": "m"}))
    return kv


def test_a_snapshots_first_tokens_are_read_without_torch_in_our_layout(tmp_path):
    from flashmemory.tools.bench.llamacpp_state import read_snapshot_kv

    kv = _snapshot(tmp_path / "s.kvsnap")
    ids, keys, values = read_snapshot_kv(tmp_path / "s.kvsnap", 4)
    assert ids == [10, 11, 12, 13]
    assert np.array_equal(keys, kv[0, :, :, :4].numpy()) and np.array_equal(values, kv[1, :, :, :4].numpy())
    assert read_snapshot_kv(tmp_path / "s.kvsnap", 4, expected_ids=[10, 11, 12, 13])[0] == ids
    with pytest.raises(KVSnapshotError, match="other tokens than the benchmark's; pass the --text"):
        read_snapshot_kv(tmp_path / "s.kvsnap", 4, expected_ids=[10, 11, 12, 99])


def test_a_snapshot_too_short_or_not_fp16_or_not_a_snapshot_is_refused(tmp_path):
    from flashmemory.tools.bench.llamacpp_state import read_snapshot_kv

    _snapshot(tmp_path / "s.kvsnap")
    with pytest.raises(KVSnapshotError, match="ask for at most 6"):
        read_snapshot_kv(tmp_path / "s.kvsnap", 7)
    _snapshot(tmp_path / "f32.kvsnap", dtype=torch.float32)
    with pytest.raises(KVSnapshotError, match="FP16 snapshot only"):
        read_snapshot_kv(tmp_path / "f32.kvsnap", 2)
    (tmp_path / "other").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(KVSnapshotError, match="not a FlashMemory KV snapshot"):
        read_snapshot_kv(tmp_path / "other", 2)


# --- llama.cpp itself (llama-cpp-python 0.3.36) on the 32K model ----------------------------------------------

N_TOKENS = 96  # restored: the first N_TOKENS - 1; the last one and DECODE_STEPS more are decoded
DECODE_STEPS = 4
# Max |logit difference| allowed between llama.cpp decoding from our restored KV and from its own prefill. Measured
# here (Qwen2.5-Coder-0.5B Q4_K_M, 8 steps): 0.37-0.46 at 512 and 2,048 tokens over four runs, the size of the gap
# between the two engines' own outputs (our float32 KV vs llama.cpp's, whose q4_K matmuls quantize activations to
# 8 bits); restoring llama.cpp's own KV through the same path gives 0.0. A wrong layout is far above: keys in the
# interleaved (llama) order on qwen2 move logits by 13-17 and change most top-1s
# (docs/long/llamacpp_restore_check.log).
LOGITS_ATOL = 1.5


@pytest.fixture(scope="module")
def qwen_llm(qwen_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed "
                                    "(bash scripts/install_llama_cpp.sh)")
    llm = llama_cpp.Llama(model_path=str(qwen_path), n_ctx=N_TOKENS + 64, n_batch=512, n_threads=2, n_threads_batch=2,
                          flash_attn=False, logits_all=False, verbose=False)
    ids = llm.tokenize(b"def fibonacci(n):\n    " * 40, add_bos=False)[:N_TOKENS + DECODE_STEPS]
    yield qwen_path, llm, ids
    llm.close()


def _decode(llm, ids: list[int]) -> np.ndarray:
    """Logits of teacher-forced steps from position N_TOKENS - 1 on, [DECODE_STEPS + 1, vocab]."""
    import llama_cpp

    rows = []
    for pos in range(N_TOKENS - 1, len(ids)):
        llm.eval([ids[pos]])
        rows.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy())
    return np.stack(rows)


def _ours(state: SequenceState, heads: int) -> np.ndarray:
    """llama.cpp's K or V rows back in our layout [num_layers, num_kv_heads, num_tokens, head_dim] (qwen2)."""
    num_layers, num_cells, width = state.shape
    return state.reshape(num_layers, num_cells, heads, width // heads).transpose(0, 2, 1, 3)


def _own_state(llm, ids: list[int]) -> tuple[bytes, SequenceState]:
    """llama.cpp's own sequence state after prefilling the first N_TOKENS - 1 ids: its bytes and their decoding."""
    from flashmemory.tools.bench.llamacpp_state import sequence_bytes

    llm.reset()
    llm.eval(ids[:N_TOKENS - 1])
    own = sequence_bytes(llm)
    return own, decode_state(own)


def test_llama_cpps_own_state_is_reencoded_byte_for_byte_and_restores_its_logits(qwen_llm):
    _, llm, ids = qwen_llm
    own, state = _own_state(llm, ids)
    assert encode_state(state).tobytes() == own
    real = _decode(llm, ids)
    restore_into(llm, ids[:N_TOKENS - 1], _ours(state.keys, 2), _ours(state.values, 2))
    assert np.abs(_decode(llm, ids) - real).max() == 0.0


def _our_snapshot_against_its_prefill(path, llm, ids: list[int], tmp_path) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's logits over the next steps from its own prefill, then from our exact engine's snapshot of the
    same tokens restored into it: (real, restored)."""
    from flashmemory.engine.engine import FlashMemoryEngine
    from flashmemory.tools.bench.llamacpp_state import read_snapshot_kv

    engine = FlashMemoryEngine(model_path=str(path), kv_cache="contiguous", kv_precision="fp16", num_threads=2)
    try:
        engine.score_tokens(ids[:N_TOKENS], num_teacher_forced=1, kv_snapshot=tmp_path / "s.kvsnap")
    finally:
        engine.close()
    snap_ids, keys, values = read_snapshot_kv(tmp_path / "s.kvsnap", N_TOKENS - 1)
    assert snap_ids == ids[:N_TOKENS - 1]
    llm.reset()
    llm.eval(ids[:N_TOKENS - 1])
    real = _decode(llm, ids)
    restore_into(llm, snap_ids, keys, values)
    return real, _decode(llm, ids)


@pytest.mark.slow
def test_our_snapshot_restored_into_llama_cpp_decodes_as_its_own_prefill(qwen_llm, tmp_path):
    real, restored = _our_snapshot_against_its_prefill(*qwen_llm, tmp_path)
    assert np.abs(restored - real).max() < LOGITS_ATOL
    assert (restored.argmax(1) == real.argmax(1)).all()


# --- llama.cpp's q8_0 cache (flash attention on, as llama.cpp requires for a quantized V) ---------------------

# Max |logit difference| between llama.cpp decoding from our KV restored as q8_0 and from its own q8_0 prefill.
# Measured (512 tokens, 8 steps): 0.70, the size of the two engines' own gap (0.71); without llama.cpp's Hadamard
# rotation of quantized K and V the same restore moved logits by 17.9 and changed every top-1
# (docs/long/llamacpp_restore_check_q8_0.log).
Q8_0_LOGITS_ATOL = 1.5


@pytest.fixture(scope="module")
def qwen_llm_q8_0(qwen_llm):
    import llama_cpp

    path, _, ids = qwen_llm
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_TOKENS + 64, n_batch=512, n_threads=2, n_threads_batch=2,
                          type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q8_0, flash_attn=True,
                          logits_all=False, verbose=False)
    yield path, llm, ids
    llm.close()


def test_llama_cpps_own_q8_0_state_is_reencoded_byte_for_byte_and_restores_its_logits(qwen_llm_q8_0):
    from flashmemory.tools.bench.ggml_rows import Q8_0_BLOCK
    from flashmemory.tools.bench.llamacpp_state import write_state

    _, llm, ids = qwen_llm_q8_0
    own, state = _own_state(llm, ids)
    assert state.keys.dtype == Q8_0_BLOCK and state.values.dtype == Q8_0_BLOCK and not state.v_trans
    assert state.keys.shape == (24, N_TOKENS - 1, 128 // 32)
    assert encode_state(state).tobytes() == own
    real = _decode(llm, ids)
    write_state(llm, state, ids[:N_TOKENS - 1])
    assert np.abs(_decode(llm, ids) - real).max() == 0.0


@pytest.mark.slow
def test_our_snapshot_restored_into_a_q8_0_cache_decodes_as_its_own_prefill(qwen_llm_q8_0, tmp_path):
    real, restored = _our_snapshot_against_its_prefill(*qwen_llm_q8_0, tmp_path)
    assert np.abs(restored - real).max() < Q8_0_LOGITS_ATOL
    assert (restored.argmax(1) == real.argmax(1)).all()


def test_llama_cpps_hadamard_rotation_is_its_own_inverse_and_sized_as_llama_cpp_sizes_it():
    from flashmemory.tools.bench.ggml_rows import GGML_TYPE_F16, GGML_TYPE_Q8_0
    from flashmemory.tools.bench.llamacpp_state import hadamard, rotation_sizes

    h = hadamard(64)
    assert np.allclose(h @ h, np.eye(64), atol=1e-6) and np.array_equal(h, h.T) and h[0, 0] == np.float32(0.125)
    assert rotation_sizes(64, GGML_TYPE_Q8_0) == (64, 64) and rotation_sizes(128, GGML_TYPE_Q8_0) == (128, 64)
    assert rotation_sizes(64, GGML_TYPE_F16) == (0, 0) and rotation_sizes(80, GGML_TYPE_Q8_0) == (0, 0)


def test_rotated_q8_0_rows_dequantize_back_to_our_keys_through_the_same_rotation():
    from flashmemory.tools.bench.ggml_rows import GGML_TYPE_Q8_0, dequantize_q8_0
    from flashmemory.tools.bench.llamacpp_state import as_cache_rows, hadamard

    rng = np.random.default_rng(3)
    kv = rng.standard_normal((2, 2, 5, 64)).astype(np.float16)  # [num_layers, num_kv_heads, num_tokens, head_dim]
    rows = as_cache_rows(kv, GGML_TYPE_Q8_0, rope_interleaved=False, rotation=64)
    back = dequantize_q8_0(rows).reshape(2, 5, 2, 64) @ hadamard(64).T  # H is its own inverse
    assert np.abs(back.transpose(0, 2, 1, 3) - kv.astype(np.float32)).max() < 0.05
