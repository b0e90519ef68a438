"""``presence_penalty`` / ``frequency_penalty`` change greedy output on a repetitive prompt with
the bundled model, and are echoed on the Response (issue 15, point 0)."""

from __future__ import annotations

import httpx
import pytest

from tests.conformance import assert_response
from tests.support import Kiln

MODEL = "smollm2-135m-instruct"
PROMPT = "Repeat the word 'apple' twenty times, separated by spaces."


def _answer(http, **extra) -> dict:
    r = http.post("/v1/responses", json={"model": MODEL, "input": PROMPT, "temperature": 0, "max_output_tokens": 40, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_response(body)
    return body


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    """A server of this module's own, decoding with float32 activations: the assertions below
    compare greedy texts word for word, and the native step's 8-bit activations may flip a near tie
    (as in tests/worker/test_engine.py and test_multi_model.py)."""
    server = Kiln(tmp_path_factory.mktemp("penalties"), env={"KILN_NATIVE_ACTIVATIONS": "float32"}).start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=900) as client:
            yield client
    finally:
        server.stop()


def test_penalties_change_greedy_output(http):
    plain = _answer(http)
    again = _answer(http)
    text = lambda b: "".join(p["text"] for i in b["output"] if i["type"] == "message" for p in i["content"])  # noqa: E731
    assert text(plain) == text(again)  # greedy is repeatable
    frequency = _answer(http, frequency_penalty=2.0)
    presence = _answer(http, presence_penalty=2.0)
    assert frequency["frequency_penalty"] == 2.0 and presence["presence_penalty"] == 2.0
    assert text(frequency) != text(plain)
    assert text(presence) != text(plain)
    # Penalized text repeats its most frequent word less often.
    def top_count(t: str) -> int:
        words = t.lower().split()
        return max((words.count(w) for w in set(words)), default=0)

    assert top_count(text(frequency)) < top_count(text(plain))
