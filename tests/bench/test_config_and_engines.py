"""Bench settings (validation, quick mode) and the engine registry (selection, why an engine is n/a)."""

from __future__ import annotations

import pytest

from flashmemory.bench import engines as engines_module
from flashmemory.bench.config import BenchConfig, parse_length
from flashmemory.bench.engines import ENGINES, select_engines, unavailable_reason
from flashmemory.errors import ConfigError


def test_lengths_accept_k_suffixes_and_reject_garbage():
    assert [parse_length(x) for x in ("512", "2K", "8k")] == [512, 2048, 8192]
    with pytest.raises(ConfigError, match="--lengths 'abc'"):
        parse_length("abc")


@pytest.mark.parametrize(("settings", "message"), [
    ({"num_runs": 0}, "--runs"),
    ({"decode_tokens": 1}, "--decode-tokens"),
    ({"fidelity_tokens": 1}, "--fidelity-tokens"),
    ({"lengths_tokens": (512, 512)}, "repeats"),
    ({"budget_mb": -1.0}, "--budget-mb"),
    ({"dtype": "int8"}, "--dtype"),
    ({"bogus": 1}, "unknown bench setting"),
])
def test_bad_settings_raise_config_errors_naming_the_flag(settings, message):
    with pytest.raises(ConfigError, match=message):
        BenchConfig.create(**settings)


def test_quick_mode_fills_only_what_was_not_given():
    quick = BenchConfig.create(quick=True)
    assert quick.lengths_tokens == (512,) and quick.num_runs == 1 and quick.decode_tokens == 8
    assert quick.fidelity_tokens == 16 and not quick.verify_limit
    assert BenchConfig.create(quick=True, num_runs=2, lengths_tokens=(96,)).num_runs == 2
    full = BenchConfig.create()
    assert full.lengths_tokens == (512, 2048, 8192) and full.num_runs == 3 and full.verify_limit


def test_engines_are_selected_by_name_or_family_in_registry_order():
    default = [e.name for e in select_engines([])]
    assert default[:4] == ["fm-exact", "fm-int4", "fm-mixed", "fm-mixed-budget"]
    assert "fm-contiguous" not in default and len(default) == len(ENGINES) - 1
    assert [e.name for e in select_engines(["hf-dynamic", "fm-contiguous"])] == ["fm-contiguous", "hf-dynamic"]
    llama = [e.name for e in select_engines(["llama.cpp"])]
    assert len(llama) == 6 and {"llamacpp-f16", "llamacpp-q4_0-fa"} <= set(llama)
    with pytest.raises(ConfigError, match="unknown engine 'vllm'"):
        select_engines(["vllm"])


def test_every_missing_peer_says_what_to_install_or_what_it_needs(monkeypatch):
    monkeypatch.setattr(engines_module, "_importable", lambda module: False)
    by_name = {e.name: e for e in ENGINES}
    assert "pip install optimum-quanto" in unavailable_reason(by_name["hf-quanto-int4"], True, False)
    assert "pip install hqq" in unavailable_reason(by_name["hf-hqq-int2"], True, False)
    assert "llama-cpp-python not installed" in unavailable_reason(by_name["llamacpp-q8_0-fa"], True, False)
    assert "scripts/install_llama_cpp.sh" in unavailable_reason(by_name["llamacpp-f16"], True, False)
    assert "needs CUDA" in unavailable_reason(by_name["hf-offloaded-static"], True, False)
    assert unavailable_reason(by_name["hf-offloaded"], True, True) is None
    assert unavailable_reason(by_name["fm-mixed"], False, False) is None
    monkeypatch.setattr(engines_module, "_importable", lambda module: True)
    assert "needs a GGUF model" in unavailable_reason(by_name["llamacpp-f16"], False, False)
