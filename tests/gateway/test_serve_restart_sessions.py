"""``kiln serve`` restarted under a working session, with the scripted engine (named as such: it
"thinks" on demand, which the bundled model does not, and its load can be made slow).

- A reasoning item (``encrypted_content`` sealed by the first server) and a compaction item
  carried by the client still work after a restart with the same data directory; with another
  data directory (another key) the reasoning is refused and the compaction, client data, is not.
- The first run through every door with a slow model load: 503 model_loading until ready, never
  404 (tests/e2e/test_first_run_real_model.py does the same with the real model).
"""

from __future__ import annotations

import httpx

from tests.e2e.test_first_run_real_model import Serve, check_first_run, poll_every_door, start_serve
from tests.support import wait_until

MODEL = "kiln-scripted"
THINKING = "<think>The user greets me.</think>Hello there!"


def _history(turns: int) -> list[dict]:
    items: list[dict] = []
    for t in range(turns):
        items += [{"role": "user", "content": f"question {t} " + "x" * 300}, {"role": "assistant", "content": f"answer {t} " + "y" * 300}]
    return items + [{"role": "user", "content": "latest question"}]


def _serve(tmp_path, data_dir, name: str) -> Serve:
    serve = start_serve(tmp_path, "--engine", "scripted", "--scripted-reply", THINKING, "--data-dir", str(data_dir), name=name)
    assert wait_until(lambda: serve.ready_at() is not None or serve.process.poll() is not None, 120), serve.console()
    assert serve.ready_at() is not None, serve.stderr_path.read_text()[-3000:]
    return serve


def test_reasoning_and_compaction_items_survive_a_restart(tmp_path):
    data = tmp_path / "data"
    first = _serve(tmp_path, data, "first")
    try:
        with httpx.Client(base_url=first.base, timeout=60) as c:
            answer = c.post("/v1/responses", json={"model": MODEL, "input": "hi", "include": ["reasoning.encrypted_content"], "store": False}).json()
            compacted = c.post("/v1/responses/compact", json={"model": MODEL, "input": _history(6), "keep_tokens": 400}).json()
    finally:
        assert first.stop() == 0
    reasoning, message = answer["output"]
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"].startswith("kiln1.")
    item = next(i for i in compacted["output"] if i["type"] == "compaction")
    carried = [{"role": "user", "content": "hi"}, reasoning, message, {"role": "user", "content": "again"}]

    second = _serve(tmp_path, data, "second")  # the same data directory: the same key
    try:
        with httpx.Client(base_url=second.base, timeout=60) as c:
            r = c.post("/v1/responses", json={"model": MODEL, "input": carried, "store": False})
            assert r.status_code == 200, r.text
            r = c.post("/v1/responses", json={"model": MODEL, "input": [item, {"role": "user", "content": "next"}], "store": False})
            assert r.status_code == 200, r.text
            r = c.post("/v1/responses/input_tokens", json={"model": MODEL, "input": compacted["output"]})
            assert r.status_code == 200, r.text
    finally:
        assert second.stop() == 0

    other = _serve(tmp_path, tmp_path / "other-data", "other")  # another key
    try:
        with httpx.Client(base_url=other.base, timeout=60) as c:
            r = c.post("/v1/responses", json={"model": MODEL, "input": carried, "store": False})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].encrypted_content", r.text
            r = c.post("/v1/responses", json={"model": MODEL, "input": [item, {"role": "user", "content": "next"}], "store": False})
            assert r.status_code == 200, r.text  # client data, whatever the key
    finally:
        assert other.stop() == 0


def test_first_run_with_a_slow_load_answers_loading_on_every_door(tmp_path):
    serve = start_serve(tmp_path, "--engine", "scripted", "--scripted-load-delay", "6", "--data-dir", str(tmp_path / "data"))
    try:
        answers = poll_every_door(serve, MODEL, timeout=180)
        check_first_run(serve, answers)
        assert sum(a.loading for a in answers if a.door == "websocket") >= 1
        assert {a.door for a in answers if a.loading} >= {"responses", "messages", "messages.count_tokens", "chat.completions", "completions", "responses.input_tokens"}
    finally:
        assert serve.stop() == 0
