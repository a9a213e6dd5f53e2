"""Bench settings (validation, quick mode) and the engine registry (selection, why an engine is n/a)."""

from __future__ import annotations

import pytest

from flashmemory.tools.bench import engines as engines_module
from flashmemory.tools.bench.config import BenchConfig, parse_length
from flashmemory.tools.bench.disk_tier import knobs_for_disk_fraction
from flashmemory.tools.bench.engines import ENGINES, select_engines, unavailable_reason
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
    assert default[:4] == ["fm-exact", "fm-int2-disk", "fm-mixed", "fm-mixed-budget"]
    named_only = {"fm-exact-f32act", "fm-exact-int8act", "fm-contiguous", "fm-mixed-disk",
                  "fm-mixed-prefetch", "fm-mixed-prefetch-lru"}
    assert not named_only & set(default) and len(default) == len(ENGINES) - len(named_only)
    assert not named_only & {e.name for e in select_engines(["flashmemory"])}  # a family: its default ones
    assert [e.name for e in select_engines(["fm-mixed-prefetch", "fm-mixed-disk"])] == ["fm-mixed-disk",
                                                                                      "fm-mixed-prefetch"]
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


def test_cuda_weight_only_engines_are_na_without_a_gpu_and_name_torchao_on_one(monkeypatch):
    """weights_dtype q8_0/q4_0 through torchao: reported n/a on a CPU-only host (never run there on the CPU's
    kernels under their name); on a GPU without torchao, the install command."""
    by_name = {e.name: e for e in ENGINES}
    for name, weights_dtype in (("fm-cuda-int8", "q8_0"), ("fm-cuda-int4", "q4_0")):
        spec = by_name[name]
        assert spec.settings["weights_dtype"] == weights_dtype and spec.settings["device"] == "cuda"
        assert spec in select_engines([])
        assert unavailable_reason(spec, True, cuda_available=False).startswith("n/a: needs CUDA, no CUDA device")
        monkeypatch.setattr(engines_module, "_importable", lambda module: False)
        assert "pip install torchao==0.18.0" in unavailable_reason(spec, True, cuda_available=True)
        assert "flashmemory-runtime[cuda]" in unavailable_reason(spec, True, cuda_available=True)
        monkeypatch.setattr(engines_module, "_importable", lambda module: True)
        assert unavailable_reason(spec, True, cuda_available=True) is None


def test_disk_engines_put_about_half_of_each_prompt_on_l2_with_the_default_window_when_it_fits():
    by_name = {e.name: e for e in ENGINES}
    disk, prefetch = by_name["fm-mixed-disk"], by_name["fm-mixed-prefetch"]
    assert disk.settings["cold_zone_uncached_reads"] and disk.settings.get("prefetch_strategy", "none") == "none"
    assert prefetch.settings == {**disk.settings, "prefetch_strategy": "adaptive", "prefetch_ranker": "predictor"}
    assert by_name["fm-mixed-prefetch-lru"].settings["prefetch_ranker"] == "lru"
    for tokens, window, warm in ((8192, 2048, 2048), (2048, 512, 512), (512, 128, 128), (96, 16, 32)):
        knobs = knobs_for_disk_fraction(tokens, 0.5, disk.settings)
        assert (knobs["active_window"], knobs["warm_tokens"]) == (window, warm), tokens
        assert {k: v for k, v in knobs.items() if k not in ("active_window", "warm_tokens")} == disk.settings
    assert knobs_for_disk_fraction(20000, 0.5, {})["active_window"] == 2048  # the engine's default at most
    with pytest.raises(ConfigError, match="disk_fraction"):
        knobs_for_disk_fraction(8192, 1.0, {})
