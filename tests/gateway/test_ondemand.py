"""On-demand models in process: the gateway's policy (start at the first request, bounded wait,
idle stop, memory budget with least-recently-used eviction) against a fake launcher that plays
the supervisor, and the app's answers (503 shapes, /v1/models) through httpx.

The fake launcher is named as such: it registers a fake worker when asked to start a model
(through the real pool's registration path) and reports ``ModelStopped`` when asked to stop
one. The process-level version, with kiln serve and real workers, is in test_ondemand_serve.py
and test_multi_model.py. Time is the loader's injected clock, never a sleep.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from kiln.gateway.http.errors import ApiError
from kiln.gateway.pool.ondemand import ModelLoader
from kiln.gateway.settings import Settings
from kiln.gateway.http.app import create_app
from kiln.protocol import Register
from kiln.protocol.capabilities import Capabilities
from kiln.protocol.control import ControlMessage, ModelExited, ModelStopped, StartModel, StopModel
from kiln.protocol.model_config import load_config
from tests.conformance import assert_error, assert_model, assert_model_list
from tests.gateway.inprocess import FakePool, bounded, client_for

MB = 1_000_000
CONFIG = """
memory_budget = "500MB"

[[models]]
id = "a"
source = "a.gguf"
load = "on-demand"
idle_stop = "30s"
memory = "200MB"

[[models]]
id = "b"
source = "b.gguf"
aliases = ["bee"]
load = "on-demand"
idle_stop = "30s"
memory = "200MB"

[[models]]
id = "c"
source = "c.gguf"
load = "on-demand"
idle_stop = "30s"
memory = "250MB"
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeLauncher:
    """Plays the supervisor: a StartModel registers a fake worker (unless ``hold`` names the
    model: then nothing comes, as for a load that takes long, or ``fail`` does: its worker exits);
    a StopModel is answered with ModelStopped."""

    def __init__(self, pool: FakePool) -> None:
        self.pool = pool
        self.sent: list[ControlMessage] = []
        self.hold: set[str] = set()
        self.fail: set[str] = set()
        self.on_message: Any = None
        self._ids = itertools.count()

    async def start(self, on_message: Any) -> None:
        self.on_message = on_message

    async def stop(self) -> None:
        return None

    def send(self, message: ControlMessage) -> None:
        self.sent.append(message)
        loop = asyncio.get_running_loop()
        if isinstance(message, StartModel):
            if message.model in self.fail:
                loop.call_soon(self.on_message, ModelExited(message.model, 2))
            elif message.model not in self.hold:
                loop.create_task(self.register(message.model))
        elif isinstance(message, StopModel):
            loop.call_soon(self.on_message, ModelStopped(message.model))

    async def register(self, model: str) -> None:
        n = next(self._ids)
        caps = Capabilities(tool_parser="hermes", reasoning=True, reasoning_parser="think", structured_output=True, default_max_output_tokens=256)
        aliases = ["bee"] if model == "b" else []  # as kiln serve gives its workers the config's aliases
        info = Register(worker_id=f"w{n}", model=model, aliases=aliases, context_window=1024, capacity=2, queue_depth=2, features=caps.to_map())
        await self.pool._register(f"id-{model}-{n}".encode(), info)

    def of(self, kind: type) -> list[str]:
        return [m.model for m in self.sent if isinstance(m, kind)]  # type: ignore[attr-defined]


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = tmp_path / "kiln.toml"
    path.write_text(CONFIG)
    return path


@pytest.fixture
async def setup(config_path):
    pool = FakePool()
    launcher = FakeLauncher(pool)
    clock = Clock()
    loader = ModelLoader(load_config(config_path), pool, launcher, load_timeout_s=5.0, clock=clock)
    await loader.start()
    yield loader, pool, launcher, clock
    await loader.stop()


async def _settle() -> None:
    for _ in range(5):  # let the launcher's scheduled callbacks run
        await asyncio.sleep(0)


