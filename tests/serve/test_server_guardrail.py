"""The guardrail through the server: a flagged choice ends with finish_reason content_filter and
vLLM's stop_reason naming the label, streamed and not; the checks are on /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from flashmemory.guardrail import loader
from tests.guardrail.fakes import FlagWords
from tests.serve.conftest import TINY_KV, live_server
from tests.serve.test_budget_metrics import P, families, sample

BODY = {"prompt": "one two three four", "max_tokens": 32, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def plain_text(tiny_llama):
    kwargs = dict(model_path=str(tiny_llama), **TINY_KV)
    with live_server(kwargs, served_model_name="tiny") as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            return http.post("/v1/completions", json=BODY).json()["choices"][0]["text"]


def test_a_flagged_choice_ends_with_content_filter_streamed_and_not(tiny_llama, plain_text):
    word = plain_text[len(plain_text) // 2:].strip()[:2]
    assert word
    classifier = FlagWords(word)
    mp = pytest.MonkeyPatch()
    mp.setattr(loader, "load_guardrail", lambda path, precision: classifier)
    kwargs = dict(model_path=str(tiny_llama), **TINY_KV, guardrail_path="toxic-comment-classifier",
                  guardrail_chunk_tokens=4)
    try:
        with live_server(kwargs, served_model_name="tiny") as server:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                choice = http.post("/v1/completions", json=BODY).json()["choices"][0]
                assert choice["finish_reason"] == "content_filter"
                assert choice["stop_reason"] == "guardrail: bad (1.00)"
                assert plain_text.startswith(choice["text"]) and word not in choice["text"]
                streaming = http.post("/v1/completions", json={**BODY, "stream": True})
                lines = streaming.text.splitlines()
                events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
                streamed = "".join(e["choices"][0]["text"] for e in events)
                assert streamed == choice["text"]
                assert [x for x in lines if x][-1] == "data: [DONE]"
                assert events[-1]["choices"][0]["finish_reason"] == "content_filter"
                assert server.wait_until(server.kv_idle)
                m = families(http.get("/metrics").text)
                assert sample(m[P + "guardrail_checks"], result="flagged") == 2
                assert sample(m[P + "request_success"], finished_reason="content_filter") == 2
                assert P + "guardrail_check_seconds" in m and P + "guardrail_timeouts" in m
    finally:
        mp.undo()


def test_the_real_classifier_runs_in_the_server(tiny_llama):
    """guardrail_path='toxic-comment-classifier' as users set it: every check of the tiny model's
    text is decided by the real BiLSTM on the server's pool and counted on /metrics."""
    from flashmemory.errors import ConfigError
    from flashmemory.guardrail.loader import INSTALL, packaged_classifier_folder

    try:
        packaged_classifier_folder()
    except ConfigError:
        pytest.skip(INSTALL)
    kwargs = dict(model_path=str(tiny_llama), **TINY_KV, guardrail_path="toxic-comment-classifier",
                  guardrail_timeout_ms=2000)
    with live_server(kwargs, served_model_name="tiny") as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/completions", json=BODY)
            assert r.status_code == 200
            assert r.json()["choices"][0]["finish_reason"] in ("length", "content_filter")
            m = families(http.get("/metrics").text)
            decided = sum(sample(m[P + "guardrail_checks"], result=x)
                          for x in ("pass", "flagged", "timeout", "error"))
            assert decided >= 1 and sample(m[P + "guardrail_checks"], result="error") == 0
