"""The typed request the gateway sends a worker: one value, built once at the gateway's edge.

A create body reaches a worker as a ``GenerateRequest`` (inside ``Generate``, ``CountTokens`` and
``Compact``): tools already flattened (a namespace's functions carry the namespace's name), the
tool mode decided, the text format, sampling, the expanded input items and the cache key. The
worker renders, constrains, samples and parses from this value only; it never sees the create
body. ``gateway/pool/worker_request.py`` is the one place that builds it from a validated body.

Every range is checked when a value is constructed, so a request that exists is one the sampler
can honour; a bad value raises ``InvalidParam`` naming the API parameter. ``from_wire`` builds
through the same constructors, so a frame with a bad value (a gateway of ours with a gap in its
validation, or not ours at all) is refused with a 400 naming the parameter, never a 500 from deep
inside a batched decode step.

The wire form is plain msgpack values. Like ``codec.py``, it is forward compatible: keys a newer
peer added are ignored, and a missing key takes its default.

Two fields are carried verbatim, as JSON values: a tool's ``parameters`` schema and a text
format's ``schema``. The worker hands both to the chat template and the grammar compiler as they
are (the gateway has already checked them with ``protocol/grammar.py``'s options).

Not carried, because no worker reads them: ``reasoning`` (effort and summary are shaped by the
chat template's defaults, not per request), ``store``, ``metadata``, ``include`` (folded into
``Sampling.logprobs``; sealing reasoning is the gateway's), stop sequences (the gateway's doors
cut the text: ``gateway/doors/stop.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Union

MAX_SEED = 2**63 - 1  # mlx's PRNG keys are 64-bit; kept signed-safe
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0
# No model's context window comes near this; the gateway also caps it by the model's window.
MAX_OUTPUT_TOKENS = 2**31 - 1

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
ToolMode = Literal["none", "auto", "required", "named"]
FormatType = Literal["text", "json_object", "json_schema"]


class InvalidParam(ValueError):
    """A value outside what the API allows; ``param`` names the API parameter for the error."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _number(value: object, param: str, low: float, high: float, message: str, *, open_low: bool = False) -> float:
    if not _is_number(value):
        raise InvalidParam(param, message)
    number = float(value)  # type: ignore[arg-type]  # _is_number: an int or a finite float
    if number > high or number < low or (open_low and number == low):
        raise InvalidParam(param, message)
    return number


def _string(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise InvalidParam(param, f"Invalid '{param}': expected a string.")
    return value


def _optional_string(value: object, param: str) -> str | None:
    return None if value is None else _string(value, param)


def _bool(value: object, param: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidParam(param, f"Invalid '{param}': expected a boolean.")
    return value


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # normalizing a frozen dataclass's field in __post_init__


# -- sampling --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn. ``max_output_tokens`` None: the worker's default; either way the
    worker caps it by the room the prompt leaves in the context window."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_logprobs: int = 0
    logprobs: bool = False  # return each token's logprob (``include`` asked, or top_logprobs > 0)
    seed: int | None = None
    max_output_tokens: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        _set(self, "temperature", _number(self.temperature, "temperature", 0, MAX_TEMPERATURE, f"Invalid 'temperature': expected a number from 0 to {MAX_TEMPERATURE:g}."))
        _set(self, "top_p", _number(self.top_p, "top_p", 0, 1, "Invalid 'top_p': expected a number greater than 0 and at most 1.", open_low=True))
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParam("top_logprobs", f"Invalid 'top_logprobs': expected an integer from 0 to {MAX_TOP_LOGPROBS}.")
        _bool(self.logprobs, "logprobs")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidParam("seed", f"Invalid 'seed': expected an integer from 0 to {MAX_SEED}.")
        cap = self.max_output_tokens
        if cap is not None and (not _is_int(cap) or not 1 <= cap <= MAX_OUTPUT_TOKENS):
            raise InvalidParam("max_output_tokens", f"Invalid 'max_output_tokens': expected an integer from 1 to {MAX_OUTPUT_TOKENS}.")
        for name in ("presence_penalty", "frequency_penalty"):
            _set(self, name, _number(getattr(self, name), name, -MAX_PENALTY, MAX_PENALTY, f"Invalid '{name}': expected a number from -2 to 2."))

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, value: object) -> Sampling:
        return cls(**_known(cls, value, "sampling"))


def _known(cls: Any, value: object, param: str) -> dict[str, Any]:
    """The keys of a wire map that name fields of ``cls`` and are set (newer keys are ignored)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidParam(param, f"Invalid '{param}': expected an object.")
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in value.items() if k in names and v is not None}


# -- tools -----------------------------------------------------------------------------------------

EMPTY_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call. Namespace members are flattened here and keep their own
    name; ``namespace`` says which group declared them (the call item echoes it). Only function
    tools reach a worker: the gateway refuses or drops every other kind."""

    name: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))  # JSON schema, verbatim
    description: str = ""
    namespace: str | None = None
    strict: bool = True  # object schemas closed when forcing a call, unless the tool opts out

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidParam("tools", "Invalid 'tools': every function needs a name.")
        if not isinstance(self.parameters, Mapping):
            raise InvalidParam("tools", f"Invalid 'tools': the parameters of {self.name!r} must be an object.")
        _string(self.description, "tools")
        _optional_string(self.namespace, "tools")
        _bool(self.strict, "tools")

    def as_function(self) -> dict[str, Any]:
        """The flat Responses function shape the template, tool prompt and parsers take."""
        return {"type": "function", "name": self.name, "description": self.description, "parameters": dict(self.parameters), "strict": self.strict}

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "parameters": self.parameters, "description": self.description, "namespace": self.namespace, "strict": self.strict}

    @classmethod
    def from_wire(cls, value: object) -> ToolSpec:
        return cls(**_known(cls, value, "tools"))


