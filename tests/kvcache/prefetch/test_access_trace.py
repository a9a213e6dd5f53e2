"""Access traces: what is recorded is what selection chose, recording changes nothing, features follow history."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashmemory import FlashMemoryEngine
from flashmemory.errors import ConfigError
from flashmemory.kvcache import native
from flashmemory.kvcache.prefetch.access_stats import FEATURE_NAMES, NUM_FEATURES, AccessStats, StepChoices
from flashmemory.kvcache.prefetch.access_trace import ChoiceEvent, TraceRecorder, lru_scores, trace_dataset, trace_steps

LEVELS = dict(block_size=8, active_window=16, warm_tokens=16, prefill_chunk_tokens=32, cpu_memory_gb=0.01,
              cold_zone_gb=0.01, semantic_truncate_threshold=0.3, warm_budget_tokens=8)


def _decode(engine, ids: list[int], prefill: int) -> torch.Tensor:
    seq = 7
    engine.cache.add_sequence(seq)
    try:
        out = [engine.forward_tokens(seq, ids[:prefill])]
        out += [engine.forward_tokens(seq, [t]) for t in ids[prefill:]]
    finally:
        engine.cache.free_sequence(seq)
    return torch.cat(out)


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(3, 300, (110,), generator=torch.Generator().manual_seed(1)).tolist()


def test_recorded_choices_are_what_selection_chose_and_recording_changes_nothing(tiny_llama, ids, tmp_path):
    plain = FlashMemoryEngine(model_path=str(tiny_llama), **LEVELS)
    recording = FlashMemoryEngine(model_path=str(tiny_llama), record_traces=True, **LEVELS)
    assert plain.cache.trace is None and not plain.cache.choice_observers  # zero cost when off
    assert torch.equal(_decode(plain, ids, 80), _decode(recording, ids, 80))
    trace = recording.cache.trace
    layers = recording.model_config.num_layers
    disk = [e for e in trace.events if e.level == 2]
    assert disk and {e.layer for e in disk} == set(range(layers))
    assert len({e.step for e in trace.events}) == len(ids) - 80  # one per decode step
    for e in trace.events:
        budget = e.chosen.shape[1]
        top = np.sort(np.argsort(-e.scores.astype(np.float32), axis=1, kind="stable")[:, :budget], axis=1)
        # The recorded scores are fp16: compare the chosen blocks' scores, not ids, where ties may differ.
        got = np.take_along_axis(e.scores.astype(np.float32), e.chosen, 1)
        want = np.take_along_axis(e.scores.astype(np.float32), top, 1)
        assert np.allclose(np.sort(got, 1), np.sort(want, 1), atol=1e-2)
    path = tmp_path / "trace.npz"
    trace.save(path)
    loaded = TraceRecorder.load(path)
    assert len(loaded) == len(trace)
    for a, b in zip(trace.events, loaded.events):
        assert (a.step, a.layer, a.level, a.num_blocks) == (b.step, b.layer, b.level, b.num_blocks)
        assert np.array_equal(a.indices, b.indices) and np.array_equal(a.chosen, b.chosen)
    plain.close()
    recording.close()


def _event(step: int, chosen: list[int], n: int = 6) -> ChoiceEvent:
    scores = np.zeros((1, n), dtype=np.float16)
    scores[0, chosen] = 1
    return ChoiceEvent(0, step, 0, 2, np.arange(n, dtype=np.int32), scores, np.array([chosen], dtype=np.int32),
                       np.zeros(1, np.float32), n + 4)


def _step(event: ChoiceEvent) -> StepChoices:
    return StepChoices(event.step, event.level, torch.tensor([event.layer]), torch.from_numpy(event.indices).long(),
                       torch.from_numpy(event.scores[None]).float(), torch.from_numpy(event.chosen[None]).long(),
                       torch.from_numpy(event.query_mean[None]), event.num_blocks)


def test_features_follow_selection_history():
    stats = AccessStats(num_layers=1, num_kv_heads=1)
    for step, chosen in [(10, [0, 1]), (12, [0, 2]), (13, [0, 1])]:
        step_choices = _step(_event(step, chosen))
        stats.update(step_choices)
    f = stats.features(step_choices).permute(1, 2, 3, 0)[0].numpy()
    assert f.shape == (1, 6, NUM_FEATURES)
    col = {name: i for i, name in enumerate(FEATURE_NAMES)}
    assert f[0, 0, col["selected_now"]] == 1 and f[0, 3, col["never_selected"]] == 1
    assert f[0, 0, col["frequency"]] == pytest.approx(1.0) and f[0, 2, col["frequency"]] == pytest.approx(1 / 3)
    assert f[0, 0, col["num_intervals"]] == pytest.approx(0.2)  # intervals 2 and 1
    assert f[0, 0, col["interval_mean_log"]] == pytest.approx(np.log1p(1.5) / 5, rel=1e-5)
    assert f[0, 1, col["interval_mean_log"]] == pytest.approx(np.log1p(3) / 5, rel=1e-5)
    assert f[0, 0, col["position"]] == 0 and f[0, 5, col["position"]] == pytest.approx(0.5)
    lru = lru_scores(f[0])
    assert lru[0] > lru[2] > lru[3]  # recent beats older beats never


def test_dataset_labels_are_the_next_steps_choices():
    trace = TraceRecorder()
    for step, chosen in [(0, [0, 1]), (1, [1, 2]), (2, [2, 3])]:
        trace.events.append(_event(step, chosen))
    x, y, group = trace_dataset(trace, horizon_steps=1)
    assert x.shape == (12, NUM_FEATURES)  # steps 0 and 1 have a recorded future, 6 candidates each
    assert y[:6].tolist() == [0, 1, 1, 0, 0, 0] and y[6:].tolist() == [0, 0, 1, 1, 0, 0]
    assert group.tolist() == [0] * 6 + [1] * 6


def test_empty_or_unreadable_trace_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="empty"):
        trace_dataset(TraceRecorder())
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a trace")
    with pytest.raises(ConfigError, match="cannot read access trace"):
        TraceRecorder.load(bad)


def test_statistics_are_the_same_through_views_and_through_gathers():
    """A step whose candidates are one run of blocks in every layer is read and written through slice views (or
    the native kernel, when built); any other (a subset of layers, gaps between blocks) through gathers. All give
    the same statistics and features."""
    rng = np.random.default_rng(5)
    layers, heads, n, budget = 3, 2, 12, 4
    fast, gathered = AccessStats(layers, heads), AccessStats(layers, heads)
    ids = torch.arange(20, 20 + n)
    picked_at: dict[int, list[int]] = {j: [] for j in range(n)}  # layer 0, head 0: the steps each block was chosen
    for step in range(30):
        scores = torch.from_numpy(rng.random((layers, heads, n)).astype(np.float32))
        chosen = scores.topk(budget, dim=-1).indices
        for j in chosen[0, 0].tolist():
            picked_at[j].append(step)
        step_choices = StepChoices(step, 2, torch.arange(layers), ids, scores, chosen, torch.zeros(layers, heads), 40)
        fast.update(step_choices)
        for layer in range(layers):  # one layer at a time: the gather path
            one = StepChoices(step, 2, torch.tensor([layer]), ids, scores[layer : layer + 1],
                              chosen[layer : layer + 1], torch.zeros(1, heads), 40)
            gathered.update(one)
    assert isinstance(fast._cells(step_choices)[2], slice) and not isinstance(gathered._cells(one)[2], slice)
    both = torch.cat([gathered.features(StepChoices(step, 2, torch.tensor([layer]), ids, scores[layer : layer + 1],
                                                    chosen[layer : layer + 1], torch.zeros(1, heads), 40))
                      for layer in range(layers)], dim=1)
    assert torch.allclose(fast.features(step_choices), both, atol=1e-5)  # the native kernel sums in another order
    for name in ("last_step", "count", "observed", "ema", "num_intervals", "interval_sum", "interval_sumsq"):
        assert torch.equal(getattr(fast, name), getattr(gathered, name)), name
    col = {name: i for i, name in enumerate(FEATURE_NAMES)}
    f = fast.features(step_choices)
    assert f[col["num_intervals"]].max() == 1.0  # the interval ring wrapped around
    for j, steps in picked_at.items():  # mean and variance of the last NUM_INTERVALS intervals, computed plainly
        intervals = np.diff(steps)[-10:]
        if len(intervals):
            assert f[col["interval_mean_log"], 0, 0, j] == pytest.approx(np.log1p(intervals.mean()) / 5, abs=1e-6)
            assert f[col["interval_var_log"], 0, 0, j] == pytest.approx(np.log1p(intervals.var()) / 10, abs=1e-5)


def test_sequences_decoding_in_one_batch_are_grouped_per_sequence_and_step():
    """In a batched forward the sequences' choices interleave layer by layer; each step of each sequence is still
    one group of all its layers."""
    events = []
    for step in range(3):
        for layer in range(2):
            for seq in (0, 1):  # the order a batched forward records them
                events.append(ChoiceEvent(seq, 10 * seq + step, layer, 2, np.arange(6, dtype=np.int32),
                                          np.zeros((1, 6), np.float16), np.array([[0, 1]], np.int32),
                                          np.zeros(1, np.float32), 10))
    groups = trace_steps(events)
    assert [(seq, g[0].step, [e.layer for e in g]) for seq, g in groups] == [
        (seq, 10 * seq + step, [0, 1]) for step in range(3) for seq in (0, 1)]


@pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernel cannot be built here")
def test_native_statistics_equal_the_torch_reference():
    rng = np.random.default_rng(9)
    layers, heads, n, budget = 4, 3, 40, 7
    kernel, reference = AccessStats(layers, heads), AccessStats(layers, heads)
    reference._lib = None
    ids = torch.arange(5, 5 + n)
    for step in range(60):  # long enough for the interval rings to wrap
        scores = torch.from_numpy(rng.normal(size=(layers, heads, n)).astype(np.float32))
        chosen = (scores + torch.from_numpy(rng.normal(size=(layers, heads, n)).astype(np.float32))).topk(
            budget, dim=-1).indices
        step_choices = StepChoices(100 + step, 1 + step % 2, torch.arange(layers), ids, scores, chosen,
                                   torch.from_numpy(rng.normal(size=(layers, heads)).astype(np.float32)), 60)
        kernel.update(step_choices)
        reference.update(step_choices)
        assert torch.allclose(kernel.features(step_choices), reference.features(step_choices), atol=1e-5)
    for name in ("last_step", "count", "observed", "ema", "ring", "num_intervals", "interval_sum", "interval_sumsq"):
        assert torch.equal(getattr(kernel, name), getattr(reference, name)), name
