"""Sampling: validation of every parameter, greedy, top-k, top-p, and seed reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from flashmemory.engine.sampling import Sampler, SamplingParams
from flashmemory.errors import SamplingParamsError

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("max_new_tokens", 0), ("max_new_tokens", 1.5), ("max_new_tokens", True),
        ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "hot"),
        ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5), ("seed", 1.5), ("stop", [""]),
    ],
)
def test_invalid_sampling_value_is_rejected_with_its_name(param, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{param: value})
    assert e.value.param == param
    assert param in str(e.value)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="END").stop == ("END",)


def test_greedy_picks_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams(), CPU).sample(logits) == 1


def test_top_k_one_is_greedy_even_when_hot():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=3), CPU)
    assert {sampler.sample(logits) for _ in range(20)} == {int(logits.argmax())}


def test_top_p_keeps_only_the_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two tokens.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0), CPU)
    seen = {sampler.sample(logits) for _ in range(200)}
    assert seen == {0, 1}


def test_same_seed_gives_same_tokens_and_different_seed_differs():
    logits = torch.zeros(1000)

    def draw(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed), CPU)
        return [s.sample(logits) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
