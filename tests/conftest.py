"""Shared fixtures: real Kiln processes on loopback.

``kiln`` runs the real bundled model (SmolLM2-135M-Instruct) and is shared by the whole session,
since loading it is the slow part. ``scripted_kiln`` runs the scripted engine, named as such, for
fault injection and protocol tests.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading

import httpx
import pytest
from hypothesis import settings as hypothesis_settings

from .support import Kiln

# CI draws the same examples on every run (a property that fails there fails every time, and a
# run never fails on a draw it cannot reproduce); a developer's run explores new ones.
hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")


@pytest.fixture(autouse=True, scope="session")
def _data_home(tmp_path_factory):
    """``kiln serve`` keeps its sealing key in $XDG_DATA_HOME/kiln (kiln/state.py): the servers a
    test run starts keep theirs in a folder of the run, never in the user's home."""
    old = os.environ.get("XDG_DATA_HOME")
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("data-home"))
    yield
    if old is None:
        os.environ.pop("XDG_DATA_HOME", None)
    else:
        os.environ["XDG_DATA_HOME"] = old


@pytest.fixture(autouse=True)
def _report_tasks_of_a_hang(request):
    """Shortly before pytest-timeout ends a hung run (its ``timeout`` in pyproject.toml), the
    asyncio tasks of every running event loop are printed: the threads' stacks alone show an
    asyncio test only waiting in select()."""
    try:
        limit = float(request.config.getini("timeout") or 0)
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


def _print_asyncio_tasks(nodeid: str) -> None:
    out = sys.__stderr__
    print(f"\n+++ {nodeid} is about to time out; the asyncio tasks:", file=out)
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
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
