"""Hub ids as model paths, against a local stand-in for the Hub (tests/model/fake_hub.py): a
safetensors repo by `org/name`, a GGUF repo by `org/name:QUANT` (the embedded SmolLM2 served as
one), both answering; the cache reused offline; and each failure naming what happened."""

from __future__ import annotations

import pytest

from flashmemory import FlashMemoryEngine
from flashmemory.errors import ModelNotFoundError
from flashmemory.model import hub as hub_module
from flashmemory.model.hub import HubId, choose_gguf, gguf_quant, resolve_hub_model
from tests.model.fake_hub import FakeHub, Repo


@pytest.fixture
def hub(tmp_path, tiny_llama, smollm2_path, monkeypatch):
    import huggingface_hub.constants as constants

    fake = FakeHub({
        "org/tiny": Repo({p.name: p for p in tiny_llama.iterdir() if p.is_file()}),
        "org/tiny-gguf": Repo({"tiny-Q4_1.gguf": smollm2_path, "tiny-Q8_0.gguf": smollm2_path,
                               "README.md": smollm2_path}),
        "org/gated": Repo({p.name: p for p in tiny_llama.iterdir() if p.is_file()}, gated=True),
    })
    endpoint = fake.start()  # what HF_ENDPOINT sets when huggingface_hub is imported
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hub_module, "_resolved", {})
    yield fake
    fake.stop()


@pytest.mark.parametrize("text,expected", [
    ("org/name", HubId("org/name")),
    ("bartowski/Qwen2.5-0.5B-GGUF:Q4_K_M", HubId("bartowski/Qwen2.5-0.5B-GGUF", quant="Q4_K_M")),
    ("org/name/model-q8_0.gguf", HubId("org/name", file="model-q8_0.gguf")),
    ("org/name@v1.0", HubId("org/name", revision="v1.0")),
    ("./org/name", None), ("/abs/path", None), ("model.gguf", None), ("a/b/c/d", None),
])
def test_hub_ids_parse_and_paths_do_not(text, expected):
    assert HubId.parse(text) == expected


def test_the_quantization_is_read_from_gguf_names_and_a_missing_one_lists_the_others():
    assert gguf_quant("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") == "Q4_K_M"
    assert gguf_quant("Model-IQ4_XS.gguf") == "IQ4_XS" and gguf_quant("m.F16.gguf") == "F16"
    files = ["a-Q4_K_M-00001-of-00002.gguf", "a-Q4_K_M-00002-of-00002.gguf", "a-Q8_0.gguf"]
    assert choose_gguf("org/a", files, "q4_k_m") == "a-Q4_K_M-00001-of-00002.gguf"
    with pytest.raises(ModelNotFoundError,
                       match="no GGUF file of quantization Q2_K; it has: Q4_K_M, Q8_0"):
        choose_gguf("org/a", files, "Q2_K")


def test_a_safetensors_repo_by_id_downloads_into_the_hf_cache_and_answers(hub, tmp_path):
    engine = FlashMemoryEngine(model_path="org/tiny", max_seq_len=64)
    assert str(engine.model_path).startswith(str(tmp_path / "hf-cache"))
    assert engine.generate("hello", max_new_tokens=4, ignore_eos=True)
    engine.close()


def test_a_gguf_repo_by_quant_picks_that_file_and_answers(hub):
    path = resolve_hub_model("org/tiny-gguf:Q8_0")
    assert path.name == "tiny-Q8_0.gguf"
    assert not any("tiny-Q4_1.gguf" in r for r in hub.requests)  # only the file asked for
    engine = FlashMemoryEngine(model_path="org/tiny-gguf:Q4_1", max_seq_len=64)
    assert engine.model_path.name == "tiny-Q4_1.gguf"
    assert engine.generate("The capital of France is", max_new_tokens=3)
    engine.close()
    with pytest.raises(ModelNotFoundError,
                       match="no GGUF file of quantization Q4_K_M; it has: Q4_1, Q8_0"):
        resolve_hub_model("org/tiny-gguf")  # the default quantization is not there


def test_a_split_gguf_is_refused_before_anything_is_fetched(hub, smollm2_path):
    hub.repos["org/split"] = Repo({"m-Q4_K_M-00001-of-00002.gguf": smollm2_path,
                                   "m-Q4_K_M-00002-of-00002.gguf": smollm2_path})
    with pytest.raises(ModelNotFoundError, match="split in 2 parts .*llama-gguf-split --merge"):
        resolve_hub_model("org/split:Q4_K_M")
    assert not any("/resolve/" in r for r in hub.requests)


def test_offline_the_cached_copy_is_used_and_an_uncached_repo_names_the_cache(hub, monkeypatch):
    import huggingface_hub.constants as constants

    online = resolve_hub_model("org/tiny")
    monkeypatch.setattr(hub_module, "_resolved", {})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.requests.clear()
    assert resolve_hub_model("org/tiny") == online and hub.requests == []  # no network at all
    with pytest.raises(ModelNotFoundError,
                       match=r"org/other is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_hub_model("org/other")


def test_failures_say_what_happened(hub):
    with pytest.raises(ModelNotFoundError,
                       match="org/missing was not found on the Hugging Face Hub"):
        FlashMemoryEngine(model_path="org/missing")
    with pytest.raises(ModelNotFoundError, match="org/gated is gated: .*set HF_TOKEN"):
        resolve_hub_model("org/gated")
    with pytest.raises(ModelNotFoundError, match="org/tiny has no file 'nope.gguf'"):
        resolve_hub_model("org/tiny/nope.gguf")
