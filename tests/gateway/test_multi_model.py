"""``kiln serve --config``: several models behind one endpoint, each on its own workers, one of them loaded on demand."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kiln.protocol.model_config import ConfigError, load_config
from tests.conformance import assert_model_list
from tests.support import free_port, wait_until, worker_pids
from tests.worker.tiny_gguf import TOOLS_TEMPLATE

# Qwen3's way of carrying reasoning in history (<think> around reasoning_content): a template
# that knows a thinking block, so the worker reports the reasoning capability for this model.
THINKING_TEMPLATE = TOOLS_TEMPLATE.replace(
    "{% if m.content %}", "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n{% endif %}{% if m.content %}"
)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    import mlx.core as mx

    from kiln.worker.loading.loader import bundled_model_path
    from tests.worker.tiny_gguf import write_pair

    _, md = mx.load(str(bundled_model_path()), return_metadata=True)
    gguf_file, _ = write_pair("qwen3", "Q8_0", md, tmp_path_factory.mktemp("qwen3"), chat_template=THINKING_TEMPLATE)
    return gguf_file



def _health(base: str) -> list[dict]:
    try:
        return httpx.get(base + "/health", timeout=2).json()["workers"]
    except (httpx.HTTPError, ValueError):
        return []


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _gone(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_two_models_from_one_config(tmp_path, tiny_qwen3):
    from openai import OpenAI

    from kiln.worker.loading.loader import bundled_model_path

    config = tmp_path / "kiln.toml"
    config.write_text(f'''
[[models]]
id = "smollm2"
source = "{bundled_model_path()}"
aliases = ["small"]
workers = 1

[[models]]
id = "tiny-qwen3"
source = "{tiny_qwen3.name}"   # relative to the config file's folder
workers = 2
context_length = 512
max_batch = 2

[[models]]
id = "tiny-qwen3-later"
source = "{tiny_qwen3.name}"
load = "on-demand"
idle_stop = "5s"
''')
    (tmp_path / tiny_qwen3.name).symlink_to(tiny_qwen3)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    # The bundled model's greedy answer below is checked for a word; 8-bit activations may flip a
    # near tie (the build check bounds their error, not the argmax): on its blocks the bundled
    # file answers "What is the capital of France?" as llama-server does on it, not with "Paris",
    # so the question is one whose answer both arithmetics agree on. Float32 activations where a
    # pass has them, as tests/worker/test_engine.py decodes.
    env["KILN_NATIVE_ACTIVATIONS"] = "float32"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--workers-bind",
         f"tcp://127.0.0.1:{free_port()}", "--config", str(config), "--log-level", "info"],
        env=env, stdout=open(tmp_path / "serve.out", "wb"), stderr=open(tmp_path / "serve.log", "wb"),
    )  # fmt: skip
    log = lambda: (tmp_path / "serve.log").read_text()[-3000:]  # noqa: E731
    try:
        assert wait_until(lambda: len(_health(base)) == 3, 240), log()
        by_model: dict[str, int] = {}
        for w in _health(base):
            by_model[w["model"]] = by_model.get(w["model"], 0) + 1
        assert by_model == {"smollm2": 1, "tiny-qwen3": 2}  # the on-demand model has no worker yet

        listed = httpx.get(base + "/v1/models", timeout=5).json()
        assert_model_list(listed)
        models = {m["id"]: m for m in listed["data"]}
        assert set(models) == {"smollm2", "tiny-qwen3", "tiny-qwen3-later"}
        small, qwen, later = models["smollm2"], models["tiny-qwen3"], models["tiny-qwen3-later"]
        assert small["context_window"] == 8192 and "small" in small["aliases"]
        assert qwen["context_window"] == qwen["max_output_tokens"] == 512  # capped by context_length
        # Capabilities, as each worker found them in what it loaded.
        assert small["capabilities"]["reasoning"] is False and small["capabilities"]["reasoning_parser"] is None
        assert qwen["capabilities"]["reasoning"] is True and qwen["capabilities"]["reasoning_parser"] == "think"
        for m in (small, qwen):
            caps = m["capabilities"]
            assert caps["tools"] is True and caps["tool_parser"] == "hermes" and caps["structured_output"] is True
            assert caps["default_max_output_tokens"] == 4096
            assert (m["load"], m["loaded"]) == ("always", True)
        assert qwen["capabilities"]["tools_in_template"] is True
        # What each model's memory is: the KV cache at the served window, the weights (on the CPU
        # with the native kernels, each file's blocks: about its size; else float32 copies).
        memory = qwen["memory"]
        assert memory["context_window"] == 512 and memory["kv_cache_bytes"] == 512 * memory["kv_bytes_per_token"] > 0
        size = bundled_model_path().stat().st_size
        assert 0.9 * size < small["memory"]["weights_bytes"] < 1.2 * size or small["memory"]["weights_bytes"] > 4 * size
        assert 0 < memory["weights_bytes"] < small["memory"]["weights_bytes"] and memory["rss_bytes"] > memory["other_bytes"] > 0
        assert "memory" not in later
        assert (later["load"], later["loaded"], later["status"], later["idle_stop_s"]) == ("on-demand", False, "not_loaded", 5.0)
        assert "capabilities" not in later  # not known before it has ever run
        # The OpenAI SDK reads the list (Kiln's fields ride along as extras).
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        assert {m.id for m in client.models.list()} == set(models)

        for name, expected in (("small", "smollm2"), ("smollm2", "smollm2"), ("tiny-qwen3", "tiny-qwen3")):
            r = httpx.post(base + "/v1/responses", timeout=120,
                           json={"model": name, "input": "Name three colors.", "max_output_tokens": 12, "temperature": 0})  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["model"] == expected
            if expected == "smollm2":
                assert "red" in r.json()["output"][0]["content"][0]["text"].lower()
        missing = httpx.post(base + "/v1/responses", timeout=10, json={"model": "gpt-4o", "input": "hi"})
        assert missing.status_code == 404

        # On demand: the first request starts the worker and waits for it.
        started = time.monotonic()
        r = httpx.post(base + "/v1/responses", timeout=240, json={"model": "tiny-qwen3-later", "input": "hi", "max_output_tokens": 4})
        first_request_s = time.monotonic() - started
        answered = time.monotonic()
        assert r.status_code == 200, r.text + log()
        (pid,) = worker_pids(proc.pid, "tiny-qwen3-later")
        rss_up = _rss_mb(pid)
        smollm2_rss = _rss_mb(worker_pids(proc.pid, "smollm2")[0])
        now = {m["id"]: m for m in httpx.get(base + "/v1/models", timeout=5).json()["data"]}["tiny-qwen3-later"]
        assert now["loaded"] is True and now["capabilities"]["reasoning"] is True
        # ... and after its idle time with nothing in flight the process exits: its memory is back.
        assert wait_until(lambda: _gone(pid), 120), log()
        stopped_after_s = time.monotonic() - answered
        assert stopped_after_s >= 5 - 0.5
        later_now = lambda: {m["id"]: m for m in httpx.get(base + "/v1/models", timeout=5).json()["data"]}["tiny-qwen3-later"]  # noqa: E731
        assert wait_until(lambda: later_now()["status"] == "not_loaded", 30)  # once the supervisor has said it is gone
        now = later_now()
        assert now["loaded"] is False
        assert now["capabilities"]["reasoning"] is True  # what it reported when it ran
        assert len(_health(base)) == 3  # the always-loaded workers are untouched
        print(f"\non-demand tiny-qwen3: first request {first_request_s:.1f} s (start + load), worker RSS {rss_up:.0f} MB "
              f"(smollm2's worker {smollm2_rss:.0f} MB), process gone {stopped_after_s:.1f} s after the answer (idle_stop 5 s)")  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "needs at least one [[models]]"),
        ('[[models]]\nid = "a"\n', "source is required"),
        ('[[models]]\nid = "a"\nsource = "x"\nworkrs = 2\n', "unknown key 'workrs'"),
        ('[[models]]\nid = "a"\nsource = "x"\nworkers = 0\n', "workers must be at least 1"),
        ('[[models]]\nid = "a"\nsource = "x"\n[[models]]\nid = "b"\nsource = "y"\naliases = ["a"]\n', "'a' is used by both"),
        ('[[models]]\nid = "a"\nsource = "x"\n[[models]]\nid = "a"\nsource = "y"\n', "two [[models]] tables have id 'a'"),
        ('[[models]]\nid = "a"\nsource = "x"\nload = "lazy"\n', "load must be one of 'always', 'on-demand'"),
        ('[[models]]\nid = "a"\nsource = "x"\nkv_cache = "fp8"\n', "kv_cache must be one of 'float32', 'int8'"),
        ('[[models]]\nid = "a"\nsource = "x"\nidle_stop = "5m"\n', "idle_stop applies to load = \"on-demand\" models only"),
        ('[[models]]\nid = "a"\nsource = "x"\nload = "on-demand"\nidle_stop = "soon"\n', "idle_stop: expected seconds or a duration"),
        ('[[models]]\nid = "a"\nsource = "x"\nload = "on-demand"\nidle_stop = 0\n', "idle_stop: must be above 0"),
        ('[[models]]\nid = "a"\nsource = "x"\nmemory = "lots"\n', "memory: expected bytes or a size"),
        ('memory_budget = "1GB"\n[[models]]\nid = "a"\nsource = "x"\nload = "on-demand"\n', "give it memory"),
        ('memory_budget = "1GB"\n[[models]]\nid = "a"\nsource = "x"\nload = "on-demand"\nmemory = "2GB"\n', "cannot fit in memory_budget"),
        ('memory_budget = "1GB"\n[[models]]\nid = "a"\nsource = "x"\nmemory = "2GB"\n', "always-loaded models' memory"),
        ('budget = 3\n[[models]]\nid = "a"\nsource = "x"\n', "unknown top-level key"),
        ("[[models]\n", "not valid TOML"),
    ],
)
def test_config_errors_say_where(tmp_path, text, message):
    path = tmp_path / "kiln.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(path)


def test_on_demand_keys_and_their_units(tmp_path):
    path = tmp_path / "kiln.toml"
    path.write_text("""
