"""Decode-mode fidelity of the decode comparison: PPL, KL and top-1 on small hand-made distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashmemory.tools.bench.decode_fidelity import compare, decode_ppl, log_softmax, score_engines


def _rows(*probabilities: list[float]) -> np.ndarray:
    return np.log(np.array(probabilities, dtype=np.float64)).astype(np.float32)


def test_log_softmax_is_normalised_float32_even_for_large_logits():
    out = log_softmax(np.array([1000.0, 1000.0, 0.0], dtype=np.float32))
    assert out.dtype == np.float32
    assert out[:2] == pytest.approx([-math.log(2)] * 2) and np.exp(out.astype(np.float64)).sum() == pytest.approx(1)


def test_decode_ppl_is_exp_of_the_mean_nll_of_the_next_ids():
    rows = _rows([0.5, 0.25, 0.25], [0.1, 0.8, 0.1])
    assert decode_ppl(rows, np.array([0, 1])) == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.8)) / 2))


def test_kl_and_top1_against_a_reference():
    reference = _rows([0.5, 0.25, 0.25], [0.1, 0.8, 0.1])
    other = _rows([0.25, 0.5, 0.25], [0.1, 0.8, 0.1])
    mean_kl, top1 = compare(reference, other)
    kl_first = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)  # the second step agrees exactly: KL 0
    assert mean_kl == pytest.approx(kl_first / 2, abs=1e-6) and top1 == 0.5
    assert compare(reference, reference) == (pytest.approx(0, abs=1e-7), 1.0)


def test_engines_are_scored_against_their_references_and_a_vocab_mismatch_is_na():
    exact = _rows([0.5, 0.25, 0.25], [0.1, 0.8, 0.1])
    mixed = _rows([0.25, 0.5, 0.25], [0.1, 0.8, 0.1])
    other_vocab = _rows([0.5, 0.5], [0.5, 0.5])
    out = score_engines({"fm-exact": exact, "fm-mixed": mixed, "peer": other_vocab}, [0, 1],
                        {"fm-exact": [], "fm-mixed": ["fm-exact"], "peer": ["fm-exact", "absent"]})
    assert out["fm-exact"]["against"] == [] and out["fm-mixed"]["scored_steps"] == 2
    (agreement,) = out["fm-mixed"]["against"]
    assert agreement["reference"] == "fm-exact" and agreement["top1"] == 0.5
    assert agreement["delta_ppl"] == pytest.approx(out["fm-mixed"]["decode_ppl"] - out["fm-exact"]["decode_ppl"])
    (na,) = out["peer"]["against"]  # "absent" did not run: left out
    assert na["na"] == "vocabularies differ (3 vs 2 logits)" and na["mean_kl"] is None
