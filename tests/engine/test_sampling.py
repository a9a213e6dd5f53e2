"""Sampling: validation of every parameter, greedy, top-k, top-p, and seed reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from flashmemory.engine.sampling import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    GREEDY_BELOW_TEMPERATURE,
    Sampler,
    SamplingParams,
    choice_seed,
)
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


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("top_p", 1e-300), ("top_p", FLOAT32_TINY / 2), ("top_p", math.nan), ("temperature", 1e39),
        ("seed", 2**64), ("seed", -1), ("seed", True),
    ],
)
def test_values_float32_or_the_generator_cannot_carry_are_rejected_with_their_name(param, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{param: value})
    assert e.value.param == param and param in str(e.value)


def test_a_temperature_below_1e_5_samples_greedily():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1))
    for temperature in (1e-40, 5e-324, 9e-6):
        params = SamplingParams(temperature=temperature)
        assert params.is_greedy and Sampler(params, CPU).sample(logits) == int(logits.argmax())
    assert not SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).is_greedy


def test_a_top_p_that_is_all_but_zero_in_float32_keeps_the_most_likely_token():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(2))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=FLOAT32_TINY, seed=0), CPU)
    assert {sampler.sample(logits) for _ in range(20)} == {int(logits.argmax())}


@pytest.mark.parametrize("temperature", [GREEDY_BELOW_TEMPERATURE, 1.0, FLOAT32_MAX])
@pytest.mark.parametrize("top_p", [FLOAT32_TINY, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [0, 1, 5])
def test_the_sampler_picks_a_valid_token_for_extreme_accepted_values(temperature, top_p, top_k):
    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(300, generator=g) * 20, torch.zeros(300),  # ordinary logits, and all tied
             torch.tensor([3e38, -3e38, 0.0, 1e30, -1e30] * 60)]  # spreads that overflow float32 when scaled
    for seed in (0, 2**64 - 1):
        sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed), CPU)
        for logits in cases:
            token = sampler.sample(logits)  # torch.multinomial raises on NaN or all-zero probabilities
            assert 0 <= token < logits.numel()
            if top_k == 1 or top_p == FLOAT32_TINY:
                assert logits[token] == logits.max()


def test_choice_seeds_are_distinct_and_wrap_within_64_bits():
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert [choice_seed(2**64 - 1, i) for i in range(3)] == [2**64 - 1, 0, 1]
