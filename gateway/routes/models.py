"""``GET /v1/models``: the models the connected workers serve."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import ApiError


def _model_object(info, created: int) -> dict:
    return {
        "id": info.model,
        "object": "model",
        "created": created,
        "owned_by": "kiln",
        "context_window": info.context_window,
        "aliases": list(info.aliases),
    }


async def list_models(request: Request) -> Response:
    pool = request.app.state.pool
    created = request.app.state.started_at
    return JSONResponse({"object": "list", "data": [_model_object(m, created) for m in pool.models()]})


async def get_model(request: Request) -> Response:
    pool = request.app.state.pool
    name = request.path_params["model"]
    model = pool.require(name)  # 503 while a known model's worker restarts, else 404
    for info in pool.models():
        if info.model == model:
            return JSONResponse(_model_object(info, request.app.state.started_at))
    raise ApiError(404, f"The model '{name}' does not exist.", code="model_not_found", param="model")
