"""The playground in a real headless browser against a local gateway with the bundled model: an
answer streams in; a tool call goes round (the page answers it with the output typed into it); a
schema-constrained answer; a conversation continued by previous_response_id and by a reopened
Conversation; the same model through Chat Completions and Messages. One server and one browser
for the module. Screenshots: build/screenshots/playground-*.png."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.support import Kiln

from .browser import PHONE, all_by_testid, by_testid, console_errors, screenshot, too_wide, wait_for

pytestmark = pytest.mark.e2e
USAGE = re.compile(r"\d+ in( \(\d+ cached\))? / \d+ out")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    kiln = Kiln(tmp_path_factory.mktemp("playground"), worker_args=["--max-batch", "4"]).start()
    yield kiln
    kiln.stop()


@pytest.fixture
def page(browser, server):
    """The playground, freshly loaded, with the bundled model picked."""
    browser.get(server.base_url + "/")
    wait_for(browser, lambda d: by_testid(d, "model").get_attribute("value"), 30, "no model listed")
    set_value(browser, "temperature", "0")
    return browser


def set_value(driver, testid: str, value: str) -> None:
    field = by_testid(driver, testid)
    field.clear()
    field.send_keys(value)


def pick(driver, testid: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(by_testid(driver, testid)).select_by_value(value)


def ask(driver, text: str, turns: int) -> str:
    """Type ``text``, send it, wait until the ``turns``-th assistant turn has finished; its text."""
    set_value(driver, "prompt", text)
    by_testid(driver, "send").click()
    return finished(driver, turns)


def finished(driver, turns: int) -> str:
    def done(d):
        boxes = all_by_testid(d, "turn-assistant")
        status = by_testid(d, "status").text
        if len(boxes) >= turns and by_testid(d, "send").is_enabled() and not status.startswith("Streaming"):
            return boxes[turns - 1]
        return None

    box = wait_for(driver, done, 300, "the answer did not finish")
    errors = box.find_elements("css selector", "[data-testid='error']")
    assert not errors, errors[0].text
    return box.find_element("css selector", "[data-testid='answer']").text


def test_an_answer_streams_in_with_its_id_usage_and_timings(page, server):
    # Count the updates of the transcript while the answer arrives: a stream, not one write.
    page.execute_script(
        "window.__updates = 0; new MutationObserver(() => window.__updates++)"
        ".observe(document.querySelector('[data-testid=output]'), {subtree: true, childList: true, characterData: true});"
    )
    answer = ask(page, "Write one sentence about the sea.", 1)
    assert answer.strip()
    assert page.execute_script("return window.__updates") > 3
    response_id = by_testid(page, "response-id").text
    assert response_id.startswith("resp_")
    assert USAGE.fullmatch(by_testid(page, "usage").text), by_testid(page, "usage").text
    assert by_testid(page, "ttft").text.endswith("ms")
    stored = httpx.get(f"{server.base_url}/v1/responses/{response_id}", timeout=30).json()
    assert stored["output"][-1]["content"][0]["text"].strip() == answer.strip()
    assert console_errors(page) == []
    screenshot(page, "playground-answer")


def test_a_tool_call_round_trip(page, server):
    by_testid(page, "use-tools").click()
    pick(page, "tool-choice", "required")
    ask(page, "What's the weather in Paris?", 1)
    call = by_testid(page, "tool-call")
    assert "get_weather" in call.text
    json.loads(by_testid(page, "tool-args").text)  # the arguments the model gave, as JSON
    first_id = by_testid(page, "response-id").text
    pick(page, "tool-choice", "auto")
    set_value(page, "tool-output", '{"temperature": 21, "sky": "clear"}')
    screenshot(page, "playground-tool-call")
    by_testid(page, "send-tool-output").click()
    finished(page, 2)
    second_id = by_testid(page, "response-id").text
    assert second_id != first_id
    sent = httpx.get(f"{server.base_url}/v1/responses/{second_id}", timeout=30).json()
    assert sent["previous_response_id"] == first_id
    items = httpx.get(f"{server.base_url}/v1/responses/{second_id}/input_items", timeout=30).json()["data"]
    outputs = [i for i in items if i["type"] == "function_call_output"]
    assert outputs and json.loads(outputs[0]["output"]) == {"temperature": 21, "sky": "clear"}


def test_a_schema_constrained_answer(page):
    by_testid(page, "use-schema").click()
    schema = json.loads(by_testid(page, "schema").get_attribute("value"))
    answer = ask(page, "Name a big city and its population, as JSON.", 1)
    jsonschema.validate(json.loads(answer), schema)
    screenshot(page, "playground-schema")


def test_a_conversation_continues_and_reopens(page, server):
    ask(page, "My name is Ada. Say hello.", 1)
    first_id = by_testid(page, "response-id").text
    ask(page, "What is my name?", 2)
    second = httpx.get(f"{server.base_url}/v1/responses/{by_testid(page, 'response-id').text}", timeout=30).json()
    assert second["previous_response_id"] == first_id

    by_testid(page, "new-chat").click()
    pick(page, "continuation", "conversation")
    ask(page, "Remember the colour teal.", 1)
    ask(page, "Which colour did I mention?", 2)
    entry = wait_for(page, lambda d: all_by_testid(d, "reopen"), 10)[0]
    conversation_id = entry.get_attribute("data-id")
    items = httpx.get(f"{server.base_url}/v1/conversations/{conversation_id}/items?order=asc", timeout=30).json()["data"]
    users = [i["content"][0]["text"] for i in items if i.get("role") == "user"]
    assert users == ["Remember the colour teal.", "Which colour did I mention?"]

    page.refresh()  # the list outlives the page; the items come back from the server
    wait_for(page, lambda d: by_testid(d, "model").get_attribute("value"), 30)
    by_testid(page, "reopen").click()
    wait_for(page, lambda d: len(all_by_testid(d, "turn-user")) == 2, 30, "the conversation did not reopen")
    assert len(all_by_testid(page, "turn-assistant")) == 2
    ask(page, "And which city?", 3)  # goes on in the same conversation
    items = httpx.get(f"{server.base_url}/v1/conversations/{conversation_id}/items", timeout=30).json()["data"]
    assert sum(1 for i in items if i.get("role") == "user") == 3
    screenshot(page, "playground-conversation")


@pytest.mark.parametrize("api, prefix", [("chat", "chatcmpl"), ("messages", "msg_")])
def test_the_same_model_through_another_door(page, api, prefix):
    pick(page, "api", api)
    ask(page, "Say hello.", 1)
    assert by_testid(page, "response-id").text.startswith(prefix)
    assert USAGE.fullmatch(by_testid(page, "usage").text), by_testid(page, "usage").text
    ask(page, "Say goodbye.", 2)  # the page sends the history again: these doors keep none
    assert console_errors(page) == []


def test_keyboard_and_phone_width(browser, server):
    from selenium.webdriver.common.keys import Keys

    browser.set_window_size(*PHONE)
    try:
        browser.get(server.base_url + "/")
        wait_for(browser, lambda d: by_testid(d, "model").get_attribute("value"), 30)
        prompt = by_testid(browser, "prompt")
        assert browser.find_element("css selector", "label[for='prompt']").is_displayed()
        prompt.send_keys("Say hi.")
        prompt.send_keys(Keys.CONTROL, Keys.ENTER)  # no mouse: Ctrl+Enter sends
        finished(browser, 1)
        assert too_wide(browser) == []
        screenshot(browser, "playground-phone")
    finally:
        browser.set_window_size(1280, 1000)