async def test_first_request_starts_the_model_once_and_waits_for_it(setup):
    loader, pool, launcher, _ = setup
    entry = loader.entry("bee")
    assert loader.status(entry) == "not_loaded"
    await bounded(asyncio.gather(loader.ensure("bee"), loader.ensure("b"), loader.ensure("b")))
    assert launcher.of(StartModel) == ["b"]  # three requests, one start
    assert pool.serves("b") and loader.status(entry) == "loaded"
    await bounded(loader.ensure("b"))  # loaded: nothing more to do
    assert launcher.of(StartModel) == ["b"]
    # Names that are not on-demand models pass straight through.
    await bounded(loader.ensure("kiln-fake"))
    await bounded(loader.ensure("unknown"))
    await bounded(loader.ensure(None))


async def test_the_wait_is_bounded_and_the_load_goes_on(setup):
    loader, pool, launcher, _ = setup
    launcher.hold.add("a")
    loader.load_timeout_s = 0.2
    with pytest.raises(ApiError) as refused:
        await bounded(loader.ensure("a"))
    assert refused.value.status == 503 and refused.value.code == "model_loading"
    assert refused.value.headers["Retry-After"] == "5"
    assert loader.status(loader.entry("a")) == "loading"
    await launcher.register("a")  # the slow load finishes after the client was answered
    await bounded(loader.ensure("a"))
    assert launcher.of(StartModel) == ["a"]  # the retry found it loaded, no second start


async def test_a_model_that_cannot_load_fails_its_waiters_and_is_not_restarted(setup):
    loader, _, launcher, _ = setup
    launcher.fail.add("a")
    with pytest.raises(ApiError) as refused:
        await bounded(loader.ensure("a"))
    assert refused.value.status == 503 and refused.value.code == "model_load_failed"
    assert "exited with status 2" in refused.value.message
    assert launcher.of(StopModel) == ["a"]  # the supervisor stops restarting it
    assert loader.last_error(loader.entry("a")) is not None


async def test_idle_models_stop_after_their_idle_time_and_busy_ones_do_not(setup):
    loader, pool, launcher, clock = setup
    await bounded(loader.ensure("a"))
    await bounded(loader.ensure("b"))
    busy = pool.handles("b")[0]
    busy.inflight.add("req-1")  # a request in flight on b
    clock.now += 29
    loader.check_idle()
    assert launcher.of(StopModel) == []
    clock.now += 2
    loader.check_idle()
    assert launcher.of(StopModel) == ["a"]  # b is busy
    assert not pool.serves("a")  # retired from routing at once
    await _settle()
    assert loader.status(loader.entry("a")) == "not_loaded"
    busy.inflight.clear()
    clock.now += 29
    loader.check_idle()
    assert launcher.of(StopModel) == ["a"]  # idle since its request ended, not for 30 s yet
    clock.now += 2
    loader.check_idle()
    assert launcher.of(StopModel) == ["a", "b"]
    await _settle()
    await bounded(loader.ensure("a"))  # and a stopped model starts again at its next request
    assert launcher.of(StartModel) == ["a", "b", "a"]


async def test_the_memory_budget_stops_the_least_recently_used_idle_model(setup):
    loader, pool, launcher, clock = setup
    await bounded(loader.ensure("a"))  # 200 MB
    clock.now += 1
    await bounded(loader.ensure("b"))  # 400 MB of 500
    clock.now += 1
    await bounded(loader.ensure("a"))  # a used more recently than b
    await bounded(loader.ensure("c"))  # 250 MB: one of them must go, and b is the older
    assert launcher.of(StopModel) == ["b"]
    assert pool.serves("a") and pool.serves("c") and not pool.serves("b")


async def test_memory_held_by_busy_models_is_a_503(setup):
    loader, pool, launcher, _ = setup
    await bounded(loader.ensure("a"))
    await bounded(loader.ensure("b"))
    for model in ("a", "b"):
        pool.handles(model)[0].inflight.add(f"req-{model}")
    with pytest.raises(ApiError) as refused:
        await bounded(loader.ensure("c"))
    assert refused.value.status == 503 and refused.value.code == "memory_budget_exceeded"
    assert "Retry-After" in refused.value.headers
    assert launcher.of(StopModel) == [] and not pool.serves("c")


