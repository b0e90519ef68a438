"""Shared fixtures: real Kiln processes on loopback.

``kiln`` runs the real bundled model (SmolLM2-135M-Instruct) and is shared by the whole session,
since loading it is the slow part. ``scripted_kiln`` runs the scripted engine, named as such, for
fault injection and protocol tests.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import settings as hypothesis_settings

from .support import Kiln

# Test tiers, each a marker set here from what a test uses (its fixtures, its body and the test
# helpers they call), never by hand: `./dev test --fast` runs the first two.
#   unit       none of the below: plain functions and objects
#   inprocess  the gateway app in this process (create_app, TestClient, the fake worker pool)
#   processes  real processes (Kiln on the scripted engine, HAProxy, Redis, a subprocess)
#   real_model the bundled model: in real processes (also marked e2e) or loaded here
TIERS = ("unit", "inprocess", "processes", "real_model")
_REAL_MODEL_FIXTURES = {"kiln", "http", "openai_client", "gguf_path", "gguf_tokenizer", "gguf_model", "mlx_folder"}
_PROCESS_FIXTURES = {"scripted_kiln", "scripted_http"}
# (cpu_kernels: the worker's native kernels are built by a C compiler on first use.)
_STARTS_PROCESSES = re.compile(r"\b(Kiln|Proc|Cluster|RedisServer)\(|shared_redis_url|subprocess|Popen|create_subprocess|haproxy\(|cpu_kernels|compiler")
_LOADS_THE_MODEL = re.compile(r"\bload_model\(|bundled_model_path|BUNDLED_MODEL")
_RUNS_THE_APP = re.compile(r"\b(create_app|TestClient|local_app|hosted_app|FakePool|ASGITransport|client_for)\b")


@functools.cache
def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _reachable_source(roots: list[Any], depth: int = 4) -> str:
    """The source of ``roots`` and of the test-package functions and classes they name (helpers
    such as ``start_gateway`` that start what the test runs), to ``depth`` calls."""
    seen: set[int] = set()
    texts: list[str] = []
    frontier = [r for r in roots if r is not None]
    for _ in range(depth):
        found: list[Any] = []
        for obj in frontier:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            text = _source(obj)
            texts.append(text)
            names = sys.modules.get(getattr(obj, "__module__", ""), None)
            for name in set(re.findall(r"\b([A-Za-z_]\w*)\b", text)):
                target = getattr(names, name, None)
                if (inspect.isfunction(target) or inspect.isclass(target)) and str(getattr(target, "__module__", "")).startswith("tests."):
                    found.append(target)
        frontier = found
    return "\n".join(texts)


def tier_of(item: pytest.Item) -> str:
    names = set(getattr(item, "fixturenames", ()))
    if names & _REAL_MODEL_FIXTURES:
        return "real_model"
    info = getattr(item, "_fixtureinfo", None)
    # The project's own fixtures (pytest's are not ours to read; this file's are known by name).
    fixtures = [d.func for defs in (info.name2fixturedefs.values() if info else ()) for d in defs if str(getattr(d.func, "__module__", "")).startswith("tests.") and d.func.__module__ != __name__]
    text = _reachable_source([getattr(item, "function", None), *fixtures])
    if _LOADS_THE_MODEL.search(text):
        return "real_model"
    if names & _PROCESS_FIXTURES or _STARTS_PROCESSES.search(text):
        return "processes" if "scripted" in text or "Kiln(" not in text else "real_model"
    return "inprocess" if _RUNS_THE_APP.search(text) else "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        item.add_marker(tier)
        if tier == "real_model":
            item.add_marker("e2e")


@pytest.fixture(autouse=True)
def _fast_tiers_start_no_process(request, monkeypatch):
    """A test of the fast tiers that starts a process anyway fails saying so: its tier was read
    wrongly (name what starts it in ``_STARTS_PROCESSES``)."""
    if request.node.get_closest_marker("unit") or request.node.get_closest_marker("inprocess"):
        def refuse(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
            raise AssertionError(f"{request.node.nodeid} is in a fast tier but starts a process ({args!r}): add what starts it to tests/conftest.py's _STARTS_PROCESSES")

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield


# CI draws the same examples on every run (a property that fails there fails every time, and a
# run never fails on a draw it cannot reproduce); a developer's run explores new ones.
hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")


@pytest.fixture(autouse=True, scope="session")
def _data_home(tmp_path_factory):
    """``kiln serve`` keeps its sealing key in $XDG_DATA_HOME/kiln (kiln/state.py): the servers a
    test run starts keep theirs in a folder of the run, never in the user's home."""
    yield from _session_env("XDG_DATA_HOME", str(tmp_path_factory.mktemp("data-home")))


@pytest.fixture(autouse=True, scope="session")
def _panel_cache(tmp_path_factory):
    """A GGUF's panels are kept on disk at its first start (worker/loading/panel_cache.py), the 3
    most recent files: the test files' go to a folder of the run, never evicting a user's own."""
    yield from _session_env("KILN_NATIVE_PANEL_CACHE", str(tmp_path_factory.mktemp("panels")))


def _session_env(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` for the run (the processes it starts inherit it), then as it was."""
    old = os.environ.get(name)
    os.environ[name] = value
    yield
    if old is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = old


@pytest.fixture(autouse=True)
def _report_tasks_of_a_hang(request):
    """Shortly before pytest-timeout ends a hung run (its ``timeout`` in pyproject.toml), the
    asyncio tasks of every running event loop are printed: the threads' stacks alone show an
    asyncio test only waiting in select()."""
    marker = request.node.get_closest_marker("timeout")  # a test's own bound (the soak's) wins
    try:
        limit = float(marker.args[0] if marker is not None and marker.args else request.config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout is not loaded (-p no:timeout)
        limit = 0.0
    if limit <= 0:
        yield
        return
    reported = threading.Timer(limit * 0.97, _print_asyncio_tasks, args=(request.node.nodeid,))
    reported.daemon = True
    reported.start()
    yield
    reported.cancel()


def _is_running_loop(obj: object) -> bool:
    try:
        return isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running()
    except ReferenceError:  # a dead weakref proxy among the collector's objects
        return False


def _print_asyncio_tasks(nodeid: str) -> None:
    out = sys.__stderr__
    print(f"\n+++ {nodeid} is about to time out; the asyncio tasks:", file=out)
    loops = [o for o in gc.get_objects() if _is_running_loop(o)]
    for loop in loops:
        for task in list(asyncio.all_tasks(loop)):
            print(f"--- {task.get_name()}", file=out)
            task.print_stack(file=out)
    out.flush()


@pytest.fixture(scope="session")
def kiln(tmp_path_factory):
    server = Kiln(tmp_path_factory.mktemp("kiln"), worker_args=["--max-batch", "8"]).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def scripted_kiln(tmp_path_factory):
    server = Kiln(tmp_path_factory.mktemp("scripted"), worker_args=["--engine", "scripted", "--scripted-delay", "0.002"]).start(timeout=60)
    yield server
    server.stop()


@pytest.fixture
def http(kiln):
    with httpx.Client(base_url=kiln.base_url, timeout=900) as client:
        yield client


@pytest.fixture
def openai_client(kiln):
    from openai import OpenAI

    return OpenAI(base_url=kiln.base_url + "/v1", api_key="sk-local", max_retries=0, timeout=900)


@pytest.fixture
def scripted_http(scripted_kiln):
    with httpx.Client(base_url=scripted_kiln.base_url, timeout=60) as client:
        yield client
