"""The needle suite end to end on a tiny model: trials are built and scored, and a configuration
that never reads
the needle's blocks is caught as "exact right, config wrong"."""

from __future__ import annotations

import json

import pytest
import torch

from flashmemory.cli import main
from flashmemory.errors import ConfigError
from flashmemory.kvcache.read.reader import BlockReader
from flashmemory.model.tokenizer import Tokenizer
from flashmemory.tools.needles import report
from flashmemory.tools.needles.runner import (
    BASELINE,
    BASELINE_KNOBS,
    ConfigRun,
    is_right,
    run_config,
)
from flashmemory.tools.needles.suite import SuiteSpec, build_trials
from flashmemory.tools.needles.tasks import TASKS, TrialBuilder
from tests.helpers import write_tiny_model

TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do. "
    "Once or twice she had peeped into the book her sister was reading. "
) * 60
TINY_KV = {
    "kv_cache": "tiered",
    "block_size": 8,
    "active_window": 16,
    "warm_tokens": 32,
    "prefill_chunk_tokens": 64,
    "kv_precision": "fp16",
}


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """A tiny random Llama that takes 1024 positions (the needle trials are a few hundred
    tokens)."""
    folder = tmp_path_factory.mktemp("tiny-needles")
    write_tiny_model(folder, "LlamaForCausalLM", max_position_embeddings=1024)
    return folder


@pytest.fixture(scope="module")
def engine(tiny_long):
    from flashmemory import FlashMemoryEngine

    eng = FlashMemoryEngine(str(tiny_long), kv_cache="contiguous", block_size=8)
    yield eng
    eng.close()


def test_every_task_places_its_needles_where_asked(engine):
    builder = TrialBuilder(engine.tokenizer, TEXT)
    for task in TASKS:
        trial = builder.build(task, 1500, 0.5, 0)
        assert abs(len(trial.token_ids) - 1500) <= 8, task
        start, end = trial.target_spans[0]
        assert 0.3 < start / len(trial.token_ids) < 0.6, (
            task
        )  # the intro and question shift it a little
        needle = engine.tokenizer.decode(trial.token_ids[start:end])
        assert any(e in needle for e in trial.expected) or task == "vartrack", (task, needle)
    assert (
        builder.build("number", 600, 0.5, 0).token_ids
        == builder.build("number", 600, 0.5, 0).token_ids
    )
    assert (
        builder.build("number", 600, 0.5, 0).token_ids
        != builder.build("number", 600, 0.5, 1).token_ids
    )


def test_a_trial_too_long_for_the_text_is_refused(engine):
    with pytest.raises(ConfigError, match="longer text"):
        TrialBuilder(engine.tokenizer, TEXT[:2000]).build("number", 4000, 0.5, 0)


def test_answers_are_scored_by_every_expected_string():
    assert is_right(" 1234567. And", ("1234567",))
    assert is_right("Yarrow", ("yarrow",))
    assert not is_right(" 1234 567", ("1234567",))
    assert not is_right("A and B", ("A", "B", "C"))


def test_default_run_has_at_least_100_trials():
    assert SuiteSpec().num_trials >= 100


