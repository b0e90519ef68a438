"""The client families with no other test here, against a real Kiln on the bundled model, each
doing what its users do first: a plain answer, a streamed answer and, where the family has tools,
a function tool round trip (the call forced with tool_choice, since the 135M model may not call a
tool unforced; the tool's output goes back to Kiln and the model answers from it).

Each family runs in its own process from the pinned versions below, installed at test time into
the cache (tests/e2e/client_installs.py; skipped with the installer's reason when that fails):

- OpenAI Agents SDK ``openai-agents==0.24.0``: Responses API (its default model class).
- LangChain ``langchain-openai==1.8.1`` (langchain-core 1.8.3): ``ChatOpenAI``, Chat Completions.
- LiteLLM ``litellm==1.110.2``: the ``openai/`` provider with ``api_base``, Chat Completions.
- Vercel AI SDK ``ai@6.0.333`` with ``@ai-sdk/openai@3.0.141`` (engines: node >= 18):
  ``openai.responses``, the Responses API.

The scripts are tests/e2e/client_families/; each prints one JSON object of what its user sees,
and the tests below assert on it. The module is ``slow``: with the clients cached it takes ~70 s
(Kiln's start, the clients' imports and a dozen short generations; 2 cores at load 10), ~140 s
with the first install.

Seen with the bundled model, asserted nowhere: after a tool's output the 135M model often answers
by echoing it inside ``<tool_response>`` tags (its own text, not Kiln markup).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .client_installs import cache_root, npm_install, pip_target

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SCRIPTS = Path(__file__).parent / "client_families"
PIP_PINS = ["openai-agents==0.24.0", "langchain-openai==1.8.1", "langchain-core==1.8.3", "litellm==1.110.2"]
NPM_PINS = ["ai@6.0.333", "@ai-sdk/openai@3.0.141"]
RUN_TIMEOUT = 600
MARKUP = ("<tool_call", "</tool_call")


def _tag(pins: list[str]) -> str:
    return "+".join(pins).replace("/", "_").replace("@", "-")


@pytest.fixture(scope="module")
def python_clients() -> Path:
    return pip_target(cache_root() / "clients" / _tag(PIP_PINS), PIP_PINS)


@pytest.fixture(scope="module")
def node_clients() -> Path:
    prefix = cache_root() / "clients" / _tag(NPM_PINS)
    if not (prefix / "node_modules" / "@ai-sdk" / "openai").exists():
        npm_install(prefix, NPM_PINS)
    # An ES module resolves its imports from its own folder, so the script runs from the prefix.
    shutil.copy(SCRIPTS / "vercel_client.mjs", prefix / "vercel_client.mjs")
    return prefix


def _run(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> dict[str, Any]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT, env={**os.environ, **(env or {})}, cwd=cwd)
    assert done.returncode == 0, f"{argv[1]} failed (rc {done.returncode}):\n{done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _python_family(script: str, python_clients: Path, base_url: str) -> dict[str, Any]:
    # LiteLLM otherwise fetches its model cost map from GitHub at import, retrying for seconds.
    env = {"PYTHONPATH": str(python_clients), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    return _run([sys.executable, str(SCRIPTS / script), f"{base_url}/v1", MODEL], env)


PYTHON_SCRIPTS = {"agents_sdk": "agents_client.py", "langchain": "langchain_client.py", "litellm": "litellm_client.py"}
FAMILIES = [*PYTHON_SCRIPTS, "vercel"]
TOOL_FAMILIES = ["agents_sdk", "langchain", "vercel"]


@pytest.fixture(scope="module")
def seen(request, kiln) -> dict[str, Any]:
    """What one family's user saw (the parameter names the family); each family runs once."""
    family = request.param
    if family in PYTHON_SCRIPTS:
        return _python_family(PYTHON_SCRIPTS[family], request.getfixturevalue("python_clients"), kiln.base_url)
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed, so the Vercel AI SDK cannot run")
    return _run([node, "vercel_client.mjs", f"{kiln.base_url}/v1", MODEL], cwd=request.getfixturevalue("node_clients"))


def _no_markup(text: str) -> None:
    assert not any(m in text for m in MARKUP), f"tool call markup reached the client as text: {text!r}"


@pytest.mark.parametrize("seen", FAMILIES, indirect=True)
def test_plain_answer(seen):
    text = seen["text"]
    assert isinstance(text, str) and text.strip()
    _no_markup(text)


@pytest.mark.parametrize("seen", FAMILIES, indirect=True)
def test_streamed_answer_arrives_in_pieces(seen):
    pieces = [p for p in seen["stream"] if p]  # LiteLLM's first and last chunks carry no text
    assert len(pieces) > 1, seen["stream"]
    if "stream_final" in seen:  # the client's own assembled answer is the deltas joined
        assert "".join(pieces) == seen["stream_final"]
    _no_markup("".join(pieces))


@pytest.mark.parametrize("seen", TOOL_FAMILIES, indirect=True)
def test_forced_tool_round_trip(seen):
    call = seen["tool"]
    assert call is not None, f"no tool call: {seen}"
    assert call["name"] == "get_weather"
    arguments = json.loads(call["arguments"]) if isinstance(call["arguments"], str) else call["arguments"]
    assert isinstance(arguments.get("city"), str) and arguments["city"], call
    # The tool ran on the client and its output went back: the model answered a second time.
    assert isinstance(seen["after_tool"], str) and seen["after_tool"].strip(), seen
    _no_markup(seen["after_tool"])