@dataclass(frozen=True)
class ToolChoice:
    """The tool mode. ``named``: exactly ``name``; ``allowed``: the ``allowed_tools`` subset (its
    mode is ``auto`` or ``required``), None when every declared tool may be called."""

    mode: ToolMode = "auto"
    name: str | None = None
    allowed: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("none", "auto", "required", "named"):
            raise InvalidParam("tool_choice", f"Invalid 'tool_choice': unknown mode {self.mode!r}.")
        if (self.mode == "named") != isinstance(self.name, str):
            raise InvalidParam("tool_choice", "Invalid 'tool_choice': a named choice needs the function's name, and only it has one.")
        if self.allowed is not None:
            if not isinstance(self.allowed, (list, tuple)) or not all(isinstance(n, str) for n in self.allowed):
                raise InvalidParam("tool_choice", "Invalid 'tool_choice': allowed tools are a list of names.")
            _set(self, "allowed", tuple(self.allowed))

    @property
    def forces_call(self) -> bool:
        """A call is demanded and enforced by a grammar: a named function, or ``required`` (one of
        the ``allowed_tools`` subset where there is one; an empty subset has nothing to force)."""
        return self.mode == "named" or (self.mode == "required" and self.allowed != ())

    @classmethod
    def from_api(cls, value: object) -> ToolChoice:
        """From the Responses shape: "auto" / "none" / "required", ``{"type": "function", "name"}``
        or ``{"type": "allowed_tools", "mode", "tools": [{"name"}...]}``; None is "auto"."""
        if value is None:
            return cls()
        if value in ("none", "auto", "required"):
            return cls(value)
        if isinstance(value, Mapping):
            kind = value.get("type")
            if kind == "function":
                nested = value.get("function")
                name = value.get("name") or (nested.get("name") if isinstance(nested, Mapping) else None)
                return cls("named", name=_string(name, "tool_choice"))
            if kind == "allowed_tools":
                mode: ToolMode = "required" if value.get("mode") == "required" else "auto"
                tools = value.get("tools") or ()
                if not isinstance(tools, (list, tuple)):
                    raise InvalidParam("tool_choice", "Invalid 'tool_choice.tools': expected a list of tools.")
                names = tuple(str(t["name"]) for t in tools if isinstance(t, Mapping) and isinstance(t.get("name"), str))
                return cls(mode, allowed=names)
        raise InvalidParam("tool_choice", "Invalid value for 'tool_choice'.")

    def to_wire(self) -> dict[str, Any]:
        return {"mode": self.mode, "name": self.name, "allowed": list(self.allowed) if self.allowed is not None else None}

    @classmethod
    def from_wire(cls, value: object) -> ToolChoice:
        return cls(**_known(cls, value, "tool_choice"))


