"""KV snapshots: a prompt restored from a snapshot decodes as a freshly prefilled one (exact cache, and a tiered
FP16 cache without selection), and a snapshot of another model, other tokens or a cut-short file is refused."""

from __future__ import annotations

import pytest
import torch

from flashmemory import FlashMemoryEngine
from flashmemory.engine.kv_snapshot import engine_fingerprint, model_fingerprint
from flashmemory.errors import KVSnapshotError
from flashmemory.kvcache.snapshot import KVSnapshot, load_snapshot, read_header, save_snapshot

EXACT = {"kv_cache": "contiguous", "kv_precision": "fp16", "prefill_chunk_tokens": 16}
# FP16 everywhere, every block read: what it computes is what the exact cache computes.
TIERED_EXACT = {"kv_cache": "tiered", "kv_precision": "fp16", "selection": "exact", "block_size": 8,
                "active_window": 32, "warm_tokens": 4096, "prefill_chunk_tokens": 16}


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def engine(tiny_llama):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **EXACT)
    yield engine
    engine.close()


def test_restored_prompt_decodes_as_a_fresh_prefill_exact_cache(engine, tmp_path):
    ids, path = _ids(90), tmp_path / "p.kvsnap"
    fresh = engine.score_tokens(ids, num_teacher_forced=12)
    saved = engine.score_tokens(ids, num_teacher_forced=12, kv_snapshot=path)  # no file yet: prefills, saves
    assert path.exists() and saved.num_restored_tokens == 0
    assert torch.equal(saved.decode_logprobs, fresh.decode_logprobs)
    restored = engine.score_tokens(ids, num_teacher_forced=12, kv_snapshot=path)
    # 78 prefill tokens in chunks of 16: the first 64 restored, the last chunk [64, 78) computed.
    assert restored.num_restored_tokens == 64 and restored.token_logprobs.shape == (89 - 64,)
    assert (restored.decode_logprobs - fresh.decode_logprobs).abs().max().item() <= 1e-5
    assert restored.snapshot_notes["prefill_ppl"] > 1
    assert engine.cache.sequence_ids() == []


def test_restored_prompt_in_tiered_fp16_cache_matches_exact(engine, tmp_path):
    ids, path = _ids(90, seed=1), tmp_path / "p.kvsnap"
    exact = engine.score_tokens(ids, num_teacher_forced=12, kv_snapshot=path)
    engine.reconfigure_kv(**TIERED_EXACT)
    restored = engine.score_tokens(ids, num_teacher_forced=12, kv_snapshot=path)
    assert restored.num_restored_tokens == 64
    assert restored.kv_stats["L1_blocks"] > 0 and restored.kv_stats["L0_blocks"] > 0
    assert (restored.decode_logprobs - exact.decode_logprobs).abs().max().item() <= 1e-4


def test_restore_writes_the_levels_a_prefill_writes(engine, tmp_path):
    ids, path = _ids(90, seed=2), tmp_path / "p.kvsnap"
    engine.score_tokens(ids, num_teacher_forced=12, kv_snapshot=path)
    knobs = {"kv_cache": "tiered", "block_size": 8, "active_window": 16, "warm_tokens": 16, "prefill_chunk_tokens": 16}
    engine.reconfigure_kv(**knobs)
    fresh = engine.score_tokens(ids, num_teacher_forced=12).kv_stats
    engine.reconfigure_kv(**knobs)
    restored = engine.score_tokens(ids, num_teacher_forced=12, kv_snapshot=path).kv_stats
    for key in ("L0_blocks", "L1_blocks", "L2_blocks", "bytes_moved_L1->L2"):
        assert restored[key] == fresh[key], key


def test_snapshot_of_other_tokens_is_refused(engine, tmp_path):
    path = tmp_path / "p.kvsnap"
    engine.score_tokens(_ids(90), num_teacher_forced=12, kv_snapshot=path)
    other = _ids(90)
    other[40] = (other[40] + 1) % 300
    with pytest.raises(KVSnapshotError, match="other tokens.*position 40.*delete"):
        engine.score_tokens(other, num_teacher_forced=12, kv_snapshot=path)


