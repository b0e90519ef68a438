"""The Starlette application: routes, error handling and the worker pool's lifetime."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from ..accounts.middleware import AccountsMiddleware
from ..accounts.service import Accounts
from ..doors import schema_check
from ..doors.anthropic.routes import count_message_tokens, create_message
from ..doors.chat.routes import create_chat_completion
from ..doors.completions.routes import create_completion
from ..doors.responses.routes import cancel_response, compact_response, create_response, delete_response, get_response, input_tokens, list_input_items
from ..doors.websocket.routes import responses_socket
from ..lifecycle.service import ResponsesService
from ..pool.advertise import advertiser_for
from ..pool.ondemand import Launcher, ModelLoader
from ..pool.workers import WorkerPool
from ..settings import Settings
from ..web.pages import web_routes
from .edge import EdgeMiddleware
from .errors import ApiError
from .metrics import Metrics, MetricsMiddleware, metrics_endpoint
from .request_log import install_request_log
from .routes.admin import ROUTES as ADMIN_ROUTES
from .routes.conversations import ROUTES as CONVERSATION_ROUTES
from .routes.health import health
from .routes.models import get_model, list_models
from .routes.usage import hosted_routes


def _api_routes() -> list[tuple[str, Callable[..., Any], list[str]]]:
    return [
        ("/responses", create_response, ["POST"]),
        ("/responses/input_tokens", input_tokens, ["POST"]),
        ("/responses/compact", compact_response, ["POST"]),
        ("/responses/{response_id}", get_response, ["GET"]),
        ("/responses/{response_id}", delete_response, ["DELETE"]),
        ("/responses/{response_id}/cancel", cancel_response, ["POST"]),
        ("/responses/{response_id}/input_items", list_input_items, ["GET"]),
        ("/chat/completions", create_chat_completion, ["POST"]),
        ("/completions", create_completion, ["POST"]),
        ("/messages", create_message, ["POST"]),
        ("/messages/count_tokens", count_message_tokens, ["POST"]),
        ("/models", list_models, ["GET"]),
        ("/models/{model:path}", get_model, ["GET"]),
        *CONVERSATION_ROUTES,
    ]


def _routes() -> list[BaseRoute]:
    routes: list[BaseRoute] = [Route("/health", health, methods=["GET"]), Route("/metrics", metrics_endpoint, methods=["GET"])]
    for path, endpoint, methods in _api_routes():
        # Mounted with and without /v1, as the OpenAI SDKs accept either base URL.
        routes.append(Route("/v1" + path, endpoint, methods=methods))
        routes.append(Route(path, endpoint, methods=methods))
    # WebSocket mode: the upgrade of GET /v1/responses (doors/websocket/routes.py).
    routes += [WebSocketRoute("/v1/responses", responses_socket), WebSocketRoute("/responses", responses_socket)]
    return routes


def _bad_gateway(message: str) -> Response:
    """The hosted contract's answer when the model backend failed: 502 with a plain-text body."""
    return PlainTextResponse(f"Bad Gateway: {message}\n", status_code=502)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if request.app.state.accounts is not None and exc.status in (500, 502, 504):
        return _bad_gateway(exc.message)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return ApiError(exc.status_code, str(exc.detail), code=code).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    message = "The server had an error while processing the request."
    if request.app.state.accounts is not None:
        return _bad_gateway(message)
    return JSONResponse(ApiError(500, message).body(), status_code=500)


def _loader(settings: Settings, pool: WorkerPool, launcher: Launcher | None) -> ModelLoader:
    """The deployment's model list (--config) and the on-demand loading it may ask for."""
    config = None
    if settings.config_path:
        from kiln.protocol.model_config import load_config

        config = load_config(settings.config_path)  # checked by cli.checked() before the start
    if launcher is None and settings.supervisor_fd is not None:
        from ..pool.supervisor_link import SupervisorLink

        launcher = SupervisorLink(settings.supervisor_fd)
    return ModelLoader(config, pool, launcher, load_timeout_s=settings.load_timeout_s)


def create_app(settings: Settings, *, pool: WorkerPool | None = None, launcher: Launcher | None = None) -> Starlette:
    """The gateway; `pool` and `launcher` (who starts on-demand models) replace the real ones in tests."""
    pool = pool or WorkerPool(settings.workers_bind, heartbeat_timeout_s=settings.heartbeat_timeout_s, secret=settings.worker_secret)
    loader = _loader(settings, pool, launcher)
    # Hosted mode (--auth keys): accounts DB, key auth, metering, limits -- see gateway/accounts/.
    accounts = Accounts.from_settings(settings) if settings.auth == "keys" else None

    advertiser = advertiser_for(settings)
    responses = ResponsesService(settings, pool)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await pool.start()
        await responses.open()
        await loader.start()
        if accounts is not None:
            await accounts.open()
        if advertiser is not None:
            await advertiser.start()
        schema_check.preload()
        try:
            yield
        finally:
            if advertiser is not None:
                await advertiser.stop()
            if accounts is not None:
                await accounts.close()
            await loader.stop()
            await responses.close()
            await pool.stop()

    metrics = Metrics(pool)
    app = Starlette(
        routes=[*(hosted_routes(accounts) + ADMIN_ROUTES if accounts is not None else []), *_routes(), *web_routes(settings)],
        middleware=[Middleware(EdgeMiddleware, settings=settings),
            Middleware(MetricsMiddleware, metrics=metrics)] + ([Middleware(AccountsMiddleware, accounts=accounts)] if accounts is not None else []),
        lifespan=lifespan,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error},
    )
    app.state.settings = settings
    app.state.pool = pool
    app.state.loader = loader
    app.state.accounts = accounts
    app.state.responses = responses
    responses.metrics = metrics
    app.state.metrics = metrics
    app.state.started_at = int(time.time())
    install_request_log(app)  # opt-in: KILN_REQUEST_LOG=PATH
    return app