# -- text format -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextFormat:
    """``text.format``: free text, any JSON object, or JSON matching ``schema`` (verbatim)."""

    type: FormatType = "text"
    name: str | None = None
    schema: Mapping[str, Any] | None = None
    strict: bool | None = None

    def __post_init__(self) -> None:
        if self.type not in ("text", "json_object", "json_schema"):
            raise InvalidParam("text.format", f"Invalid 'text.format.type': {self.type!r}.")
        if self.type == "json_schema" and not isinstance(self.schema, Mapping):
            raise InvalidParam("text.format.schema", "Invalid 'text.format.schema': expected a JSON schema object.")
        _optional_string(self.name, "text.format.name")
        if self.strict is not None:
            _bool(self.strict, "text.format.strict")

    @property
    def constrained(self) -> bool:
        return self.type != "text"

    def to_api(self) -> dict[str, Any]:
        """The Responses ``text.format`` shape, for the grammar compiler."""
        out: dict[str, Any] = {"type": self.type}
        if self.name is not None:
            out["name"] = self.name
        if self.schema is not None:
            out["schema"] = self.schema
        if self.strict is not None:
            out["strict"] = self.strict
        return out

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "name": self.name, "schema": self.schema, "strict": self.strict}

    @classmethod
    def from_wire(cls, value: object) -> TextFormat:
        return cls(**_known(cls, value, "text.format"))


# -- input items -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContentPart:
    """One text-bearing part of a message: ``input_text``, ``output_text``, ``refusal``, ... (a
    refusal's text is its refusal)."""

    type: str
    text: str

    def __post_init__(self) -> None:
        _string(self.type, "input")
        _string(self.text, "input")


@dataclass(frozen=True)
class Message:
    role: str
    content: tuple[ContentPart, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in MESSAGE_ROLES:
            raise InvalidParam("input", f"Invalid message role {self.role!r}.")
        _set(self, "content", tuple(self.content))

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content)


@dataclass(frozen=True)
class FunctionCall:
    call_id: str
    name: str
    arguments: str = ""  # JSON text, as the model wrote it

    def __post_init__(self) -> None:
        for value in (self.call_id, self.name, self.arguments):
            _string(value, "input")


@dataclass(frozen=True)
class FunctionCallOutput:
    call_id: str
    output: str  # the text of the output (a list of parts is joined by the gateway)

    def __post_init__(self) -> None:
        _string(self.call_id, "input")
        _string(self.output, "input")


@dataclass(frozen=True)
class Reasoning:
    """Earlier reasoning, given back to the template of the assistant message that follows."""

    text: str

    def __post_init__(self) -> None:
        _string(self.text, "input")


@dataclass(frozen=True)
class Marker:
    """An item with no text of its own (``compaction_trigger``): kept so that item indices the
    worker answers with (``Compacted``) are positions in the gateway's list."""

    type: str

    def __post_init__(self) -> None:
        _string(self.type, "input")


InputItem = Union[Message, FunctionCall, FunctionCallOutput, Reasoning, Marker]


