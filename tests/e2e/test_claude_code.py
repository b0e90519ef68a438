"""Claude Code (npm ``@anthropic-ai/claude-code``, pinned) in print mode against ``kiln serve``
with the bundled model, offline: its Messages requests go to ANTHROPIC_BASE_URL and nowhere else.

What it needs, learned here (and in docs/anthropic.md):
- the model under a name Claude Code sends: ``kiln serve --model-alias`` (or ``--model NAME``);
- its default system prompt and tool definitions are about 20k tokens, more than SmolLM2's 8k
  window, so with this model it runs with ``--tools ""`` and a short ``--system-prompt``;
- it asks for ``max_tokens`` 32000 whatever the model: the door caps it to the context window.

The npm package carries the CLI as a native binary in a per-platform optional dependency; its
postinstall step (which only links it) is not needed, the binary is run from that package.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support import free_port

CLAUDE_CODE_VERSION = os.environ.get("KILN_CLAUDE_CODE_VERSION", "2.1.328")
PACKAGE = "@anthropic-ai/claude-code"
ALIAS = "claude-sonnet-4-5"  # a name Claude Code knows, served by the bundled model
TIMEOUT_S = float(os.environ.get("KILN_CLAUDE_CODE_TIMEOUT", "600"))


def _cache(version: str) -> Path:
    root = os.environ.get("KILN_CLAUDE_CODE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln" / "claude-code"
    return Path(root) / version


def _find_binary(prefix: Path) -> Path | None:
    for candidate in sorted((prefix / "node_modules" / "@anthropic-ai").glob("claude-code-*/claude")):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def claude_binary(version: str = CLAUDE_CODE_VERSION) -> Path:
    """The pinned Claude Code, installed from npm into the cache on first use; skips when npm is
    missing or the install fails (offline, registry refused, no binary for this platform)."""
    prefix = _cache(version)
    binary = _find_binary(prefix)
    if binary is None:
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip(f"npm is not installed, so Claude Code {version} cannot be installed")
        prefix.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--no-save", f"{PACKAGE}@{version}"], capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install {PACKAGE}@{version} timed out")
        binary = _find_binary(prefix)
        if done.returncode != 0 or binary is None:
            pytest.skip(f"npm install {PACKAGE}@{version} gave no binary (rc {done.returncode}): {done.stderr.strip()[-600:]}")
    found = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60).stdout.split()
    if not found or found[0] != version:
        pytest.skip(f"installed Claude Code reports {found!r}, expected {version}")
    return binary


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``kiln serve`` with the bundled model, also named ALIAS; greedy so the answer is stable."""
    tmp = tmp_path_factory.mktemp("claude-code")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_DEFAULT_TEMPERATURE="0")
    argv = [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--workers-bind", f"tcp://127.0.0.1:{free_port()}", "--model-alias", ALIAS]
    log = open(tmp / "serve.log", "ab")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "kiln serve did not become ready"
            time.sleep(0.3)
        yield base, tmp
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# About two minutes on a 2-core CPU: `./dev test -m slow tests/e2e/test_claude_code.py`.
@pytest.mark.slow
def test_print_mode_completes_a_prompt_offline(served, tmp_path):
    binary = claude_binary()
    base, _ = served
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": "sk-local",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": ALIAS,  # its small/fast model for side tasks, the same one
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "128",  # else it asks for 32000 (capped to the window)
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    argv = [str(binary), "-p", "Say hello in one short sentence.", "--model", ALIAS, "--tools", "", "--system-prompt", "You are a helpful assistant.", "--output-format", "json"]
    done = subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"stdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}"
    result = json.loads(done.stdout)
    assert result.get("is_error") is False and result.get("subtype") == "success", result
    assert isinstance(result.get("result"), str) and result["result"].strip(), result
    assert result["usage"]["output_tokens"] > 0, result
