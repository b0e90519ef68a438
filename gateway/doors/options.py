"""What a door decides about a request, kept apart from what the client sent.

A create request holds client fields only (``validation.validate_create`` returns a
``CreateRequest`` of the fields the API defines), so nothing a client sends can reach these knobs: each door builds
its ``DoorOptions`` from its own reading of the request (the legacy Completions door's prompt, a
session header, a WebSocket turn's ``generate: false``) and hands it to
``ResponsesService.prepare``, which gives it to the ``Generation`` and to every worker request
built for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DoorOptions:
    """A door's decisions for one request.

    ``raw_prompt``: the exact text the worker continues, with no chat template (legacy
    ``/v1/completions`` only). ``session``: what keeps a client's requests on one worker when
    they carry no ``prompt_cache_key`` (a session header, or the WebSocket connection).
    ``warm_up``: prefill only (a WebSocket ``generate: false`` turn): the worker is asked for one
    token, which the door drops. ``cap_to_window``: a ``max_output_tokens`` above the model's
    context window is lowered to it rather than refused (Anthropic's ``max_tokens`` is required
    and picked for other models)."""

    raw_prompt: str | None = None
    session: str | None = None
    warm_up: bool = False
    cap_to_window: bool = False


NO_OPTIONS = DoorOptions()
