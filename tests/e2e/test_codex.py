"""Codex CLI (the pinned npm release) against real Kiln processes and the bundled model.

Each check drives `codex exec` the way a person would after `kiln codex-config`, and reads the
gateway's request log to see what Codex sent: turn 2 must replay turn 1's items, a compaction must
go through Kiln, hosted tools must be dropped or disabled. Slow: every Codex turn prefills ~1.3k
tokens on the CPU (about a minute on a busy 2-core machine).

    .venv/bin/pytest -m e2e tests/e2e/test_codex.py -v

Codex is installed once into ~/.cache/kiln/codex/<version> (KILN_CODEX_CACHE overrides); without
npm, or when the install fails, the tests skip.
"""

from __future__ import annotations

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from .codex_support import MODEL, WORKER_ARGS, CodexHome, LoggedKiln, codex_binary

pytestmark = pytest.mark.e2e

TURN1 = "Say hello in one short sentence."
TURN2 = "Now say goodbye."
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
NOTES = "# Notes about the boxes in the shed\n" + "\n".join(f"Box {n} is {COLOURS[n * 5 % 8]} and holds {n * 7 % 13} apples." for n in range(1, 101))


@pytest.fixture(scope="module")
def codex():
    return codex_binary()


@pytest.fixture(scope="module")
def kiln(tmp_path_factory, codex):
    server = LoggedKiln(tmp_path_factory.mktemp("kiln-codex"), worker_args=WORKER_ARGS).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def kiln_drop(tmp_path_factory, codex):
    server = LoggedKiln(tmp_path_factory.mktemp("kiln-codex-drop"), gateway_args=["--hosted-tools", "drop"], worker_args=WORKER_ARGS).start()
    yield server
    server.stop()


def _turns(kiln: LoggedKiln) -> list[dict]:
    return kiln.requests(request_kind="turn")


def _two_turns(home: CodexHome) -> tuple[dict, dict]:
    """(a) one `codex exec` turn, (b) `codex exec resume --last`; the two logged requests.

    The server is shared by the module's tests, so only the turns logged from here on count."""
    earlier = len(_turns(home.kiln))
    first = home.exec(TURN1)
    assert first.returncode == 0, home.report()
    assert first.stdout.strip(), "codex printed no reply\n" + home.report()
    turns = _turns(home.kiln)[earlier:]
    assert len(turns) == 1, home.report()
    t1 = turns[0]
    assert t1["status"] == 200 and t1["terminal"] == "response.completed", home.report()
    assert t1["model"] == MODEL and t1["stream"] is True
    assert t1["input_types"][-1] == "message:user"

    second = home.exec(TURN2, resume=True)
    assert second.returncode == 0, home.report()
    assert second.stdout.strip(), "codex printed no reply to the resumed turn\n" + home.report()
    turns = _turns(home.kiln)[earlier:]
    assert len(turns) == 2, home.report()
    t2 = turns[1]
    assert t2["terminal"] == "response.completed", home.report()
    # Codex sends the whole history again (store: false, no previous_response_id): turn 1's items
    # unchanged, then the assistant's reply, then the new user message.
    assert t2["prompt_cache_key"] == t1["prompt_cache_key"]
    assert t2["input_hashes"][: t1["input_count"]] == t1["input_hashes"], home.report()
    assert "message:assistant" in t2["input_types"][t1["input_count"]:]
    assert t2["input_types"][-1] == "message:user"
    assert t2["usage"]["input_tokens"] > t1["usage"]["input_tokens"]
    return t1, t2


