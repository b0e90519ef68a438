"""``GET /v1/models``: the models this gateway serves, with what each can do.

Each entry is OpenAI's model object (``id``, ``object``, ``created``, ``owned_by``) plus Kiln's
fields (docs/api.md#models): ``context_window`` and ``max_output_tokens``, ``aliases``, ``load``
and ``loaded``, ``capabilities`` (protocol/capabilities.py) and ``memory`` (worker/memory_report.py)
as the model's worker reported them when it registered. The list is the connected workers' models and, with ``--config``, every
model of the file: one that is not loaded (an on-demand model before its first request, or after
its idle stop) is listed with ``loaded: false`` and what its workers reported the last time they
ran, or only what the file says before they ever have.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.protocol.model_config import ModelConfig

from ...pool.ondemand import ModelLoader
from ...pool.workers import WorkerHandle, WorkerPool
from ..errors import ApiError


def _model_object(model_id: str, created: int, handle: WorkerHandle | None, entry: ModelConfig | None, status: str) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "kiln"}
    if handle is not None:
        obj["context_window"] = handle.info.context_window
        obj["max_output_tokens"] = handle.info.context_window  # the prompt shares the window
        obj["aliases"] = list(handle.info.aliases)
    else:
        obj["aliases"] = list(entry.aliases) if entry is not None else []
    obj["load"] = entry.load if entry is not None else "always"
    obj["loaded"] = status == "loaded"
    obj["status"] = status
    if entry is not None and entry.on_demand:
        obj["idle_stop_s"] = entry.idle_stop_s
    if handle is not None:
        obj["capabilities"] = handle.capabilities.to_map()
        if handle.info.memory:
            obj["memory"] = {k: int(v) for k, v in handle.info.memory.items()}
    return obj


def _listing(pool: WorkerPool, loader: ModelLoader, created: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for info in pool.models():  # what is loaded now, the config's models among them
        entry = loader.entry(info.model)
        handle = pool.handles(info.model)[0]
        out[info.model] = _model_object(info.model, created, handle, entry, loader.status(entry) if entry else "loaded")
    for entry in loader.config.models if loader.config is not None else []:
        if entry.id not in out:
            out[entry.id] = _model_object(entry.id, created, pool.last_registration(entry.id), entry, loader.status(entry))
    return out


async def list_models(request: Request) -> Response:
    state = request.app.state
    return JSONResponse({"object": "list", "data": list(_listing(state.pool, state.loader, state.started_at).values())})


async def get_model(request: Request) -> Response:
    state = request.app.state
    name = request.path_params["model"]
    entry = state.loader.entry(name)
    model = entry.id if entry is not None else state.pool.require(name)  # 503 while a known model's worker restarts, else 404
    found = _listing(state.pool, state.loader, state.started_at).get(model)
    if found is None:
        raise ApiError(404, f"The model '{name}' does not exist.", code="model_not_found", param="model")
    return JSONResponse(found)
