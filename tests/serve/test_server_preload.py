"""POST /v1/preload: a restarted server brings a conversation's cached KV up before its next turn
(by prompt, chat messages or saved session), authenticated like the rest; bad bodies are 400s."""

from __future__ import annotations

import httpx

from tests.engine.test_prefix_persistence import KNOBS
from tests.engine.test_preload import PROMPT
from tests.serve.conftest import live_server

AUTH = {"Authorization": "Bearer k"}
BODY = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0}


def test_a_restarted_server_preloads_a_conversation_and_answers_the_same(tiny_llama, tmp_path):
    kwargs = dict(model_path=str(tiny_llama), cold_zone_dir=str(tmp_path), **KNOBS)
    with live_server(kwargs, served_model_name="tiny", api_key="k") as server:
        with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as http:
            expected = http.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
    with live_server(kwargs, served_model_name="tiny", api_key="k") as server:
        with httpx.Client(base_url=server.url, timeout=60) as anonymous:
            assert anonymous.post("/v1/preload", json={"prompt": PROMPT}).status_code == 401
        with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as http:
            r = http.post("/v1/preload", json={"prompt": PROMPT, "timeout_ms": 5000})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "preload" and body["complete"] and body["blocks_restored"] > 0
            assert body["cached_tokens"] > 0 and body["stopped"] is None
            assert http.post("/v1/completions", json=BODY).json()["choices"][0]["text"] == expected
            chat = http.post("/v1/preload", json={"messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 200 and chat.json()["blocks"] == 0
            for bad in ({}, {"prompt": "a", "session": "b"}, {"prompt": "a", "timeout_ms": 0}):
                assert http.post("/v1/preload", json=bad).status_code == 400, bad
            missing = http.post("/v1/preload", json={"session": "nope"})
            assert missing.status_code == 400 and "no session named 'nope'" in missing.text
