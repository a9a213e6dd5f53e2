"""Speculative decoding through the engine: greedy output is the target's own, token for token,
with prompt lookup and with a draft model, on both caches; what verification forgot leaves the
target's KV as plain decoding leaves it; a failing draft falls back; bad settings say the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashmemory import FlashMemoryEngine
from flashmemory.engine.sequence import Sequence
from flashmemory.errors import ConfigError, MemoryBudgetError
from tests.helpers import CORPUS, write_tiny_model

# Blocks of 8 tokens, two each on L0 and L1, the rest on L2: the answers below reach every level.
TIERED = dict(block_size=8, active_window=16, warm_tokens=16, prefill_chunk_tokens=24,
              recent_fp16_tokens=8)
# The drafts these tests check are drafted at every step: a tiny model's measured step costs
# would pause drafting at random (speculative_cost_aware, tested in test_step_costs.py).
EVERY_STEP = dict(speculative_cost_aware=False)
CACHES = {
    # float32 with GGUF blocks (q8_0): the native GEMV and attention, each row the same bits
    "tiered-q8": dict(TIERED, weights_dtype="q8_0", **EVERY_STEP),
    # dense float64: torch's kernels, whose few-row products differ from one row only at 1e-16
    "tiered-f64": dict(TIERED, dtype="float64", **EVERY_STEP),
    "contiguous-q8": dict(kv_cache="contiguous", weights_dtype="q8_0", **EVERY_STEP),
}
# Repetitive prompts, so prompt lookup finds matches and the answers quote them.
PROMPTS = ["one two three four five six seven one two three four five six seven one two",
           "Alice was beginning to get very tired of sitting by her sister on the bank, Alice was",
           "the the the the the the the the"]


def _near_copy(source: Path, folder: Path, scale: float) -> None:
    """The source model with its last layer's output projections scaled: a draft that agrees
    with it often, not always."""
    shutil.copytree(source, folder)
    weights = load_file(folder / "model.safetensors")
    last = max(int(name.split(".")[2]) for name in weights if name.startswith("model.layers."))
    for part in ("self_attn.o_proj", "mlp.down_proj"):
        name = f"model.layers.{last}.{part}.weight"
        weights[name] = weights[name] * scale
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    write_tiny_model(root / "target", num_hidden_layers=3, seed=0)
    write_tiny_model(root / "draft", num_hidden_layers=2, seed=1)  # another model, same tokenizer
    _near_copy(root / "target", root / "near", 0.6)
    write_tiny_model(root / "big", num_hidden_layers=4, seed=2)
    return root


def _greedy(engine: FlashMemoryEngine, prompt: str, n: int = 48) -> list[int]:
    return engine.generate_token_ids(prompt, max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_answers(models, tmp_path_factory):
    """Per cache, the target's own greedy answers (computed once)."""
    answers = {}
    for name, settings in CACHES.items():
        engine = FlashMemoryEngine(str(models / "target"), max_seq_len=256,
                                   cold_zone_dir=str(tmp_path_factory.mktemp(name)), **settings)
        answers[name] = [_greedy(engine, prompt) for prompt in PROMPTS]
        engine.close()
    return answers


# Every drafter on the native path; the other two caches with one drafter each.
CASES = [("tiered-q8", d) for d in ("ngram", "draft-self", "draft-near", "draft-other")] + [
    ("tiered-f64", "draft-near"), ("contiguous-q8", "draft-near"), ("contiguous-q8", "ngram")]


@pytest.mark.parametrize(("cache", "drafter"), CASES)
def test_greedy_output_is_the_targets_own(models, plain_answers, cache, drafter, tmp_path):
    settings = dict(CACHES[cache], max_seq_len=256, cold_zone_dir=str(tmp_path))
    spec_settings = {"ngram": dict(speculative_method="ngram", prompt_lookup_min=1),
                     "draft-self": dict(draft_model_path=str(models / "target")),
                     "draft-near": dict(draft_model_path=str(models / "near")),
                     "draft-other": dict(draft_model_path=str(models / "draft"))}[drafter]
    spec = FlashMemoryEngine(str(models / "target"), num_speculative_tokens=5, **settings,
                             **spec_settings)
    for prompt, expected in zip(PROMPTS, plain_answers[cache]):
        assert _greedy(spec, prompt) == expected, prompt
    stats = spec.speculator.stats
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_fallbacks == 0
    if drafter == "draft-self":  # the target drafting for itself: every draft kept
        assert stats.spec_decode_accepted_tokens == stats.spec_decode_draft_tokens
    assert spec.cache.sequence_ids() == []
    assert getattr(spec.speculator.proposer, "_states", {}) == {}  # nothing of a draft left
    spec.close()


