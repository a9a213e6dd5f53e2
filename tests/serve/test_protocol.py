"""The OpenAI request models as the chat template receives them."""

from __future__ import annotations

from flashmemory.serve.protocol import ChatMessage, template_messages


def test_a_message_s_name_reaches_the_template_and_developer_is_system():
    messages = [ChatMessage(role="developer", content="Be brief."),
                ChatMessage(role="user", content="Hi", name="ada")]
    assert template_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ada"},
    ]