def item_to_wire(item: InputItem) -> dict[str, Any]:
    if isinstance(item, Message):
        return {"type": "message", "role": item.role, "content": [{"type": p.type, "text": p.text} for p in item.content]}
    if isinstance(item, FunctionCall):
        return {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
    if isinstance(item, FunctionCallOutput):
        return {"type": "function_call_output", "call_id": item.call_id, "output": item.output}
    if isinstance(item, Reasoning):
        return {"type": "reasoning", "text": item.text}
    return {"type": item.type}


def item_from_wire(value: object, index: int) -> InputItem:
    param = f"input[{index}]"
    if not isinstance(value, Mapping):
        raise InvalidParam(param, f"Invalid '{param}': expected an object.")
    kind = value.get("type")
    if kind == "message":
        parts = value.get("content") or ()
        if not isinstance(parts, (list, tuple)) or not all(isinstance(p, Mapping) for p in parts):
            raise InvalidParam(param, f"Invalid '{param}.content': expected a list of parts.")
        return Message(_string(value.get("role"), param), tuple(ContentPart(_string(p.get("type"), param), _string(p.get("text"), param)) for p in parts))
    if kind == "function_call":
        return FunctionCall(_string(value.get("call_id"), param), _string(value.get("name"), param), _string(value.get("arguments", ""), param))
    if kind == "function_call_output":
        return FunctionCallOutput(_string(value.get("call_id"), param), _string(value.get("output"), param))
    if kind == "reasoning":
        return Reasoning(_string(value.get("text", ""), param))
    return Marker(_string(kind, param))


# -- the request -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    """What a worker needs to render, constrain, sample and parse one response.

    ``raw_prompt``: the prompt text itself (the legacy ``/v1/completions`` door): no chat
    template, and ``input`` only counts. ``cache_key``: ``prompt_cache_key``, which the prefix
    cache keeps apart. ``cache_scope``: set by the gateway alone (one opaque value per
    organization in hosted mode), the part of the worker's prefix cache this request may reuse
    and fill, so no tenant learns from ``cached_tokens`` what another's prompts hold."""

    model: str
    input: tuple[InputItem, ...] = ()
    instructions: str | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    text_format: TextFormat = field(default_factory=TextFormat)
    sampling: Sampling = field(default_factory=Sampling)
    cache_key: str | None = None
    raw_prompt: str | None = None
    cache_scope: str | None = None

    def __post_init__(self) -> None:
        _string(self.model, "model")
        _set(self, "input", tuple(self.input))
        _set(self, "tools", tuple(self.tools))
        _optional_string(self.instructions, "instructions")
        _bool(self.parallel_tool_calls, "parallel_tool_calls")
        if self.max_tool_calls is not None and (not _is_int(self.max_tool_calls) or not 1 <= self.max_tool_calls <= MAX_OUTPUT_TOKENS):
            raise InvalidParam("max_tool_calls", "Invalid 'max_tool_calls': expected an integer of at least 1.")
        _optional_string(self.cache_key, "prompt_cache_key")
        _optional_string(self.raw_prompt, "prompt")
        _optional_string(self.cache_scope, "cache_scope")

    @property
    def offered_tools(self) -> tuple[ToolSpec, ...]:
        """The tools the model is told about: none when ``tool_choice`` is "none"."""
        return () if self.tool_choice.mode == "none" else self.tools

    @property
    def forces_call(self) -> bool:
        return bool(self.tools) and self.tool_choice.forces_call

    def namespaces(self) -> dict[str, str]:
        """Function name -> the namespace that declared it."""
        return {t.name: t.namespace for t in self.tools if t.namespace is not None}

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "input": [item_to_wire(item) for item in self.input],
            "instructions": self.instructions,
            "tools": [t.to_wire() for t in self.tools],
            "tool_choice": self.tool_choice.to_wire(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "max_tool_calls": self.max_tool_calls,
            "text_format": self.text_format.to_wire(),
            "sampling": self.sampling.to_wire(),
            "cache_key": self.cache_key,
            "raw_prompt": self.raw_prompt,
            "cache_scope": self.cache_scope,
        }

    @classmethod
    def from_wire(cls, value: object) -> GenerateRequest:
        """Rebuilt through the constructors, so every range is checked again."""
        known = _known(cls, value, "request")
        items = known.get("input", ())
        tools = known.get("tools", ())
        if not isinstance(items, (list, tuple)):
            raise InvalidParam("input", "Invalid 'input': expected a list of items.")
        if not isinstance(tools, (list, tuple)):
            raise InvalidParam("tools", "Invalid 'tools': expected a list.")
        known["input"] = tuple(item_from_wire(item, i) for i, item in enumerate(items))
        known["tools"] = tuple(ToolSpec.from_wire(t) for t in tools)
        known["tool_choice"] = ToolChoice.from_wire(known.get("tool_choice"))
        known["text_format"] = TextFormat.from_wire(known.get("text_format"))
        known["sampling"] = Sampling.from_wire(known.get("sampling"))
        if "model" not in known:
            raise InvalidParam("model", "Missing required parameter: 'model'.")
        return cls(**known)
