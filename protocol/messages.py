"""The messages the gateway and the workers exchange.

One dataclass per message. Every frame on the wire is a msgpack map whose ``"t"`` key names the
message; the remaining keys are the dataclass fields. Workers connect to the gateway (gateway binds
ROUTER, workers connect DEALER) and open with ``Register``; the gateway answers ``Registered`` and
refuses a worker whose ``version`` differs from ``PROTOCOL_VERSION``. A worker may connect one
DEALER to each of several gateways (replicas): every exchange below is per connection, and a
request is answered on the connection it arrived on.

Direction of each message:

    worker -> gateway   Register, Heartbeat, Event, Done, Failed, TokenCount, Compacted
    gateway -> worker   Registered, Generate, CountTokens, Compact, Cancel
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .events import WorkerEvent
from .request import GenerateRequest
from .usage import Usage

# 3: requests carry a typed ``GenerateRequest`` (protocol/request.py) instead of the create body.
PROTOCOL_VERSION = 3


@dataclass
class Register:
    """A worker announces the model it serves and how much work it takes."""

    worker_id: str
    model: str
    aliases: list[str]
    context_window: int
    capacity: int  # requests decoded at once (max batch)
    queue_depth: int  # requests that may wait behind those
    version: int = PROTOCOL_VERSION
    pid: int = 0
    # What the model can do (protocol/capabilities.py ``Capabilities.to_map()``).
    features: dict[str, Any] = field(default_factory=dict)
    # What the model's memory is, in bytes (worker/memory_report.py: weights, KV cache, the rest);
    # empty where the engine does not say (scripted, upstream).
    memory: dict[str, int] = field(default_factory=dict)


@dataclass
class Registered:
    """The gateway's answer to ``Register`` and to every ``Heartbeat``: whether it knows this worker.

    Answering each heartbeat lets a worker serving several gateways tell a gateway that is gone
    from one that is merely idle: after ``heartbeat_timeout_s`` without a word from a gateway, the
    worker cancels the requests that gateway sent (nobody is left to read them). ``None``: a gateway
    that predates the answer, never timed out.
    """

    ok: bool
    error: str | None = None
    heartbeat_timeout_s: float | None = None


@dataclass
class Heartbeat:
    """Sent every heartbeat interval; silence for a few intervals means the worker is gone.

    ``active`` and ``queued`` count the worker's whole scheduler, whichever gateway sent the work;
    ``others`` is how many requests the worker holds for gateways other than the one this
    heartbeat goes to, so that each gateway's view of the load is its own in-flight requests plus
    ``others``. ``rss_bytes``: the worker's resident memory, which the gateway counts against a
    host memory budget (0: not reported).
    """

    worker_id: str
    active: int = 0
    queued: int = 0
    cache: dict[str, Any] = field(default_factory=dict)
    others: int = 0
    rss_bytes: int = 0


@dataclass
class Generate:
    """Generate one response.

    ``request`` is everything the worker needs (protocol/request.py): history from
    ``previous_response_id`` and ``conversation`` already expanded into its input items, the
    resolved model id, tools flattened. On the wire it is ``request.to_wire()``.
    """

    req_id: str
    response_id: str
    request: GenerateRequest


@dataclass
class CountTokens:
    """Render ``request`` exactly as Generate would, and count its tokens."""

    req_id: str
    request: GenerateRequest


@dataclass
class Compact:
    """Summarize the older part of ``request.input`` (history already expanded).

    The worker chooses the split (it owns token counting), generates the summary and answers
    ``Compacted``, or ``Failed`` with ``context_length_exceeded`` when compaction cannot help.
    """

    req_id: str
    request: GenerateRequest
    keep_tokens: int
    max_output_tokens: int


@dataclass
class Compacted:
    req_id: str
    summary: str
    kept_indices: list[int]  # system/developer messages of the input, kept verbatim
    retained_indices: list[int]  # the newest whole turns, kept verbatim
    input_tokens_before: int
    input_tokens_after: int
    usage: Usage


@dataclass
class Cancel:
    req_id: str


@dataclass
class Event:
    """Responses stream events for ``req_id``, in order, without ``sequence_number``.

    The worker owns everything that needs tokens, so it emits the output-item events
    (``response.output_item.added``, ``response.output_text.delta``, ...) with item ids it
    chose (their shapes: ``WorkerEvent``, protocol/events.py). The gateway adds the envelope
    events, sequence numbers and the Response object.
    One message carries what one token produced (often several events: an item opening and
    its first delta), so the per-message cost is paid once per token, not once per event.

    ``usage`` is the request's running usage after the token(s) this message carries: what Done
    would report had the request ended here, so the gateway can meter a stream that is cut off.
    Optional: an Event may leave it out.
    """

    req_id: str
    events: list[WorkerEvent]
    usage: Usage | None = None


@dataclass
class Done:
    """The request finished; ``status`` is ``completed`` or ``incomplete``."""

    req_id: str
    status: str
    usage: Usage
    incomplete_details: dict[str, Any] | None = None


@dataclass
class Failed:
    """The request could not be served. ``http_status`` is what a non-streaming client sees."""

    req_id: str
    http_status: int
    code: str
    message: str
    param: str | None = None


@dataclass
class TokenCount:
    req_id: str
    input_tokens: int


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Register,
        Registered,
        Heartbeat,
        Generate,
        CountTokens,
        Compact,
        Compacted,
        Cancel,
        Event,
        Done,
        Failed,
        TokenCount,
    )
}
