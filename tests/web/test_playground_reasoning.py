"""Reasoning in the playground, through each door, in a real headless browser: the scripted engine
(named as such; it starts in a second, no weights) replays a reasoning model's text, and the page
shows the thinking in its fold apart from the answer. Screenshot: build/screenshots/playground-reasoning.png."""

from __future__ import annotations

import pytest

from tests.support import Kiln

from .browser import by_testid, console_errors, screenshot, wait_for
from .test_playground import ask, pick

THINKING = "<think>The user greets me, so I greet back.</think>Hello there!"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    kiln = Kiln(tmp_path_factory.mktemp("reasoning"), worker_args=["--engine", "scripted", "--scripted-reply", THINKING, "--scripted-delay", "0.01"]).start(timeout=60)
    yield kiln
    kiln.stop()


@pytest.mark.parametrize("api", ["responses", "chat", "messages"])
def test_reasoning_shows_apart_from_the_answer(browser, server, api):
    browser.get(server.base_url + "/")
    wait_for(browser, lambda d: by_testid(d, "model").get_attribute("value"), 30, "no model listed")
    pick(browser, "api", api)
    assert ask(browser, "Hi!", 1).strip() == "Hello there!"
    fold = by_testid(browser, "reasoning")
    assert fold.is_displayed()
    fold.click()  # open it (a <details>: Enter or a click)
    assert "The user greets me, so I greet back." in fold.text
    assert console_errors(browser) == []
    if api == "responses":
        screenshot(browser, "playground-reasoning")