def test_codex_config_output(kiln, tmp_path, codex):
    home = CodexHome(tmp_path, kiln, codex)
    config = home.config
    parsed = tomllib.loads(config)
    assert parsed["model_providers"]["kiln"]["wire_api"] == "responses"
    assert parsed["agents"] == {"enabled": False} and parsed["features"] == {"goals": False}
    assert 'model_provider = "kiln"' in config and f'model = "{MODEL}"' in config
    assert "[model_providers.kiln]" in config and 'wire_api = "responses"' in config
    assert f'base_url = "{kiln.base_url}/v1"' in config and 'env_key = "KILN_API_KEY"' in config
    assert 'web_search = "disabled"' in config
    assert str(home.home / "kiln-models.json") in config
    (info,) = home.catalog()["models"]
    assert info["slug"] == MODEL and info["context_window"] == 8192
    assert info["auto_compact_token_limit"] < 8192 * 9 // 10
    assert info["supported_reasoning_levels"] == [] and info["truncation_policy"]["mode"] == "tokens"
    assert len(info["base_instructions"]) < 400


# About 20 minutes together on a 2-core CPU: run with `./dev test -m slow tests/e2e/test_codex.py`.
@pytest.mark.slow
def test_exec_and_resume(kiln, tmp_path, codex):
    home = CodexHome(tmp_path, kiln, codex)
    t1, _ = _two_turns(home)
    # web_search = "disabled": the gateway (hosted tools rejected) never sees a hosted tool.
    assert set(t1["tool_types"]) <= {"function", "namespace"}, t1["tool_types"]
    # [agents] enabled = false: no multi-agent namespace.
    assert "namespace" not in t1["tool_types"]
    assert t1["usage"]["input_tokens"] < 4000, "the catalog's short base_instructions should keep the prompt small"


# About 20 minutes together on a 2-core CPU: run with `./dev test -m slow tests/e2e/test_codex.py`.
@pytest.mark.slow
def test_exec_and_resume_with_hosted_tools_dropped(kiln_drop, tmp_path, codex):
    home = CodexHome(tmp_path, kiln_drop, codex, config_args=["--hosted-tools", "drop"])
    assert 'web_search = "disabled"' not in home.config
    t1, _ = _two_turns(home)
    # Codex's default web_search setting sends its web_search tool; the gateway drops it.
    assert "web_search" in t1["tool_types"], t1["tool_types"]


# About 20 minutes together on a 2-core CPU: run with `./dev test -m slow tests/e2e/test_codex.py`.
@pytest.mark.slow
def test_remote_compaction_through_kiln(kiln, tmp_path, codex):
    """(c) provider name "OpenAI" turns on remote compaction (v2: a compaction_trigger turn).
    Turns 1 and 2 run with the normal limit; then the catalog is rewritten with an
    auto-compact limit below the prompt, so turn 3 compacts first and still completes.

    An AGENTS.md of ~1.2k tokens of notes rides in Codex's first user message: Kiln keeps the
    latest turns verbatim and refuses a compaction whose summary (up to 1024 tokens) would not be
    shorter than what it replaces, so the summarized part must be longer than any summary the
    model can write."""
    home = CodexHome(tmp_path, kiln, codex, config_args=["--provider-name", "OpenAI"])
    assert 'name = "OpenAI"' in home.config
    (home.work / "AGENTS.md").write_text(NOTES + "\n")
    t1, t2 = _two_turns(home)
    assert t1["usage"]["input_tokens"] > 2000, "AGENTS.md did not reach the prompt"
    home.configure("--provider-name", "OpenAI", "--auto-compact-limit", "1000")
    assert home.catalog()["models"][0]["auto_compact_token_limit"] == 1000

    third = home.exec("What did I ask you first?", resume=True, timeout=1500)
    assert third.returncode == 0, home.report()
    key = t1["prompt_cache_key"]
    compactions = [e for e in kiln.requests(prompt_cache_key=key) if e["input_types"] and e["input_types"][-1] == "compaction_trigger"]
    assert compactions, "Codex never asked Kiln to compact\n" + home.report()
    done = compactions[-1]
    assert done["status"] == 200 and done["terminal"] == "response.completed", home.report()
    assert done["output_types"] == ["compaction"], home.report()
    # The turn after the compaction replays the compaction item instead of the old history.
    after = [e for e in kiln.requests(prompt_cache_key=key) if e["ts"] > done["ts"] and e["input_types"][-1] != "compaction_trigger"]
    assert after and "compaction" in after[-1]["input_types"], home.report()
    assert after[-1]["terminal"] == "response.completed", home.report()
