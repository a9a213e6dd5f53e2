"""The shared layout: every trial of a length in one haystack, prefilled once per configuration (or
restored from
its snapshot) and reused by each question through the prefix cache; the new aggregation and record
tasks; the
probe that says where a needle was when the answer was decoded."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from flashmemory.errors import ConfigError
from flashmemory.kvcache.read.choice import LayerChoice
from flashmemory.tools.needles.prefill_once import HaystackPrefill, keep_knobs
from flashmemory.tools.needles.probe import NeedleProbe
from flashmemory.tools.needles.runner import BASELINE, BASELINE_KNOBS, run_config, run_suite
from flashmemory.tools.needles.shared import build_shared
from flashmemory.tools.needles.suite import SuiteSpec, build_trials
from flashmemory.tools.needles.tasks import (
    TALLY_REST,
    TALLY_TOP,
    TASKS,
    Draws,
    TrialBuilder,
    make_question,
)
from flashmemory.tools.needles.vocabulary import WORDS
from tests.helpers import write_tiny_model

TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do. "
    "Once or twice she had peeped into the book her sister was reading. "
) * 120
# 16 blocks of L0, then L1 read through selection (FP16: the tiny model's answers move only with
# what is read)
SELECTING = {
    "kv_cache": "tiered",
    "block_size": 8,
    "active_window": 16,
    "warm_tokens": 4096,
    "prefill_chunk_tokens": 64,
    "kv_precision": "fp16",
    "selection_min_tokens": 0,
    "warm_budget_tokens": 16,
    "selection_prompt_tokens": 0,
}
TASKS_RUN = ("number", "record")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from flashmemory import FlashMemoryEngine

    folder = tmp_path_factory.mktemp("tiny-shared")
    write_tiny_model(folder, "LlamaForCausalLM", max_position_embeddings=2048)
    eng = FlashMemoryEngine(str(folder), kv_cache="contiguous", block_size=8)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def builder(engine):
    return TrialBuilder(engine.tokenizer, TEXT)


def test_one_haystack_holds_every_trial_and_each_trial_asks_one_question(engine, builder):
    trials = build_shared(builder, TASKS, 9000, (0.2, 0.5, 0.8), 0)
    assert len(trials) == len(TASKS) * 3
    haystack = trials[0].token_ids[: trials[0].shared_prefix_tokens]
    assert all(t.token_ids[: t.shared_prefix_tokens] == haystack for t in trials)
    assert len({tuple(t.token_ids[t.shared_prefix_tokens :]) for t in trials}) == len(
        trials
    )  # its own question
    text = engine.tokenizer.decode(haystack)
    for t in trials:
        start, end = t.target_spans[0]
        assert end <= t.shared_prefix_tokens
        assert abs(start / t.shared_prefix_tokens - t.depth) < 0.08, (
            t.key
        )  # at its depth, spread from the rest
        needle = engine.tokenizer.decode(t.token_ids[start:end])
        if t.task not in ("vartrack", "multivalue"):
            assert all(e in needle for e in t.expected[:1]), (t.key, needle)
    # each question has one answer: its key is in no other needle
    keys = [
        engine.tokenizer.decode(t.token_ids[s:e]).split(" for ")[1].split(" is")[0]
        for t in trials
        if t.task in ("number", "word", "uuid", "multikey")
        for s, e in t.target_spans[:1]
    ]
    assert len(keys) == len(set(keys)) and all(text.count(f" for {k} is") == 1 for k in keys)
    assert (
        build_shared(builder, TASKS, 9000, (0.2, 0.5, 0.8), 0)[5].token_ids == trials[5].token_ids
    )


def test_the_suite_builds_one_haystack_per_length_and_seed(builder):
    spec = SuiteSpec(("number", "word"), (1500, 3000), (0.3, 0.7), 2, 0, "shared")
    trials = list(build_trials(builder, spec))
    assert len(trials) == spec.num_trials == 16
    assert len({tuple(t.token_ids[: t.shared_prefix_tokens]) for t in trials}) == 4
    with pytest.raises(ConfigError, match="unknown needle layout"):
        list(build_trials(builder, SuiteSpec(layout="stacked")))


def test_a_haystack_too_short_for_its_needles_is_refused(builder):
    with pytest.raises(ConfigError, match="shared haystack for 24 trials"):
        build_shared(builder, TASKS, 1200, (0.2, 0.5, 0.8), 0)


def test_keys_run_out_with_a_clear_error():
    draws = Draws(random.Random(0), ("a", "b"))
    draws.keys(2)
    with pytest.raises(ConfigError, match="ran out of key words"):
        draws.key()


def test_aggregation_gives_the_asked_item_the_most_marks_around_its_depth():
    q = make_question("aggregation", random.Random(3), 0.7)
    items = Counter(n.text.split(" goes to ")[1].rstrip(". ") for n in q.needles)
    top, count = items.most_common(1)[0]
    assert (top,) == q.expected and count == TALLY_TOP
    assert sorted(items.values())[:-1] == [TALLY_REST] * (len(items) - 1)
    marks = [n.depth for n in q.needles if n.target]
    assert len(marks) == TALLY_TOP and all(0.5 - 1e-9 <= d <= 0.9 for d in marks)
    assert abs(marks[0] - 0.7) == min(
        abs(d - 0.7) for d in marks
    )  # the one nearest its depth first


def test_a_record_is_asked_for_every_field():
    q = make_question("record", random.Random(5), 0.4)
    (needle,) = q.needles
    assert len(q.expected) == 4 and all(e in needle.text for e in q.expected)
    assert "JSON" in q.question and q.answer_prefix.endswith("as JSON:")


def test_separate_trials_are_unchanged_by_the_key_draws():
    """The earlier tasks draw their keys as before (one choice from WORDS, then the value):
    published trials
    keep their needles."""
    rng = random.Random("number|1024|0.5|0")
    key, value = rng.choice(WORDS), str(rng.randint(1_000_000, 9_999_999))
    q = make_question("number", random.Random("number|1024|0.5|0"), 0.5)
    assert (
        q.expected == (value,)
        and q.needles[0].text == f" The special magic number for {key} is: {value}. "
    )


def _answers(run):
    return [r.answer for r in run.results]


def test_a_shared_haystack_is_prefilled_once_and_answers_as_each_trial_alone(engine, builder):
    trials = build_shared(builder, TASKS_RUN, 1200, (0.3, 0.7), 0)
    shared = run_config(engine, "shared", SELECTING, trials)
    stats = engine.stats()
    haystack = trials[0].shared_prefix_tokens
    # every trial after the one that warmed it found the haystack's full blocks in the prefix cache
    assert stats["prefix_cache_hits"] >= len(trials) * (haystack // 8 * 8 - 8)
    assert shared.haystack_seconds > 0 and shared.haystack_tokens_restored == 0
    alone = run_config(
        engine,
        "alone",
        {**SELECTING, "prefix_caching": False},
        [type(t)(**{**t.__dict__, "shared_prefix_tokens": 0}) for t in trials],
    )
    assert _answers(shared) == _answers(alone)


def test_a_snapshot_is_made_once_and_restored_into_every_configuration(engine, builder, tmp_path):
    trials = build_shared(builder, TASKS_RUN, 1200, (0.3, 0.7), 0)
    prefill = HaystackPrefill(tmp_path / "snaps")
    runs = run_suite(engine, trials, {"selecting": SELECTING}, prefill=prefill)
    files = list((tmp_path / "snaps").iterdir())
    assert len(files) == 1 and len(prefill.snapshot_seconds) == 1
    assert [r.name for r in runs] == [BASELINE, "selecting"]
    assert all(r.haystack_tokens_restored > 0 for r in runs)
    fresh = run_config(engine, BASELINE, BASELINE_KNOBS, trials)  # prefilled by the config itself
    assert _answers(runs[0]) == _answers(fresh)
    again = HaystackPrefill(tmp_path / "snaps")
    again.make_snapshots(engine, [trials[0].token_ids[: trials[0].shared_prefix_tokens]])
    assert again.snapshot_seconds == {}  # found, not made again


def test_the_prefix_cache_keeps_a_haystack_larger_than_its_default_budget(engine):
    knobs = keep_knobs(engine, 10**7, {"kv_cache": "tiered"})
    assert knobs["prefix_cache_host_mb"] > engine.config.prefix_cache_host_mb
    assert keep_knobs(engine, 10**7, {"prefix_cache_host_mb": 5.0})["prefix_cache_host_mb"] == 5.0


def test_the_probe_says_where_the_needle_was_and_whether_it_was_chosen(engine, builder):
    trials = build_shared(builder, ("number",), 1200, (0.3,), 0)
    seen = run_config(engine, "selecting", SELECTING, trials).results[0].needle
    assert seen["level"] == "L1" and seen["candidates"] > 0 and 0 <= seen["chosen_share"] <= 1
    in_window = run_config(engine, "exact", BASELINE_KNOBS, trials).results[0].needle
    assert (
        in_window["candidates"] == 0 and in_window["level"] == "L0"
    )  # exact selection chooses nothing


def test_the_probe_counts_rank_and_choice_per_head():
    probe = NeedleProbe()
    probe.start([(40, 50)], 8)  # blocks 5 and 6
    indices = torch.tensor([2, 5, 6, 9])
    scores = torch.tensor(
        [[0.1, 0.9, 0.2, 0.5], [0.8, 0.1, 0.3, 0.9]]
    )  # head 0 ranks block 5 first
    chosen = torch.tensor([[1, 3], [0, 3]])  # head 0 reads block 5, head 1 neither needle block
    probe.on_choose(LayerChoice(0, 100, 0, 2, indices, scores, chosen, torch.zeros(2), 12, None))
    summary = probe.sight.summary()
    assert summary["level"] == "L2" and summary["candidates"] == 4
    assert summary["chosen_share"] == 0.25 and sorted(probe.sight.ranks) == [0, 2, 2, 3]
    probe.start([(0, 8)], 8)
    assert probe.sight.summary() == {
        "level": "L0",
        "chosen_share": 1.0,
        "median_rank": None,
        "candidates": 0,
    }