memory_budget = "1.5GiB"
[[models]]
id = "a"
source = "x"
memory = 800000000
[[models]]
id = "b"
source = "y"
load = "on-demand"
idle_stop = "90s"
memory = "300MB"
[[models]]
id = "c"
source = "z"
load = "on-demand"
idle_stop = 2.5
memory = "100MiB"
workers = 2
""")
    config = load_config(path)
    assert config.memory_budget == int(1.5 * (1 << 30))
    a, b, c = config.models
    assert (a.load, a.memory, a.on_demand) == ("always", 800_000_000, False)
    assert (b.load, b.idle_stop_s, b.memory) == ("on-demand", 90.0, 300_000_000)
    assert (c.idle_stop_s, c.memory, c.workers) == (2.5, 100 << 20, 2)
    assert config.lookup("b") is b and config.lookup("nope") is None
    path.write_text('[[models]]\nid = "a"\nsource = "x"\nload = "on-demand"\n')
    assert load_config(path).models[0].idle_stop_s == 600.0  # ten minutes unless told


def test_serve_refuses_a_bad_config_before_starting(tmp_path):
    path = tmp_path / "kiln.toml"
    path.write_text('[[models]]\nid = "a"\n')
    proc = subprocess.run([sys.executable, "-m", "kiln", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "source is required" in proc.stderr and "Traceback" not in proc.stderr