async def test_a_gateway_without_a_supervisor_lists_but_does_not_start(config_path):
    app = create_app(Settings(config_path=str(config_path)), pool=FakePool())
    async with client_for(app) as client:
        r = await client.post("/v1/responses", json={"model": "a", "input": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert_error(r.json())
        assert r.json()["error"]["code"] == "model_not_loaded"
        listed = (await client.get("/v1/models")).json()
        assert_model_list(listed)
        by_id = {m["id"]: m for m in listed["data"]}
        assert set(by_id) == {"kiln-fake", "a", "b", "c"}
        assert by_id["b"] == {"id": "b", "object": "model", "created": by_id["b"]["created"], "owned_by": "kiln", "aliases": ["bee"], "load": "on-demand", "loaded": False, "status": "not_loaded", "idle_stop_s": 30.0}
        assert by_id["kiln-fake"]["loaded"] is True and by_id["kiln-fake"]["load"] == "always"
        one = await client.get("/v1/models/bee")  # a listed model is described, not 503
        assert one.status_code == 200 and one.json()["id"] == "b"
        missing = await client.get("/v1/models/nope")
        assert missing.status_code == 404
        assert_error(missing.json())


async def test_requests_load_the_model_and_the_listing_shows_its_capabilities(config_path):
    pool = FakePool()
    launcher = FakeLauncher(pool)
    app = create_app(Settings(config_path=str(config_path)), pool=pool, launcher=launcher)
    await app.state.loader.start()
    try:
        async with client_for(app) as client:
            r = await bounded(client.post("/v1/responses", json={"model": "bee", "input": "hi"}))
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "b"
            b = (await client.get("/v1/models/b")).json()
            assert_model(b)
            assert (b["loaded"], b["status"], b["context_window"], b["max_output_tokens"]) == (True, "loaded", 1024, 1024)
            assert b["capabilities"] == {"tools": True, "tool_parser": "hermes", "tools_in_template": False, "reasoning": True, "reasoning_parser": "think", "structured_output": True, "default_max_output_tokens": 256}
            # Chat Completions and token counting go through the same admission.
            chat = await bounded(client.post("/v1/chat/completions", json={"model": "a", "messages": [{"role": "user", "content": "hi"}]}))
            assert chat.status_code == 200, chat.text
            assert launcher.of(StartModel) == ["b", "a"]
            # Stopped, it is listed with what its workers reported when they ran.
            app.state.loader._stop(app.state.loader._models["b"])
            await _settle()
            b = (await client.get("/v1/models/b")).json()
            assert (b["loaded"], b["status"], b["context_window"], b["capabilities"]["reasoning"]) == (False, "not_loaded", 1024, True)
    finally:
        await app.state.loader.stop()


async def test_an_always_loaded_model_answers_loading_until_its_first_worker(tmp_path):
    """A model the server starts with (``load = "always"``, or the command line's under kiln
    serve) is loading until a first worker registers: 503 model_loading with Retry-After at once,
    never 404 and never a wait; /health's ``loading`` lists it. A name nobody serves passes to the
    pool (404)."""
    path = tmp_path / "kiln.toml"
    path.write_text('[[models]]\nid = "big"\nsource = "big.gguf"\naliases = ["large"]\n')
    pool = FakePool()
    launcher = FakeLauncher(pool)
    loader = ModelLoader(load_config(path), pool, launcher, load_timeout_s=5.0)
    await loader.start()
    try:
        for name in ("big", "large"):
            with pytest.raises(ApiError) as refused:
                await bounded(loader.ensure(name))
            assert (refused.value.status, refused.value.code, refused.value.headers["Retry-After"]) == (503, "model_loading", "5")
        assert loader.loading() == ["big"] and loader.status(loader.entry("big")) == "loading"
        assert launcher.sent == []  # nothing to start: kiln serve started its workers
        await bounded(loader.ensure("unknown"))  # the pool's 404, as before
        await launcher.register("big")
        await bounded(loader.ensure("large"))
        assert loader.loading() == [] and loader.status(loader.entry("big")) == "loaded"
    finally:
        await loader.stop()


async def test_hosted_and_local_gateways_answer_loading_in_each_doors_shape(tmp_path):
    """An always-loaded model before its first worker, through the app: OpenAI's error shape on
    /v1/responses (hosted mode too: after the key and catalog checks), Anthropic's on
    /v1/messages, 503 + Retry-After on both; /health up but not ready; a stranger stays 404."""
    from tests.gateway.inprocess import hosted_app

    path = tmp_path / "kiln.toml"
    path.write_text('[[models]]\nid = "big"\nsource = "big.gguf"\n')
    local = create_app(Settings(config_path=str(path)), pool=FakePool())
    hosted, _, key = await hosted_app(tmp_path)
    # hosted_app takes no --config: its loader is the one a --config gateway builds.
    hosted.state.loader = ModelLoader(load_config(path), hosted.state.pool, None, load_timeout_s=5.0)
    try:
        for app, headers in ((local, {}), (hosted, {"Authorization": f"Bearer {key}"})):
            async with client_for(app) as client:
                r = await client.post("/v1/responses", json={"model": "big", "input": "hi"}, headers=headers)
                assert (r.status_code, r.headers["retry-after"], r.json()["error"]["code"]) == (503, "5", "model_loading"), r.text
                assert_error(r.json())
                m = await client.post("/v1/messages", json={"model": "big", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}, headers=headers)
                assert m.status_code == 503 and m.headers["retry-after"] == "5", m.text
                assert m.json()["type"] == "error" and m.json()["error"]["type"] == "overloaded_error" and "loading" in m.json()["error"]["message"]
                assert (await client.post("/v1/responses", json={"model": "nope", "input": "hi"}, headers=headers)).status_code == 404
                health = await client.get("/health")
                assert health.status_code == 200 and health.json()["ready"] is False and health.json()["loading"] == ["big"]
    finally:
        await hosted.state.accounts.close()


async def test_an_org_without_credit_gets_402_and_starts_no_load(tmp_path, config_path):
    """Issue 30 D: 402 comes before any on-demand load (and before a 503 while loading): an
    organization with no credit cannot make the server load models; a funded one still can."""
    from kiln.gateway.accounts.keys import create_key
    from kiln.gateway.accounts.orgs import create_org

    pool = FakePool()
    launcher = FakeLauncher(pool)
    settings = Settings(auth="keys", database_url=f"sqlite:///{tmp_path}/accounts.db", store_mode="none", config_path=str(config_path))
    app = create_app(settings, pool=pool, launcher=launcher)
    accounts = app.state.accounts
    await accounts.open()
    await create_org(accounts.db, "broke", credits_usd=0)
    await create_org(accounts.db, "funded", credits_usd=10)
    broke, funded = (await create_key(accounts.db, "broke")).key, (await create_key(accounts.db, "funded")).key
    await app.state.loader.start()
    try:
        async with client_for(app) as client:
            for path, body in (("/v1/responses", {"model": "a", "input": "hi"}), ("/v1/chat/completions", {"model": "b", "messages": [{"role": "user", "content": "hi"}]})):
                r = await bounded(client.post(path, json=body, headers={"authorization": f"Bearer {broke}"}))
                assert r.status_code == 402, r.text
                assert_error(r.json())
            assert launcher.of(StartModel) == []
            launcher.hold.add("c")  # a load that takes long: the broke org still gets 402 at once
            r = await bounded(client.post("/v1/responses", json={"model": "c", "input": "hi"}, headers={"authorization": f"Bearer {broke}"}))
            assert r.status_code == 402 and launcher.of(StartModel) == []
            r = await bounded(client.post("/v1/responses", json={"model": "a", "input": "hi"}, headers={"authorization": f"Bearer {funded}"}))
            assert r.status_code == 200, r.text
            assert launcher.of(StartModel) == ["a"]
    finally:
        await app.state.loader.stop()
        await accounts.close()