def _eval_needles(model, tmp_path, *flags: str) -> int:
    """`flashmemory eval --needles` on TEXT (written under tmp_path) and the model, with `flags`."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    return main(["eval", "--needles", "--text", str(text), "--model", str(model), *flags])


def test_eval_needles_scores_every_config_and_writes_json_and_heatmaps(tiny_long, tmp_path, capsys):
    out = tmp_path / "n.json"
    knobs = ",".join(f"{k}={v}" for k, v in TINY_KV.items() if k != "kv_cache")
    rc = _eval_needles(
        tiny_long, tmp_path, "--needle-tasks", "number", "multikey", "--needle-lengths", "400",
        "--needle-depths", "0.2", "0.8", "--json", str(out),
        "--heatmaps-dir", str(tmp_path / "maps"), "--config", f"tiny:{knobs}",
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"| {BASELINE} |" in printed and "| tiny |" in printed
    data = json.loads(out.read_text())
    assert data["num_trials"] == 4 and [c["name"] for c in data["configs"]] == [BASELINE, "tiny"]
    for config in data["configs"]:
        assert len(config["results"]) == 4 and 0 <= config["pass_rate"] <= 1
    assert data["configs"][1]["kv_stats"]["selection_steps"] > 0
    assert sorted(p.name for p in (tmp_path / "maps").iterdir()) == [
        f"needles-{BASELINE}.png",
        "needles-tiny.png",
    ]


def test_lengths_that_leave_no_room_for_the_answer_are_refused_before_any_trial(
    tiny_long, tmp_path, capsys
):
    rc = _eval_needles(
        tiny_long, tmp_path, "--needle-tasks", "number", "--needle-lengths", "400", "1024",
        "--needle-depths", "0.5",
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "--needle-lengths 1024 leaves no room" in err and "of at most 1012" in err
    assert "trials" not in err  # nothing ran


def _blocks_of(spans: list[tuple[int, int]], block_size: int) -> set[int]:
    return {
        b for start, end in spans for b in range(start // block_size, (end - 1) // block_size + 1)
    }


def test_a_config_that_never_reads_the_needle_is_caught(engine, monkeypatch):
    """The tiny model cannot retrieve, so each trial's right answer is what exact attention says; a
    selector that
    skips the needle's blocks changes that answer, and the report lists the trial."""
    trials = list(
        build_trials(
            TrialBuilder(engine.tokenizer, TEXT), SuiteSpec(("number",), (400,), (0.3, 0.6), 2)
        )
    )
    baseline = run_config(engine, BASELINE, BASELINE_KNOBS, trials)
    for trial, result in zip(trials, baseline.results):
        trial.expected = (result.answer,)
    original = BlockReader._choose  # one sequence's choice at one level and layer
    hidden: set[int] = set()

    def choose_without_needle(self, level, plan, q, layer):
        chosen = original(self, level, plan, q, layer)
        keep = [i for i, index in enumerate(plan.indices) if index not in hidden]
        return (
            torch.as_tensor(keep, dtype=torch.int64).expand(chosen.shape[0], -1) if keep else chosen
        )

    def run(name: str, knobs: dict) -> ConfigRun:
        total = ConfigRun(name, knobs)
        for trial in trials:  # one trial at a time, so the fake selector knows where its needle is
            hidden.clear()
            hidden.update(_blocks_of(trial.target_spans, 8))
            total.results += run_config(engine, name, knobs, [trial]).results
        return total

    exact_tiered = run_config(engine, "tiered-all", {**TINY_KV, "selection": "exact"}, trials)
    monkeypatch.setattr(BlockReader, "_choose", choose_without_needle)
    blind = run("blind", TINY_KV)
    baseline = run_config(
        engine, BASELINE, BASELINE_KNOBS, trials
    )  # re-scored against the new expectations
    assert baseline.pass_rate == 1.0
    assert report.regressions(baseline, exact_tiered) == []
    lost = report.regressions(baseline, blind)
    assert lost, "dropping the needle's blocks changed no answer"
    assert "blind: number length 400" in report.format_regressions([baseline, exact_tiered, blind])


def test_the_condense_pipeline_runs_on_the_same_trials_beside_exact(tiny_long, tmp_path, capsys):
    """`--needle-condense-with`: a reader of another vocabulary condenses each trial's haystack
    (its span in the trial holds the needles), the model answers from what it kept; the report
    counts it as a configuration against exact and says whether each needle survived."""
    reader = tmp_path / "reader"
    write_tiny_model(reader, num_hidden_layers=1, seed=3, max_position_embeddings=1024,
                     tokenizer_size=300, tokenizer_corpus=TEXT.upper())
    builder = TrialBuilder(Tokenizer.from_checkpoint(tiny_long, []), TEXT)
    for trial in build_trials(builder, SuiteSpec(("number", "multikey"), (400,), (0.2, 0.8))):
        start, end = trial.document_span
        assert trial.question and all(start <= a < b <= end for a, b in trial.target_spans)
    out = tmp_path / "n.json"
    rc = _eval_needles(
        tiny_long, tmp_path, "--needle-tasks", "number", "multikey", "--needle-lengths", "400",
        "--needle-depths", "0.2", "0.8", "--json", str(out), "--needle-condense-with", str(reader),
    )  # fmt: skip
    assert rc == 0
    captured = capsys.readouterr()
    assert "| condensed-by-reader |" in captured.out and "needles kept" in captured.err
    data = json.loads(out.read_text())
    assert [c["name"] for c in data["configs"]] == [BASELINE, "condensed-by-reader"]
    condensed = data["configs"][1]
    assert {r["needle"]["condensed"] for r in condensed["results"]} == {True}
    assert 0 <= condensed["kv_stats"]["condense_needles_kept"] <= 1