def _tables(owner) -> list:
    """The KV of an engine (or a draft) as plain decoding and verification must both leave it:
    each level's used slots and their bytes, the prefix cache's named blocks."""
    cache = owner.cache
    out: list = [{level: a.num_used for level, a in cache.blocks.allocators.items()}]
    for name, block in sorted(cache.prefix_cache.index.items()):
        out.append((name, dict(block.slots)))
        out += [cache.levels[level].read_block(slot) for level, slot in sorted(block.slots.items())]
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_verification_leaves_the_targets_kv_as_plain_decoding_does(models, tmp_path):
    settings = dict(CACHES["tiered-q8"], max_seq_len=256)
    plain = FlashMemoryEngine(str(models / "target"), cold_zone_dir=str(tmp_path / "a"), **settings)
    spec = FlashMemoryEngine(str(models / "target"), cold_zone_dir=str(tmp_path / "b"),
                             draft_model_path=str(models / "near"), **settings)
    assert _greedy(spec, PROMPTS[1], 60) == _greedy(plain, PROMPTS[1], 60)
    stats = spec.speculator.stats
    assert stats.spec_decode_draft_tokens > stats.spec_decode_accepted_tokens > 0
    assert _same(_tables(spec), _tables(plain))  # every level, slot for slot, byte for byte
    assert spec.stats()["prefix_cache_blocks"] == plain.stats()["prefix_cache_blocks"] > 0
    spec.close(), plain.close()


