"""Codex CLI against a real Kiln: the pinned npm install, a throwaway CODEX_HOME, and the gateway's
request log (kiln.gateway.http.request_log) to see what Codex sent and what Kiln answered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kiln.gateway.http.request_log import read_log
from tests.support import Kiln, Proc

from .client_installs import cache_root, npm_install

# The version of the capture in shared/clients (codex-0.169-request.json) and docs/codex.md.
CODEX_VERSION = os.environ.get("KILN_CODEX_VERSION", "0.169.0")
CODEX_PACKAGE = "@openai/codex"
MODEL = "smollm2-135m-instruct"
# Codex sends no max_output_tokens, so the worker's cap bounds a rambling reply (the CPU decodes
# ~10 tok/s). Codex treats a reply cut by the cap (response.incomplete) as an error, so the cap is a
# few times longer than the short answers the prompts ask for.
WORKER_ARGS = ["--max-output-tokens", "256"]
TURN_TIMEOUT = float(os.environ.get("KILN_CODEX_TURN_TIMEOUT", "600"))


def cache_dir(version: str = CODEX_VERSION) -> Path:
    root = os.environ.get("KILN_CODEX_CACHE") or cache_root() / "codex"
    return Path(root) / version


def codex_binary(version: str = CODEX_VERSION) -> Path:
    """The pinned Codex CLI, installed from npm into the cache on first use; skips the test when
    npm is missing or the install fails (offline, registry refused)."""
    prefix = cache_dir(version)
    binary = prefix / "node_modules" / ".bin" / "codex"
    if binary.exists() and _version_of(binary) == version:
        return binary
    npm_install(prefix, [f"{CODEX_PACKAGE}@{version}"])
    if not binary.exists():
        pytest.skip(f"npm install {CODEX_PACKAGE}@{version} left no {binary}")
    found = _version_of(binary)
    if found != version:
        pytest.skip(f"installed Codex reports version {found!r}, expected {version}")
    return binary


def _version_of(binary: Path) -> str | None:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.strip().split()[-1] if out.strip() else None


@dataclass
class LoggedKiln(Kiln):
    """Kiln whose gateway writes the request log (one JSON line per /v1/responses request)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.request_log = self.tmp / "requests.jsonl"
        # Codex sends no temperature; at OpenAI's default of 1 the 135M model rambles to the cap
        # often enough to make these tests flaky, so the server's default is greedy here.
        self.env = {**self.env, "KILN_REQUEST_LOG": str(self.request_log), "KILN_DEFAULT_TEMPERATURE": "0"}

    def start(self, timeout: float = 300) -> LoggedKiln:
        # As Kiln.start, with the gateway run as ``python -m kiln.gateway`` (create_app installs the
        # log, as KILN_REQUEST_LOG is set).
        argv = [sys.executable, "-m", "kiln.gateway", "--port", str(self.port), "--workers-bind", self.zmq, "--heartbeat-timeout", "10", *self.gateway_args]
        self.gateway = Proc(argv, self._env(), self.tmp / "gateway.log").start()
        self.procs.append(self.gateway)
        for _ in range(self.workers):
            self.add_worker()
        self.wait_ready(timeout, self.workers)
        return self

    def requests(self, **match) -> list[dict]:
        return [e for e in read_log(self.request_log) if all(e.get(k) == v for k, v in match.items())]

    def logs(self) -> str:
        return "\n".join(p.log() for p in self.procs)


@dataclass
class CodexHome:
    """A CODEX_HOME holding the config.toml and catalog that `kiln codex-config` produces."""

    root: Path
    kiln: LoggedKiln
    binary: Path
    config_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    # The HTTP checks read the request log, which sees HTTP turns only: they keep Codex on HTTP.
    # tests/e2e/test_websocket_codex.py sets this to run the session over WebSocket mode.
    websockets: bool = False

    def __post_init__(self) -> None:
        self.home = self.root / "codex-home"
        self.work = self.root / "work"
        self.home.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.transcript: list[str] = []
        self.configure(*self.config_args)

    def configure(self, *args: str) -> str:
        """Run codex-config against the gateway; write config.toml; return it."""
        from click.testing import CliRunner

        from kiln.codex_config import codex_config

        result = CliRunner().invoke(
            codex_config,
            ["--base-url", self.kiln.base_url + "/v1", "--catalog-out", str(self.home / "kiln-models.json"), *([] if self.websockets else ["--no-websockets"]), *args],
            catch_exceptions=False,
        )
        assert result.exit_code == 0, result.output
        self.config = result.stdout
        (self.home / "config.toml").write_text(self.config)
        return self.config

    def catalog(self) -> dict:
        return json.loads((self.home / "kiln-models.json").read_text())

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "OPENAI_", "CODEX_"))}
        env.update(CODEX_HOME=str(self.home), KILN_API_KEY="sk-local-dummy", RUST_LOG="warn", NO_COLOR="1", **self.extra_env)
        return env

    def exec(self, prompt: str, *, resume: bool = False, timeout: float = TURN_TIMEOUT) -> subprocess.CompletedProcess:
        argv = [str(self.binary), "exec", "--skip-git-repo-check", "--color", "never"]
        argv += ["resume", "--last", prompt] if resume else [prompt]
        try:
            done = subprocess.run(argv, cwd=self.work, env=self.env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            self.transcript.append(f"$ {' '.join(argv[1:])}\n(timed out after {timeout}s)\n{_text(exc.stdout)}\n{_text(exc.stderr)[-3000:]}")
            raise AssertionError(f"codex exec timed out after {timeout}s\n{self.report()}") from exc
        self.transcript.append(f"$ {' '.join(argv[1:])}\nrc={done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}")
        return done

    def report(self) -> str:
        """Everything useful when a check fails: Codex's output, Kiln's request log and logs."""
        entries = [{k: v for k, v in e.items() if k not in ("input_hashes", "body")} for e in read_log(self.kiln.request_log)]
        return "\n".join(
            ["--- codex ---", *self.transcript, "--- request log ---", *map(json.dumps, entries), "--- kiln logs ---", self.kiln.logs()[-4000:]]
        )


def _text(value) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
