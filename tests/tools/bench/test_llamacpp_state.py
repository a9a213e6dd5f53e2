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


def test_a_quantized_llama_cpp_cache_is_refused_with_the_fix():
    data = bytearray(encode_state(_state(True)).tobytes())
    k_type_at = 16 + 5 * 12 + 8  # header, 5 cells of meta, v_trans and n_layer
    data[k_type_at:k_type_at + 4] = (8).to_bytes(4, "little")  # GGML_TYPE_Q8_0
    with pytest.raises(KVSnapshotError, match="type_k = type_v = f16"):
        decode_state(bytes(data))


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
def qwen_llm():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed "
                                    "(bash scripts/install_llama_cpp.sh)")
    from flashmemory.errors import ModelNotFoundError
    from flashmemory.model.long_model import long_model_path

    try:
        path = long_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_TOKENS + 64, n_batch=512, n_threads=2, n_threads_batch=2,
                          flash_attn=False, logits_all=False, verbose=False)
    ids = llm.tokenize(b"def fibonacci(n):\n    " * 40, add_bos=False)[:N_TOKENS + DECODE_STEPS]
    yield path, llm, ids
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


def test_llama_cpps_own_state_is_reencoded_byte_for_byte_and_restores_its_logits(qwen_llm):
    from flashmemory.tools.bench.llamacpp_state import sequence_bytes

    _, llm, ids = qwen_llm
    llm.reset()
    llm.eval(ids[:N_TOKENS - 1])
    own = sequence_bytes(llm)
    state = decode_state(own)
    assert encode_state(state).tobytes() == own
    real = _decode(llm, ids)
    restore_into(llm, ids[:N_TOKENS - 1], _ours(state.keys, 2), _ours(state.values, 2))
    assert np.abs(_decode(llm, ids) - real).max() == 0.0


@pytest.mark.slow
def test_our_snapshot_restored_into_llama_cpp_decodes_as_its_own_prefill(qwen_llm, tmp_path):
    from flashmemory.engine.engine import FlashMemoryEngine
    from flashmemory.tools.bench.llamacpp_state import read_snapshot_kv

    path, llm, ids = qwen_llm
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
    restored = _decode(llm, ids)
    assert np.abs(restored - real).max() < LOGITS_ATOL
    assert (restored.argmax(1) == real.argmax(1)).all()