def test_a_draft_that_fails_mid_request_falls_back_to_plain_decoding(models, tmp_path, monkeypatch):
    settings = dict(CACHES["tiered-q8"], max_seq_len=256, cold_zone_dir=str(tmp_path))
    plain = FlashMemoryEngine(str(models / "target"), **settings)
    spec = FlashMemoryEngine(str(models / "target"), draft_model_path=str(models / "draft"),
                             **settings)
    proposer = spec.speculator.proposer
    calls = {"n": 0}
    real = proposer._forward

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("draft device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(proposer, "_forward", flaky)
    assert _greedy(spec, PROMPTS[1]) == _greedy(plain, PROMPTS[1])
    assert spec.speculator.stats.spec_decode_fallbacks == 1
    assert proposer._states == {} and proposer.cache.sequence_ids() == []  # its KV freed
    spec.close(), plain.close()


def test_drafting_pauses_where_the_measured_costs_say_it_is_slower(models, tmp_path):
    """With speculative_cost_aware (the default), a draft that costs far more than it could ever
    save drafts nothing at all (not even probes); the output stays the target's own."""
    settings = dict(CACHES["tiered-q8"], max_seq_len=256, cold_zone_dir=str(tmp_path),
                    speculative_cost_aware=True)
    plain = FlashMemoryEngine(str(models / "target"), **settings)
    spec = FlashMemoryEngine(str(models / "target"), draft_model_path=str(models / "near"),
                             **settings)
    costs = spec.speculator.costs
    costs.observe_plain(0.001)
    costs.observe_drafting(100.0, 1)  # as if each draft took 100 s
    assert _greedy(spec, PROMPTS[1], 48) == _greedy(plain, PROMPTS[1], 48)
    stats = spec.speculator.stats
    assert stats.spec_decode_num_drafts == 0
    assert stats.spec_decode_paused_steps >= 40  # every decode step (but where a block ends)
    spec.close(), plain.close()


def test_sampled_output_keeps_the_targets_distribution(models, tmp_path):
    """The second token of each answer comes from a verification: over many seeds its
    frequencies must match the plain engine's (a chi-square test on the common tokens)."""
    settings = dict(CACHES["tiered-q8"], max_seq_len=128, cold_zone_dir=str(tmp_path))
    plain = FlashMemoryEngine(str(models / "target"), **settings)
    spec = FlashMemoryEngine(str(models / "target"), draft_model_path=str(models / "draft"),
                             **settings)
    n = 300
    prompt = "one two three four"

    def second_tokens(engine):
        return [engine.generate_token_ids(prompt, max_new_tokens=3, ignore_eos=True,
                                          temperature=1.0, seed=s)[1] for s in range(n)]

    a, b = torch.tensor(second_tokens(plain)), torch.tensor(second_tokens(spec))
    assert spec.speculator.stats.spec_decode_num_drafts == n
    vocab = int(max(a.max(), b.max())) + 1
    ca, cb = torch.bincount(a, minlength=vocab).float(), torch.bincount(b, minlength=vocab).float()
    common = (ca + cb) >= 20  # cells big enough for the test; the rest pooled
    ca = torch.cat([ca[common], ca[~common].sum()[None]])
    cb = torch.cat([cb[common], cb[~common].sum()[None]])
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    # Two-sample chi-square; the 0.001 critical value for df degrees of freedom, at most ~3 df.
    chi2 = float(((ca - cb) ** 2 / (ca + cb)).sum())
    df = len(ca) - 1
    assert chi2 < 10.8 + 3.1 * (df - 1), (df, chi2)
    spec.close(), plain.close()


def test_bad_speculative_settings_say_the_fix(models, tmp_path):
    target = str(models / "target")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        FlashMemoryEngine(target, speculative_method="ngram", num_speculative_tokens=8)
    with pytest.raises(ConfigError, match="needs draft_model_path"):
        FlashMemoryEngine(target, speculative_method="draft")
    with pytest.raises(ConfigError, match="does not use it"):
        FlashMemoryEngine(target, speculative_method="ngram", draft_model_path=target)
    with pytest.raises(ConfigError, match="larger than the target"):
        FlashMemoryEngine(target, draft_model_path=str(models / "big"), cold_zone_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="prompt_lookup_min=5 is greater"):
        FlashMemoryEngine(target, speculative_method="ngram", prompt_lookup_min=5)


def _permuted_twin(source: Path, folder: Path, seed: int = 5) -> None:
    """The source model under other ids: its tokenizer's text tokens renumbered, its embedding
    and output rows moved with them; the control tokens keep theirs. The same model, another
    vocabulary."""
    shutil.copytree(source, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    fixed = {a["id"] for a in spec["added_tokens"]}
    movable = sorted(i for i in vocab.values() if i not in fixed)
    order = torch.randperm(len(movable), generator=torch.Generator().manual_seed(seed)).tolist()
    new_id = dict(zip(movable, [movable[k] for k in order]))
    spec["model"]["vocab"] = {t: new_id.get(i, i) for t, i in vocab.items()}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    weights = load_file(folder / "model.safetensors")
    rows = torch.arange(len(vocab))
    rows[torch.tensor(list(new_id.values()))] = torch.tensor(list(new_id.keys()))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][rows].contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def bridged(tmp_path_factory):
    """A target; a draft whose tokenizer was trained on other text (other tokens, other ids); a
    byte-vocabulary target (no merges: every reading of a text is its reading) and its twin
    under permuted ids."""
    root = tmp_path_factory.mktemp("bridged")
    other_text = CORPUS.upper() + " ".join(reversed(CORPUS.split()[:20]))
    write_tiny_model(root / "target", num_hidden_layers=3, seed=0)
    write_tiny_model(root / "other", num_hidden_layers=2, seed=1, tokenizer_size=360,
                     tokenizer_corpus=other_text)
    write_tiny_model(root / "bytes", num_hidden_layers=2, seed=4, tokenizer_size=259)
    _permuted_twin(root / "bytes", root / "twin")
    return root


@pytest.mark.parametrize("cache", ["tiered-q8", "contiguous-q8"])
def test_a_draft_with_another_tokenizer_drafts_through_the_bridge(bridged, cache, tmp_path):
    settings = dict(CACHES[cache], max_seq_len=256)
    plain = FlashMemoryEngine(str(bridged / "target"), cold_zone_dir=str(tmp_path / "a"),
                              **settings)
    spec = FlashMemoryEngine(str(bridged / "target"), cold_zone_dir=str(tmp_path / "b"),
                             draft_model_path=str(bridged / "other"), num_speculative_tokens=4,
                             **settings)
    assert spec.speculator.proposer.bridges is not None
    for prompt in [*PROMPTS, "Caf\u00e9 na\u00efve \u4f60\u597d \U0001f600 and 0123"]:
        assert _greedy(spec, prompt, 40) == _greedy(plain, prompt, 40), prompt
    stats = spec.speculator.stats
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_fallbacks == 0
    assert spec.speculator.proposer._states == {} and spec.cache.sequence_ids() == []
    spec.close(), plain.close()


def test_the_bridge_loses_nothing_where_both_vocabularies_spell_the_same(bridged, tmp_path):
    """The byte-vocabulary model drafting for itself under other ids: every draft is kept, so
    every token went through the bridge and back unchanged, text and control tokens alike."""
    settings = dict(CACHES["tiered-q8"], max_seq_len=256)
    plain = FlashMemoryEngine(str(bridged / "bytes"), cold_zone_dir=str(tmp_path / "a"),
                              **settings)
    spec = FlashMemoryEngine(str(bridged / "bytes"), cold_zone_dir=str(tmp_path / "b"),
                             draft_model_path=str(bridged / "twin"), num_speculative_tokens=5,
                             speculative_adaptive=False, **settings)
    chat = [{"role": "user", "content": "Caf\u00e9 \u4f60\u597d, tell me about Paris."}]
    prompts = [PROMPTS[1], plain.tokenizer.apply_chat_template(chat)]
    for prompt in prompts:
        got = spec.generate_token_ids(prompt, max_new_tokens=48, ignore_eos=True)
        assert got == plain.generate_token_ids(prompt, max_new_tokens=48, ignore_eos=True)
    stats = spec.speculator.stats
    assert stats.spec_decode_draft_tokens > 40
    assert stats.spec_decode_accepted_tokens == stats.spec_decode_draft_tokens
    spec.close(), plain.close()


def test_rollback_leaves_the_drafts_kv_as_reading_only_the_kept_tokens_does(models, tmp_path,
                                                                             monkeypatch):
    """The draft's cache after drafts were rejected and forgotten equals, level by level and
    byte for byte, a fresh draft cache that read the same tokens and never drafted."""
    settings = dict(CACHES["tiered-q8"], max_seq_len=256, draft_model_path=str(models / "near"))
    spec = FlashMemoryEngine(str(models / "target"), cold_zone_dir=str(tmp_path / "a"),
                             **settings)
    proposer = spec.speculator.proposer
    held: dict = {}
    release = proposer.release

    def keep_then_release(seq_id: int) -> None:
        if seq_id in proposer._states:
            held["read"] = list(proposer._states[seq_id].read)
        release(seq_id)

    monkeypatch.setattr(proposer, "release", keep_then_release)
    prompt = spec.tokenizer.encode(PROMPTS[1])
    _greedy(spec, prompt, 60)
    stats = spec.speculator.stats
    assert stats.spec_decode_draft_tokens > stats.spec_decode_accepted_tokens > 0

    fresh = FlashMemoryEngine(str(models / "target"), cold_zone_dir=str(tmp_path / "b"),
                              **settings)
    never = fresh.speculator.proposer
    seq = Sequence(0, prompt, max_tokens=100)
    seq.output_ids = held["read"][len(prompt):]
    while never._states.get(0) is None or len(never._states[0].read) < len(prompt):
        never.follow(seq, len(prompt))
    state = never._states[0]
    never._read_target(state, seq, seq.num_tokens)
    never._catch_up(seq, state)  # the kept tokens as decode steps, no drafts
    assert state.read == held["read"]
    never.release(0)
    assert _same(_tables(proposer), _tables(never))  # every level, slot for slot, byte for byte
    spec.close(), fresh.close()


def test_both_models_kv_share_each_budget(models, tmp_path):
    """cpu_memory_gb and cold_zone_gb hold both caches (split by KV bytes per token); under
    max_gpu_memory_mb the draft takes what its decode needs, the target sizes L0 from the
    rest."""
    from flashmemory.engine.sizing import GIB, MIB

    settings = dict(TIERED, max_seq_len=256, cold_zone_dir=str(tmp_path), cpu_memory_gb=0.01,
                    cold_zone_gb=0.02, max_gpu_memory_mb=40)
    alone = FlashMemoryEngine(str(models / "target"), **settings)
    spec = FlashMemoryEngine(str(models / "target"), draft_model_path=str(models / "near"),
                             **settings)
    split = spec.budget_split
    caches = [spec.cache, spec.speculator.proposer.cache]
    host = sum(c.host_pool.capacity_bytes for c in caches)
    assert host <= 0.01 * GIB and split.target.cpu_memory_gb + split.draft.cpu_memory_gb == \
        pytest.approx(0.01)
    assert split.target.cold_zone_gb + split.draft.cold_zone_gb == pytest.approx(0.02)
    assert split.target.max_gpu_memory_mb + split.draft_device_mb == 40
    assert spec.cache.cfg.device_slots < alone.cache.cfg.device_slots  # L0 gave room to the draft
    assert spec.config.cpu_memory_gb == 0.01  # the user's settings read as given
    plan = spec.device_plan
    used = plan.weights_bytes + plan.device_slots * plan.slot_bytes
    assert used + split.draft_device_mb * MIB <= 40 * MIB
    spec.close(), alone.close()


def test_a_device_budget_too_small_for_both_models_names_the_draft(models, tmp_path):
    with pytest.raises(MemoryBudgetError, match="draft model"):
        FlashMemoryEngine(str(models / "target"), draft_model_path=str(models / "near"),
                          max_seq_len=256, cold_zone_dir=str(tmp_path), max_gpu_memory_mb=2)