def test_snapshot_of_another_model_is_refused(engine, tmp_path):
    path = tmp_path / "p.kvsnap"
    ids = _ids(90)
    engine.score_tokens(ids, num_teacher_forced=12, kv_snapshot=path)
    wrong = dict(engine_fingerprint(engine), model_bytes=1)
    with pytest.raises(KVSnapshotError, match="another model or settings.*model_bytes.*delete"):
        load_snapshot(path, wrong, ids)


def test_fingerprint_changes_with_the_weights(tiny_llama, tmp_path):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **EXACT)
    first = engine_fingerprint(engine)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in tiny_llama.iterdir():
        data = bytearray(f.read_bytes())
        if f.suffix == ".safetensors":
            data[-1] ^= 0xFF  # one byte of the last tensor
        (copy / f.name).write_bytes(bytes(data))
    changed = model_fingerprint(copy, engine.model_config, engine.dtype, engine.config.weights_dtype)
    assert changed["model_ends_sha256"] != first["model_ends_sha256"]
    assert model_fingerprint(copy, engine.model_config, torch.bfloat16, "auto")["dtype"] == "bfloat16"


def test_q8_0_through_torchao_is_not_the_cpus_q8_0(engine, monkeypatch):
    """weights_dtype="q8_0" is GGUF blocks on the CPU, torchao int8 on CUDA, and the CPU's blocks
    decode with int8 or float32 x: a snapshot of one is not another's."""
    from flashmemory.model.loader import weights_label

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert weights_label("q8_0", cpu, "float32") == "q8_0"
    assert weights_label("q8_0", cpu, "int8") == "q8_0 (int8 activations)"
    assert weights_label("auto", cpu, "auto") == "auto (int8 activations by format)"
    assert weights_label("q8_0", cuda, "float32") == "q8_0 (torchao)"
    assert weights_label("float32", cpu, "int8") == "float32"  # dense weights: no 8-bit GEMV
    monkeypatch.setattr(engine, "weights_label", "q8_0 (torchao)")
    assert engine_fingerprint(engine)["weights_dtype"] == "q8_0 (torchao)"


def test_truncated_snapshot_is_refused(engine, tmp_path):
    path = tmp_path / "p.kvsnap"
    ids = _ids(90)
    engine.score_tokens(ids, num_teacher_forced=12, kv_snapshot=path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(KVSnapshotError, match="truncated"):
        engine.score_tokens(ids, num_teacher_forced=12, kv_snapshot=path)
    path.write_bytes(data[:10])
    with pytest.raises(KVSnapshotError, match="truncated"):
        engine.score_tokens(ids, num_teacher_forced=12, kv_snapshot=path)


def test_corrupt_snapshot_payload_is_refused(tmp_path):
    path = tmp_path / "p.kvsnap"
    kv = torch.randn(2, 1, 4, 8).half()
    save_snapshot(path, KVSnapshot([5, 6, 7, 8], kv, kv.clone(), {"model": "m"}))
    assert read_header(path)["shape"] == [2, 1, 4, 8]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(KVSnapshotError, match="SHA-256"):
        load_snapshot(path, {"model": "m"}, [5, 6, 7, 8])


def test_longer_snapshot_serves_a_shorter_prompt(engine, tmp_path):
    path = tmp_path / "p.kvsnap"
    ids = _ids(90)
    engine.score_tokens(ids, num_teacher_forced=12, kv_snapshot=path)
    fresh = engine.score_tokens(ids[:60], num_teacher_forced=8)
    restored = engine.score_tokens(ids[:60], num_teacher_forced=8, kv_snapshot=path)
    assert restored.num_restored_tokens == 48
    assert (restored.decode_logprobs - fresh.decode_logprobs).abs().max().item() <= 1e-5


def test_tiered_cache_cannot_make_a_snapshot(tiny_llama, tmp_path):
    engine = FlashMemoryEngine(model_path=str(tiny_llama), **TIERED_EXACT)
    with pytest.raises(KVSnapshotError, match="exact cache"):
        engine.score_tokens(_ids(90), num_teacher_forced=12, kv_snapshot=tmp_path / "p.kvsnap")
    assert not (tmp_path / "p.kvsnap").exists()
    engine.close()
