"""The server through the official `openai` client: models, completions and chat, streaming and not, with usage."""

from __future__ import annotations

import json

import openai
import pytest

from flashmemory import FlashMemoryEngine
from tests.serve.conftest import TINY_KV

PROMPT = "Alice was beginning"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The capital of France?"}]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> FlashMemoryEngine:
    """The same model and KV settings through the Python API, run in this thread."""
    return FlashMemoryEngine(model_path=str(tiny_llama), **TINY_KV)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == 256


def test_completion_matches_the_python_api_and_counts_usage(client, reference):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text == reference.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    assert r.usage.prompt_tokens == len(reference.tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_accepts_token_ids_and_several_prompts(client, reference):
    ids = reference.tokenizer.encode(PROMPT)
    r = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == reference.generate(ids, max_new_tokens=5, ignore_eos=True)
    assert r.usage.prompt_tokens == len(ids) + 3 and r.usage.completion_tokens == 10


def test_chat_applies_the_template_and_answers_as_the_assistant(client, reference):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    message = r.choices[0].message
    assert message.role == "assistant"
    assert message.content == reference.chat(MESSAGES, max_new_tokens=10)
    assert r.usage.prompt_tokens == len(reference.tokenizer.apply_chat_template(MESSAGES))
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_completion_equals_the_plain_one_and_ends_with_usage(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_chat_sends_the_role_first_and_the_finish_reason_last(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_sse_wire_format_ends_with_done(http):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_n_choices_with_a_seed_are_distinct_and_reproducible(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=11,
                  extra_body={"ignore_eos": True})
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == again.usage.prompt_tokens


def test_stop_string_ends_the_completion_before_it(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    # Two characters from the middle on that are whole characters: the random model's byte tokens also decode to
    # U+FFFD, which a stream holds back until the bytes complete, so a stop string of those may never match.
    start = next(i for i in range(len(full) // 2, 0, -1)
                 if "\ufffd" not in full[i : i + 2] and len(full[i : i + 2]) == 2)
    stop = full[start : start + 2]
    r = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert r.finish_reason == "stop" and r.text == full[: full.index(stop)]


def test_top_k_and_top_p_are_applied(client):
    # top_k=1 is greedy whatever the temperature.
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.5, top_p=0.9,
                                  extra_body={"ignore_eos": True, "top_k": 1})
    assert r.choices[0].text == greedy


def test_max_completion_tokens_limits_a_chat_answer(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_tokenize_and_detokenize_round_trip(http, reference):
    r = http.post("/tokenize", json={"model": "tiny", "prompt": PROMPT}).json()
    assert r["tokens"] == reference.tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == reference.tokenizer.apply_chat_template(MESSAGES)


def test_health_and_version(http):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
