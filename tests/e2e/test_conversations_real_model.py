"""The Conversations API and ``item_reference`` with the bundled model and the OpenAI Python SDK
(issue 15): the state the SDKs keep on the server reaches the real model's prompt."""

from __future__ import annotations

import openai
import pytest

from tests.conformance import assert_api_object

MODEL = "smollm2-135m-instruct"


def test_conversation_two_turns_four_items(openai_client, http):
    conv = openai_client.conversations.create(metadata={"suite": "e2e"})
    a = openai_client.responses.create(model=MODEL, input="My name is Ada.", conversation=conv.id, max_output_tokens=16, temperature=0)
    b = openai_client.responses.create(model=MODEL, input="What is my name?", conversation=conv.id, max_output_tokens=16, temperature=0)
    # The second turn rendered the first: its prompt holds the first turn's input and reply.
    assert b.usage.input_tokens > a.usage.input_tokens + a.usage.output_tokens
    items = openai_client.conversations.items.list(conv.id, order="asc")
    assert [i.role for i in items.data] == ["user", "assistant", "user", "assistant"]
    assert_api_object("ConversationItemList", http.get(f"/v1/conversations/{conv.id}/items").json())
    assert openai_client.conversations.update(conv.id, metadata={"suite": "done"}).metadata == {"suite": "done"}
    assert openai_client.conversations.delete(conv.id).deleted


def test_item_references_are_rendered(openai_client):
    history: list[dict] = []
    responses = []
    for question in ("Name a fruit.", "Name a colour.", "Name an animal."):
        history.append({"role": "user", "content": question})
        response = openai_client.responses.create(model=MODEL, input=history, max_output_tokens=16, temperature=0)
        responses.append(response)
        history.append({"type": "item_reference", "id": response.output[0].id})
    # Each turn's prompt grew by the referenced reply (plus the new question), not by nothing.
    for before, after in zip(responses, responses[1:], strict=False):
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "msg_unknown"}])
