"""Every error path answers OpenAI-shaped JSON with the right status, from one place, and never a traceback."""

from __future__ import annotations

import openai
import pytest

ERROR_KEYS = {"message", "type", "param", "code"}


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"temperature": -1}, "temperature", "temperature"),
        ({"top_p": 2}, "top_p", "top_p"),
        ({"top_k": -5}, "top_k", "top_k"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"max_tokens": "many"}, "max_tokens", "integer"),
        ({"n": 0}, "n", "n must be between"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"logprobs": 2}, "logprobs", "not supported"),
        ({"echo": True}, "echo", "not supported"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(http, body, param, fragment):
    r = http.post("/v1/completions", json={"prompt": "hi", **body})
    assert r.status_code == 400
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and err["param"] == param and fragment in err["message"]


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b'{"max_tokens": 3}', "prompt")],
)
def test_malformed_bodies_are_400(http, raw, fragment):
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and fragment in error_of(r)["message"]


def test_empty_prompt_is_400(http):
    for prompt in ("", []):
        r = http.post("/v1/completions", json={"prompt": prompt})
        assert r.status_code == 400 and "empty" in error_of(r)["message"]
    r = http.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"


def test_token_ids_outside_the_vocabulary_are_400(http):
    r = http.post("/v1/completions", json={"prompt": [5, 999_999]})
    assert r.status_code == 400 and "outside the vocabulary" in error_of(r)["message"]
    r = http.post("/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and "outside the vocabulary" in error_of(r)["message"]


def test_prompt_over_the_context_uses_vllms_wording(client, caplog):
    caplog.set_level("ERROR")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5] * 250, max_tokens=10)
    err = e.value.body
    assert e.value.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["message"].startswith("This model's maximum context length is 256 tokens. However, you requested "
                                     "260 tokens (250 in the prompt, 10 in the completion).")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 300}])
    assert "maximum context length is 256 tokens" in e.value.body["message"] and "in the messages" in \
        e.value.body["message"]
    # An expected error is answered, not raised through the server (which would drop the keep-alive connection).
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_max_tokens_and_n_above_the_server_caps_are_400(http, tiny_server):
    cfg = tiny_server.state.config
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": cfg.max_tokens_limit + 1})
    assert r.status_code == 400 and "--max-tokens-limit" in error_of(r)["message"]
    r = http.post("/v1/completions", json={"prompt": "hi", "n": cfg.max_n + 1})
    assert r.status_code == 400 and "--max-n" in error_of(r)["message"]


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-9" in e.value.body["message"]
    r = http.post("/tokenize", json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404


def test_unknown_route_and_wrong_method_are_openai_shaped(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and error_of(r)["type"] == "not_found_error"
    r = http.get("/v1/completions")
    assert r.status_code == 405 and error_of(r) and r.headers["allow"] == "POST"


def test_oversized_body_is_413_with_or_without_content_length(http, tiny_server):
    limit = tiny_server.state.config.max_body_bytes
    big = b'{"prompt": "' + b"a" * (limit + 10) + b'"}'
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"

    def chunked():  # no Content-Length: the body is counted as it arrives
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


def test_unsupported_content_parts_are_400(http):
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and "only text parts" in error_of(r)["message"]
    text = {"type": "text", "text": "hello"}
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [text]}], "max_tokens": 2})
    assert r.status_code == 200


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
FUNCTION = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}


def test_functions_field_is_refused_with_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=2,
                                       functions=[FUNCTION])
    err = e.value.body
    assert err["param"] == "functions" and err["code"] == "unsupported_parameter"
    assert "functions is not supported" in err["message"] and "remove it" in err["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": FUNCTION}]),
        ("tool_choice", "auto"),
        ("tool_choice", {"type": "function", "function": {"name": "get_weather"}}),
        ("function_call", "auto"),
        ("function_call", {"name": "get_weather"}),
        ("parallel_tool_calls", False),
        ("response_format", {"type": "json_object"}),
        ("top_logprobs", 2),
        ("modalities", ["text", "audio"]),
        ("web_search_options", {}),
    ],
)
def test_unsupported_chat_field_is_refused_with_400_naming_it(http, field, value):
    r = http.post("/v1/chat/completions", json={**CHAT, field: value})
    assert r.status_code == 400
    err = error_of(r)
    assert err["param"] == field and err["code"] == "unsupported_parameter"
    assert "not supported" in err["message"]


def test_unsupported_fields_at_their_inert_values_are_accepted(http):
    inert = {"tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
             "logprobs": False, "response_format": {"type": "text"}, "modalities": ["text"],
             "presence_penalty": 0, "parallel_tool_calls": None}
    r = http.post("/v1/chat/completions", json={**CHAT, **inert})
    assert r.status_code == 200, r.text


def test_tool_call_history_in_messages_is_refused_with_400_naming_it(http):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    for route, body in (("/v1/chat/completions", {**CHAT, "messages": messages}),
                        ("/tokenize", {"messages": messages})):
        r = http.post(route, json=body)
        assert r.status_code == 400, route
        err = error_of(r)
        assert err["param"] == "messages.1.tool_calls", route
        assert err["code"] == "unsupported_parameter", route
