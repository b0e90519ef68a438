"""The Conversations API and ``item_reference`` inputs, driven by the OpenAI Python SDK (issue 15,
points 1 and 3).

Real gateway and worker processes; the scripted engine (named as such) plays the model, since
what is checked is the gateway's state: its byte tokenizer makes token counts exact, so they prove
which text was rendered. tests/e2e/test_conversations_real_model.py repeats the main path with
the bundled model.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conformance import assert_api_object, assert_error, assert_response
from tests.support import Kiln

MODEL = "kiln-scripted"
REPLY = "Hello from Kiln's scripted engine."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Kiln(tmp_path_factory.mktemp("conv"), worker_args=["--engine", "scripted"]).start(timeout=60)
    yield s
    s.stop()


@pytest.fixture
def sdk(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def _dump(obj) -> dict:
    return obj.model_dump(mode="json", exclude_unset=True)


def test_conversation_lifecycle_with_the_sdk(sdk, http):
    conv = sdk.conversations.create(metadata={"topic": "demo"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "demo"}
    assert_api_object("ConversationResource", _dump(conv))

    first = sdk.responses.create(model=MODEL, input="first question", conversation=conv.id, max_output_tokens=64)
    second = sdk.responses.create(model=MODEL, input="second question", conversation={"id": conv.id}, max_output_tokens=64)
    assert second.conversation.id == conv.id
    assert_response(http.get(f"/v1/responses/{second.id}").json())

    items = sdk.conversations.items.list(conv.id, order="asc")
    page = http.get(f"/v1/conversations/{conv.id}/items", params={"order": "asc"}).json()
    assert_api_object("ConversationItemList", page)
    kinds = [(i.type, i.role) for i in items.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "assistant")]
    texts = [i.content[0].text for i in items.data]
    assert texts == ["first question", first.output_text, "second question", second.output_text]
    # The assistant items are the responses' own output items, same ids.
    assert items.data[1].id == first.output[0].id and items.data[3].id == second.output[0].id

    # desc by default, with limit/after pagination
    newest = sdk.conversations.items.list(conv.id, limit=2)
    assert [i.id for i in newest.data] == [items.data[3].id, items.data[2].id] and newest.has_more
    rest = sdk.conversations.items.list(conv.id, limit=10, after=newest.data[-1].id)
    assert [i.id for i in rest.data] == [items.data[1].id, items.data[0].id] and not rest.has_more

    one = sdk.conversations.items.retrieve(items.data[0].id, conversation_id=conv.id)
    assert one.id == items.data[0].id
    assert_api_object("ConversationItem", _dump(one))

    updated = sdk.conversations.update(conv.id, metadata={"topic": "changed"})
    assert updated.metadata == {"topic": "changed"}
    assert sdk.conversations.retrieve(conv.id).metadata == {"topic": "changed"}

    deleted = sdk.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    assert_api_object("DeletedConversationResource", _dump(deleted))
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(conv.id)
    r = http.get(f"/v1/conversations/{conv.id}/items")
    assert r.status_code == 404
    assert_error(r.json())


def test_initial_and_added_items_are_rendered(sdk, http):
    conv = sdk.conversations.create(items=[{"type": "message", "role": "user", "content": "remember: blue"}])
    added = sdk.conversations.items.create(conv.id, items=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "noted"}]}])
    assert len(added.data) == 1 and added.data[0].role == "assistant"
    with_history = http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "q", "conversation": conv.id}).json()["input_tokens"]
    alone = http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "q"}).json()["input_tokens"]
    # Byte tokenizer: "user: remember: blue\n" + "assistant: noted\n"
    assert with_history - alone == len("user: remember: blue\n") + len("assistant: noted\n")

    gone = sdk.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert gone.id == conv.id
    assert_api_object("ConversationResource", _dump(gone))
    left = sdk.conversations.items.list(conv.id)
    assert [i.role for i in left.data] == ["user"]
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)


def test_item_reference_replays_stored_turns(sdk, http):
    """A three-turn chat that replays its assistant turns by reference, as SDKs do with store on."""
    history: list[dict] = []
    counts = []
    for turn in ("one", "two", "three"):
        history.append({"type": "message", "role": "user", "content": f"turn {turn}"})
        response = sdk.responses.create(model=MODEL, input=history, max_output_tokens=64)
        counts.append(response.usage.input_tokens)
        history.append({"type": "item_reference", "id": response.output[0].id})
    # Each reference rendered the full reply text: "assistant: <reply>\n" per earlier turn.
    reply = len(f"assistant: {REPLY}\n")
    assert counts[1] - counts[0] == len("user: turn two\n") + reply
    assert counts[2] - counts[1] == len("user: turn three\n") + reply

    # Input items keep stable ids: one seen in input_items can itself be referenced.
    listed = sdk.responses.input_items.list(response.id, order="asc")
    user_item = listed.data[0]
    again = sdk.responses.create(model=MODEL, input=[{"type": "item_reference", "id": user_item.id}], max_output_tokens=4)
    assert again.usage.input_tokens == counts[0]


def test_unknown_reference_is_400_naming_it(sdk, http):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "msg_nope"}, {"role": "user", "content": "x"}])
    assert "msg_nope" in caught.value.message
    r = http.post("/v1/responses", json={"model": MODEL, "input": [{"type": "item_reference", "id": "msg_nope"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].id"
    assert_error(r.json())


def test_conversation_errors(http):
    r = http.get("/v1/conversations/conv_missing")
    assert r.status_code == 404
    assert_error(r.json())
    r = http.post("/v1/conversations", json={"metadata": {"k": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
    r = http.post("/v1/conversations", json={"items": [{"type": "mystery"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "items[0].type"
    assert_error(r.json())


def test_unknown_conversation_on_create_is_404_and_starts_nothing(sdk, http):
    """As OpenAI: a create naming a conversation that does not exist is a 404, not a new one."""
    with pytest.raises(openai.NotFoundError) as err:
        sdk.responses.create(model=MODEL, input="hi", conversation="conv_nope", max_output_tokens=4)
    assert err.value.status_code == 404
    assert_error(err.value.response.json())
    assert http.get("/v1/conversations/conv_nope").status_code == 404


def test_empty_item_list_validates(sdk, http):
    conv = sdk.conversations.create()
    body = http.get(f"/v1/conversations/{conv.id}/items").json()
    assert body["data"] == [] and body["first_id"] == "" and body["last_id"] == ""
    assert_api_object("ConversationItemList", body)
    assert list(sdk.conversations.items.list(conv.id)) == []
