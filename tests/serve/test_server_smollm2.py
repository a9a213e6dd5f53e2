"""The embedded SmolLM2 behind the server, through the openai client: a real answer, streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.conftest import live_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_smollm2_answers_a_chat_question_streamed_and_not(smollm2_path):
    with live_server(dict(model_path=str(smollm2_path), max_num_seqs=4)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        [model] = [m.id for m in client.models.list().data]
        assert model == "SmolLM2-135M-Instruct.Q4_1"
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
        answer = r.choices[0].message.content
        assert "Paris" in answer
        chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
        usage = chunks[-1].usage
        assert usage.prompt_tokens == r.usage.prompt_tokens and usage.completion_tokens == r.usage.completion_tokens
        # The template's prompt, counted as /tokenize counts it.
        count = httpx.post(server.url + "/tokenize", json={"messages": QUESTION}).json()["count"]
        assert usage.prompt_tokens == count
        text = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                         temperature=0).choices[0].text
        assert "Paris" in text
        assert server.wait_until(server.kv_idle)
