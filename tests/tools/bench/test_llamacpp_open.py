"""How the bench opens llama.cpp: extra buffer types off where the CPU has AMX (its repack
segfaults there), an override by variable, the choice recorded; the real library if installed."""

from __future__ import annotations

import sys

import pytest

from flashmemory import cpu_features
from flashmemory.errors import ConfigError
from flashmemory.tools.bench import llamacpp_open
from flashmemory.tools.bench.llamacpp_open import EXTRA_BUFTS_ENV, load_choice, open_llama
from tests.tools.bench import fake_llama_cpp


@pytest.fixture
def fake_llama(monkeypatch):
    fake_llama_cpp.created.clear()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp)
    monkeypatch.delenv(EXTRA_BUFTS_ENV, raising=False)
    return fake_llama_cpp


ARGS = dict(model_path="m.gguf", n_ctx=64, n_batch=8, n_threads=1, n_threads_batch=1, type_k=1,
            type_v=1, flash_attn=False, logits_all=False, verbose=False)


def test_amx_turns_the_extra_buffer_types_off_for_the_load_only(fake_llama, monkeypatch):
    monkeypatch.setattr(cpu_features, "has_amx", lambda: True)
    choice = load_choice()
    assert not choice.extra_buffer_types and "AMX" in choice.why
    llm = open_llama(**ARGS)
    assert llm.use_extra_bufts is False
    # the library's own defaults are back once the model is loaded
    assert fake_llama.llama_model_default_params().use_extra_bufts is True


def test_without_amx_llama_cpp_keeps_its_default(fake_llama, monkeypatch):
    monkeypatch.setattr(cpu_features, "has_amx", lambda: False)
    assert load_choice().extra_buffer_types
    assert open_llama(**ARGS).use_extra_bufts is True


def test_the_variable_overrides_the_cpu(fake_llama, monkeypatch):
    monkeypatch.setattr(cpu_features, "has_amx", lambda: False)
    monkeypatch.setenv(EXTRA_BUFTS_ENV, "off")
    assert open_llama(**ARGS).use_extra_bufts is False
    assert load_choice().why == f"{EXTRA_BUFTS_ENV}=off"
    monkeypatch.setattr(cpu_features, "has_amx", lambda: True)
    monkeypatch.setenv(EXTRA_BUFTS_ENV, "on")
    assert open_llama(**ARGS).use_extra_bufts is True


def test_a_bad_value_names_the_choices(fake_llama, monkeypatch):
    monkeypatch.setenv(EXTRA_BUFTS_ENV, "maybe")
    with pytest.raises(ConfigError, match="auto, on, off"):
        load_choice()


def test_a_library_without_the_field_is_a_clear_error(fake_llama, monkeypatch):
    class OldParams:
        pass

    monkeypatch.setattr(fake_llama, "llama_model_default_params", OldParams)
    monkeypatch.setattr(cpu_features, "has_amx", lambda: True)
    with pytest.raises(ConfigError, match="no use_extra_bufts"):
        open_llama(**ARGS)


def test_the_machine_record_names_the_cpu_and_the_choice(monkeypatch):
    monkeypatch.delenv(EXTRA_BUFTS_ENV, raising=False)
    record = llamacpp_open.machine_record()
    assert record["cpu"]["model"] and isinstance(record["cpu"]["flags"], list)
    assert record["llamacpp_load"]["extra_buffer_types"] is not cpu_features.has_amx()


def test_the_real_library_decodes_with_extra_buffer_types_off(smollm2_path, monkeypatch):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed "
                                    "(bash scripts/install_llama_cpp.sh)")
    import numpy as np

    def last_logits(setting: str) -> np.ndarray:
        monkeypatch.setenv(EXTRA_BUFTS_ENV, setting)
        llm = open_llama(model_path=str(smollm2_path), n_ctx=64, n_batch=16, n_threads=1,
                         n_threads_batch=1, verbose=False)
        llm.eval([1, 504, 3458, 282, 4649, 314])
        last = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = np.ctypeslib.as_array(last, shape=(llm.n_vocab(),)).copy()
        llm.close()
        return logits

    off = last_logits("off")
    assert np.isfinite(off).all()
    if not cpu_features.has_amx():  # where the default load runs, both compute the same step
        on = last_logits("on")
        assert off.argmax() == on.argmax() and np.abs(off - on).max() < 0.5
