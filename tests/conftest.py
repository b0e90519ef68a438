"""Shared fixtures: real Kiln processes on loopback.

``kiln`` runs the real bundled model (SmolLM2-135M-Instruct) and is shared by the whole session,
since loading it is the slow part. ``scripted_kiln`` runs the scripted engine, named as such, for
fault injection and protocol tests.
"""

from __future__ import annotations

import os

import httpx
import pytest
from hypothesis import settings as hypothesis_settings

from .support import Kiln

# CI draws the same examples on every run (a property that fails there fails every time, and a
# run never fails on a draw it cannot reproduce); a developer's run explores new ones.
hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")


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
