"""What the Open Responses compliance suite (openresponses/openresponses, ``bin/compliance-test.ts``)
asks of a server, restated as our own checks so the repository never carries its code.

The suite posts 17 requests (seven over WebSocket) all at once, waits at most 30 s for each
WebSocket turn's terminal frame, and validates every Response against the Open Responses schema,
which requires ``background`` on every Response (Kiln adds it with ``--echo-background``). Each
check below names the suite test it mirrors; ``run_all`` runs them concurrently as the suite
does and returns, per test id, the problems found (an empty list: passed).

The schema here is OpenAI's (../shared/conformance), which the Open Responses schema follows for
the fields these tests touch; ``background`` is checked separately because OpenAI's schema lets a
server leave it out and the suite's does not.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets.sync.client

from tests.conformance import assert_api_object, assert_response, assert_stream
from tests.conformance.websocket import assert_ws_frame

# The suite's wait for a WebSocket turn's terminal frame; a busier machine than the suite assumes
# may widen it (KILN_OPEN_RESPONSES_TURN_TIMEOUT), which the report of a run should then say.
TURN_TIMEOUT_S = float(os.environ.get("KILN_OPEN_RESPONSES_TURN_TIMEOUT", "30"))
TERMINAL = ("response.completed", "response.incomplete", "response.failed")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a location",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"}},
        "required": ["location"],
    },
}
# A 1x1 PNG (the suite sends a small inline image of its own): a text-only model must refuse it clearly.
TINY_PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


class Problem(Exception):
    """A check failed; the message says what the suite would have reported."""


@dataclass
class Checks:
    base_url: str
    model: str
    want_background: bool = True
    durations: dict[str, float] = field(default_factory=dict)

    # -- helpers ---------------------------------------------------------------------------
    def _response_ok(self, obj: Any, what: str = "") -> dict:
        if not isinstance(obj, dict):
            raise Problem(f"{what}no Response object: {str(obj)[:300]}")
        try:
            assert_response(obj)
        except AssertionError as exc:
            raise Problem(f"{what}schema: {str(exc)[:400]}") from None
        if self.want_background and "background" not in obj:
            raise Problem(f"{what}background: Required (the suite's schema wants the key on every Response)")
        return obj

    def _completed_with_output(self, obj: Any, what: str = "") -> dict:
        obj = self._response_ok(obj, what)
        if obj.get("status") != "completed":
            raise Problem(f"{what}status {obj.get('status')!r}, expected 'completed' ({obj.get('incomplete_details') or obj.get('error')})")
        if not obj.get("output"):
            raise Problem(f"{what}no output items")
        return obj

    def _post(self, path: str, body: dict, timeout: float = 600) -> httpx.Response:
        return httpx.post(self.base_url + "/v1" + path, json=body, headers={"Authorization": "Bearer sk-local"}, timeout=timeout)

    def _socket(self) -> Any:
        url = self.base_url.replace("http://", "ws://") + "/v1/responses"
        return websockets.sync.client.connect(url, additional_headers={"Authorization": "Bearer sk-local"}, max_size=None, open_timeout=30)

    def _turn(self, ws: Any, body: dict) -> tuple[dict | None, dict | None]:
        """(final Response, error frame) of one response.create, within the suite's 30 s."""
        ws.send(json.dumps({"type": "response.create", **body}))
        deadline = time.monotonic() + TURN_TIMEOUT_S
        frames: list[dict] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Problem(f"no terminal frame within {TURN_TIMEOUT_S:.0f} s ({len(frames)} frames)")
            try:
                frame = json.loads(ws.recv(timeout=left))
            except TimeoutError:
                raise Problem(f"no terminal frame within {TURN_TIMEOUT_S:.0f} s ({len(frames)} frames)") from None
            try:
                assert_ws_frame(frame)
            except AssertionError as exc:
                raise Problem(f"frame {frame.get('type')}: {str(exc)[:300]}") from None
            if frame.get("type") == "error":
                return None, frame
            frames.append(frame)
            if frame.get("type") in TERMINAL:
                try:
                    assert_stream(frames)
                except AssertionError as exc:
                    raise Problem(f"stream: {str(exc)[:300]}") from None
                return frame["response"], None

    def _error_code(self, response: dict | None, error: dict | None) -> str | None:
        if error is not None:
            return (error.get("error") or {}).get("code")
        return ((response or {}).get("error") or {}).get("code")

    # -- the suite's tests, by id ----------------------------------------------------------
    def basic_response(self) -> None:
        r = self._post("/responses", {"model": self.model, "input": [{"type": "message", "role": "user", "content": "Say hello in exactly 3 words."}]})
        self._status(r, 200)
        self._completed_with_output(r.json())

    def assistant_phase(self) -> None:
        r = self._post("/responses", {"model": self.model, "input": [
            {"type": "message", "role": "assistant", "phase": "commentary", "content": "I should answer with the saved number."},
            {"type": "message", "role": "assistant", "phase": "final_answer", "content": "The number is four."},
            {"type": "message", "role": "user", "content": "Repeat only the number."},
        ]})
        self._status(r, 200)
        self._completed_with_output(r.json())

    def streaming_response(self) -> None:
        body = {"model": self.model, "input": [{"type": "message", "role": "user", "content": "Count from 1 to 5."}], "stream": True}
        events: list[dict] = []
        with httpx.stream("POST", self.base_url + "/v1/responses", json=body, headers={"Authorization": "Bearer sk-local"}, timeout=600) as r:
            self._status(r, 200)
            for line in r.iter_lines():
                if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                    events.append(json.loads(line[6:]))
        if not events:
            raise Problem("no streaming events")
        try:
            assert_stream(events)
        except AssertionError as exc:
            raise Problem(f"stream: {str(exc)[:300]}") from None
        self._completed_with_output(events[-1]["response"])

    def system_prompt(self) -> None:
        r = self._post("/responses", {"model": self.model, "input": [
            {"type": "message", "role": "system", "content": "You are a pirate. Always respond in pirate speak."},
            {"type": "message", "role": "user", "content": "Say hello."},
        ]})
        self._status(r, 200)
        self._completed_with_output(r.json())

    def tool_calling(self) -> None:
        r = self._post("/responses", {"model": self.model, "tools": [WEATHER], "input": [
            {"type": "message", "role": "user", "content": "What's the weather like in San Francisco?"}]})
        self._status(r, 200)
        obj = self._response_ok(r.json())
        if not any(item.get("type") == "function_call" for item in obj.get("output") or []):
            raise Problem(f"no function_call item in output: {[i.get('type') for i in obj.get('output') or []]}")

    def image_input(self) -> None:
        """Kiln serves text-only models: the right answer is a clear 400, which the suite counts
        as a failure (it wants a completed answer)."""
        r = self._post("/responses", {"model": self.model, "input": [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
            {"type": "input_image", "image_url": TINY_PNG}]}]})
        raise Problem(f"HTTP {r.status_code}: {r.text[:300]}")

    def multi_turn(self) -> None:
        r = self._post("/responses", {"model": self.model, "input": [
            {"type": "message", "role": "user", "content": "My name is Alice."},
            {"type": "message", "role": "assistant", "content": "Hello Alice! Nice to meet you. How can I help you today?"},
            {"type": "message", "role": "user", "content": "What is my name?"},
        ]})
        self._status(r, 200)
        self._completed_with_output(r.json())

    def compact_response(self) -> None:
        r = self._post("/responses/compact", {"model": self.model, "prompt_cache_key": "openresponses-compact-test", "input": [
            {"type": "message", "role": "user", "content": "We agreed to launch on Tuesday and notify support first."},
            {"type": "message", "role": "assistant", "content": "Understood. The launch is Tuesday, with support notified beforehand."},
        ]})
        self._status(r, 200)
        obj = r.json()
        try:
            assert_api_object("CompactResource", obj)
        except AssertionError as exc:
            raise Problem(f"CompactResource: {str(exc)[:400]}") from None
        if obj.get("object") != "response.compaction":
            raise Problem(f"object {obj.get('object')!r}")
        if not any(i.get("type") == "compaction" for i in obj.get("output") or []):
            raise Problem("no compaction item")

    def compact_missing_model(self) -> None:
        r = self._post("/responses/compact", {"input": [{"type": "message", "role": "user", "content": "Compact this conversation."}]})
        if r.status_code not in (400, 422):
            raise Problem(f"HTTP {r.status_code}, expected 400 or 422")

    def websocket_response(self) -> None:
        with self._socket() as ws:
            response, error = self._turn(ws, {"model": self.model, "input": [{"type": "message", "role": "user", "content": "Count from 1 to 3."}]})
        if error:
            raise Problem(f"error frame {error}")
        self._completed_with_output(response)

    def websocket_sequential_responses(self) -> None:
        with self._socket() as ws:
            for n, word in enumerate(("first", "second"), 1):
                response, error = self._turn(ws, {"model": self.model, "store": False, "input": f"Reply with exactly: {word}"})
                if error:
                    raise Problem(f"turn {n}: error frame {error}")
                self._completed_with_output(response, f"turn {n}: ")

    def websocket_continuation(self) -> None:
        with self._socket() as ws:
            first, error = self._turn(ws, {"model": self.model, "store": False, "input": "Remember the code word: cobalt. Reply with OK."})
            if error or not first or not first.get("id"):
                raise Problem(f"first turn: {error or first}")
            self._response_ok(first, "first turn: ")
            second, error = self._turn(ws, {"model": self.model, "store": False, "previous_response_id": first["id"], "input": "What is the code word? Reply with only the code word."})
        if error:
            raise Problem(f"continuation: error frame {error}")
        self._completed_with_output(second, "continuation: ")

    def websocket_reconnect_store_false_recovery(self) -> None:
        with self._socket() as ws:
            first, error = self._turn(ws, {"model": self.model, "store": False, "input": "Remember the code word: copper. Reply with OK."})
        if error or not first or not first.get("id"):
            raise Problem(f"first turn: {error or first}")
        self._response_ok(first, "first turn: ")
        with self._socket() as ws:
            response, error = self._turn(ws, {"model": self.model, "store": False, "previous_response_id": first["id"], "input": "Try to continue after reconnect. Reply with exactly: reconnected"})
            code = self._error_code(response, error)
            if code != "previous_response_not_found":
                raise Problem(f"reconnected continuation: code {code!r}, expected previous_response_not_found")
            response, error = self._turn(ws, {"model": self.model, "store": False, "input": [{"type": "message", "role": "user", "content": "The previous store:false chain could not continue after reconnect. Start a new response and reply with exactly: recovered"}]})
        if error:
            raise Problem(f"recovery: error frame {error}")
        self._completed_with_output(response, "recovery: ")

    def websocket_previous_response_not_found(self) -> None:
        with self._socket() as ws:
            response, error = self._turn(ws, {"model": self.model, "store": False, "previous_response_id": f"resp_openresponses_missing_{int(time.time() * 1000)}", "input": "This should fail because the previous response is missing."})
        code = self._error_code(response, error)
        if code != "previous_response_not_found":
            raise Problem(f"code {code!r}, expected previous_response_not_found")

    def websocket_failed_continuation_evicts_cache(self) -> None:
        with self._socket() as ws:
            first, error = self._turn(ws, {"model": self.model, "store": False, "input": "Remember the code word: ember. Reply with OK."})
            if error or not first or not first.get("id"):
                raise Problem(f"first turn: {error or first}")
            self._response_ok(first, "first turn: ")
            response, error = self._turn(ws, {"model": self.model, "store": False, "previous_response_id": first["id"], "input": [
                {"type": "function_call_output", "call_id": "call_openresponses_missing", "output": "No matching tool call exists in the previous response."}]})
            if error is None and self._error_code(response, None) is None and (response or {}).get("status") != "failed":
                raise Problem(f"the unmatched function_call_output was accepted (status {(response or {}).get('status')!r})")
            response, error = self._turn(ws, {"model": self.model, "store": False, "previous_response_id": first["id"], "input": "Try to continue after the failed turn. Reply with exactly: stale"})
        code = self._error_code(response, error)
        if code != "previous_response_not_found":
            raise Problem(f"retry after the failed continuation: code {code!r}, expected previous_response_not_found")

    def websocket_compact_new_chain(self) -> None:
        r = self._post("/responses/compact", {"model": self.model, "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Remember the compaction code word: slate."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "OK."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Compress this conversation for later continuation."}]},
        ]})
        self._status(r, 200, "compact: ")
        output = r.json().get("output")
        if not isinstance(output, list):
            raise Problem("compact: no output array")
        with self._socket() as ws:
            response, error = self._turn(ws, {"model": self.model, "store": False, "tools": [], "input": [
                *output, {"type": "message", "role": "user", "content": "Continue from here. Reply with exactly: compacted"}]})
        if error:
            raise Problem(f"error frame {error}")
        self._completed_with_output(response)

    def _status(self, r: httpx.Response, want: int, what: str = "") -> None:
        if r.status_code != want:
            r.read()
            raise Problem(f"{what}HTTP {r.status_code}: {r.text[:300]}")

    # -- running ---------------------------------------------------------------------------
    def tests(self) -> dict[str, Callable[[], None]]:
        """Every suite test that reaches the server (its ``response-output-phase-schema`` test
        only validates a fixture of its own and sends nothing)."""
        return {
            "basic-response": self.basic_response,
            "assistant-phase": self.assistant_phase,
            "streaming-response": self.streaming_response,
            "websocket-response": self.websocket_response,
            "websocket-sequential-responses": self.websocket_sequential_responses,
            "websocket-continuation": self.websocket_continuation,
            "websocket-reconnect-store-false-recovery": self.websocket_reconnect_store_false_recovery,
            "websocket-previous-response-not-found": self.websocket_previous_response_not_found,
            "websocket-failed-continuation-evicts-cache": self.websocket_failed_continuation_evicts_cache,
            "websocket-compact-new-chain": self.websocket_compact_new_chain,
            "system-prompt": self.system_prompt,
            "tool-calling": self.tool_calling,
            "image-input": self.image_input,
            "multi-turn": self.multi_turn,
            "compact-response": self.compact_response,
            "compact-missing-model": self.compact_missing_model,
        }

    def run_one(self, name: str) -> list[str]:
        """One test's problems (empty: passed); how long it took goes to ``durations``."""
        start = time.monotonic()
        try:
            self.tests()[name]()
            problems: list[str] = []
        except Problem as exc:
            problems = [str(exc)]
        except Exception as exc:  # a transport failure is a failed test, as in the suite
            problems = [f"{type(exc).__name__}: {exc}"]
        self.durations[name] = time.monotonic() - start
        return problems

    def run_all(self) -> dict[str, list[str]]:
        """All at once, as the suite runs them; per test id, its problems (empty: passed)."""
        names = list(self.tests())
        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            return dict(zip(names, pool.map(self.run_one, names)))
