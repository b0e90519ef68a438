"""Structured output by constrained decoding: grammars, their cache, and the logits processor.

``text.format`` (json_schema / json_object) and forced tool calls (tool_choice "required" or a
named function) are enforced the same way: the request is turned into an llguidance grammar, the
grammar is compiled once per (tokenizer, grammar) and cached, and every generation step masks the
logits so that only tokens that keep the output inside the grammar can be sampled. When the
grammar is complete, only stop tokens remain, so the model cannot ramble past the closing brace.
That is what makes even a 135M model produce schema-valid JSON every time.

Why llguidance: it computes a full-vocabulary mask in tens of microseconds with no per-token
Python, compiles JSON schemas (including $ref, anyOf, patterns, formats) lazily in milliseconds,
and builds straight from a ``tokenizers.Tokenizer``. Its mlx helper is a Metal kernel, so off
macOS we apply the mask with plain numpy/mlx ops.

The gateway (kiln.gateway.doors.schema_check) has already refused schemas that cannot compile; the
worker still reports compile errors as ``GrammarError`` rather than trusting that.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import llguidance
import mlx.core as mx
import numpy as np
from llguidance.numpy import fill_next_token_bitmask
from tokenizers import Tokenizer as HFTokenizer

from kiln.protocol.grammar import JSON_COMPILE_OPTIONS, TOOL_ARGS_OPTIONS, parser_limits
from kiln.protocol.request import InvalidParam, ToolChoice

log = logging.getLogger(__name__)

COMPILE_SLOW_S = 0.5
_NEG_INF = float("-inf")


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot compile; the message names the problem."""


def canonical_json(value: Any) -> str:
    """One spelling per JSON value, so equal formats share a cache entry."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def grammar_for_format(text_format: Mapping[str, Any] | None) -> str | None:
    """The llguidance grammar for a Responses ``text.format``; ``None`` means unconstrained."""
    if not text_format:
        return None
    kind = text_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        schema = text_format.get("schema")
        if not isinstance(schema, dict):
            raise GrammarError("text.format.schema must be a JSON schema object")
    else:
        raise GrammarError(f"unsupported text.format type {kind!r}")
    try:
        # The shared options are a plain dict of JsonCompileOptions' keys (protocol has no llguidance).
        return llguidance.LLMatcher.grammar_from_json_schema(bounded_formats(schema), overrides=JSON_COMPILE_OPTIONS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


# The longest value each string format can validly have (RFC 5321 for addresses, RFC 1035 for
# host names). The format grammars themselves allow any length, and a small model sampling at
# temperature 1 would otherwise spell one email address until max_output_tokens (in the
# 50-schema sweep at temperature 1, 29 of the 34 runs cut short by the token cap were in
# schemas with unbounded email or date-time fields).
FORMAT_MAX_LENGTH: dict[str, int] = {
    "email": 254, "idn-email": 254, "hostname": 253, "idn-hostname": 253,
    "duration": 64, "ipv4": 15, "ipv6": 45, "uuid": 36,
}  # fmt: skip

# Dates and times as patterns that only admit values common validators accept: RFC 3339's
# grammar also admits second 60, February 30 and unbounded fractions, which Python's
# jsonschema (and most calendars) refuse. February 29 is left out rather than spelled per
# leap year, and years before 1000 too; everything else is admitted, fractions up to
# nanoseconds.
_DATE = "[1-9][0-9]{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS: dict[str, str] = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$"}
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def bounded_formats(schema: Any) -> Any:
    """``schema`` with every formatted string narrowed to values that are surely valid.

    Dates and times become patterns (FORMAT_PATTERNS) and other formats with a natural maximum
    get it as ``maxLength`` unless the schema has its own. Everything excluded is invalid (or
    refused by common validators) anyway, so output that satisfies the narrowed schema still
    validates against the original. The schema passed in is not modified.
    """
    if isinstance(schema, list):
        return [bounded_formats(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYWORDS else bounded_formats(v)) for k, v in schema.items()}
    fmt = out.get("format")
    if not isinstance(fmt, str):
        return out
    if fmt in FORMAT_PATTERNS and "pattern" not in out:
        del out["format"]
        out["pattern"] = FORMAT_PATTERNS[fmt]
    elif fmt in FORMAT_MAX_LENGTH and "maxLength" not in out:
        out["maxLength"] = FORMAT_MAX_LENGTH[fmt]
    return out


# --------------------------------------------------------------------------------------------
# Tool-call forcing (Hermes syntax)
# --------------------------------------------------------------------------------------------


def _grammar_functions(tools: Iterable[Mapping[str, Any]], *, namespace_separator: str = ".") -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters) for every callable function, namespaces flattened as ``ns<sep>name``.

    Accepts Responses-style tools (``{"type": "function", "name", "parameters"}``), Chat-style
    ones (``{"type": "function", "function": {...}}``) and Codex ``namespace`` groups; other
    tool types (web_search, ...) are not model-emitted function calls and are skipped. A request
    arrives with its tools already flat (``GenerateRequest.tools``, flattened at the gateway's
    edge); these other shapes are what the grammar builder accepts when used on its own.
    """
    out: list[tuple[str, dict[str, Any]]] = []
    for tool in tools:
        kind = tool.get("type", "function")
        if kind == "function":
            spec = tool.get("function", tool)
            name = spec.get("name")
            if isinstance(name, str) and name:
                params = spec.get("parameters")
                out.append((name, params if isinstance(params, dict) and params else {"type": "object"}))
        elif kind == "namespace":
            prefix = f"{tool.get('name')}{namespace_separator}"
            for name, params in _grammar_functions(tool.get("tools") or (), namespace_separator=namespace_separator):
                out.append((prefix + name, params))
    return out


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]],
    choice: ToolChoice | str | Mapping[str, Any],
    parallel: bool,
    *,
    open_tag: str = "<tool_call>",
    close_tag: str = "</tool_call>",
    tags_are_special_tokens: bool = False,
) -> str:
    """A Lark grammar for forced Hermes tool calls, for ``GrammarCompiler.processor_for_grammar``.

    Output shape: ``<tool_call>\\n{"name": "<name>", "arguments": <JSON>}\\n</tool_call>``, where
    each name is paired with its own tool's ``parameters`` schema. ``choice`` (the request's
    ``ToolChoice``, or its Responses API shape) is "required" (any of the tools, or of an
    ``allowed_tools`` subset) or a named
    function (that one). With ``parallel``
    the model may emit one or more calls separated by a newline. When the tokenizer has the tags
    as single special tokens, pass ``tags_are_special_tokens`` so the grammar names those tokens
    instead of spelling their text (which a special token's bytes would never match).
    """
    functions = _grammar_functions(tools)
    try:
        mode = choice if isinstance(choice, ToolChoice) else ToolChoice.from_api(choice)
    except InvalidParam:
        raise GrammarError(f"tool_choice {choice!r} does not force a call") from None
    if mode.mode == "required":  # any of the tools, or of the allowed_tools subset
        selected = functions if mode.allowed is None else [f for f in functions if f[0] in mode.allowed]
    elif mode.mode == "named":
        selected = [f for f in functions if f[0] == mode.name]
        if not selected:
            raise GrammarError(f"tool_choice names function {mode.name!r}, which is not among the tools")
    else:
        raise GrammarError(f"tool_choice {choice!r} does not force a call")
    if not selected:
        raise GrammarError("tool_choice 'required' needs at least one function tool")

    def tag(text: str) -> str:
        return text if tags_are_special_tokens else _lark_string(text)

    lines = [
        "start: call" + (' ("\\n" call)*' if parallel else ""),
        f'call: {tag(open_tag)} "\\n" body "\\n" {tag(close_tag)}',
        "body: " + " | ".join(f"fn_{i}" for i in range(len(selected))),
    ]
    for i, (name, params) in enumerate(selected):
        head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        lines.append(f'fn_{i}: {_lark_string(head)} args_{i} "}}"')
        schema = bounded_formats(params)  # a copy
        schema["x-guidance"] = {**(schema.get("x-guidance") or {}), **TOOL_ARGS_OPTIONS}
        lines.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _lark_string(text: str) -> str:
    """A Lark string literal; JSON string escapes are valid Lark escapes."""
    return json.dumps(text, ensure_ascii=False)


# --------------------------------------------------------------------------------------------
# Compiler and cache
# --------------------------------------------------------------------------------------------


class GrammarCompiler:
    """Compiles grammars for one tokenizer and keeps the most recent ones.

    The cache holds a compiled, warmed-up ``LLMatcher`` per grammar; each request gets a
    ``deep_copy`` (microseconds) that shares the template's lazily built lexer, so the second
    request with a schema pays neither the compile nor the first-mask cost.
    """

    def __init__(
        self,
        hf_tokenizer: HFTokenizer,
        eos_token_ids: Iterable[int],
        *,
        stop_token_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        cache_size: int = 128,
    ) -> None:
        stops = sorted({int(t) for t in (*eos_token_ids, *stop_token_ids)})
        if not stops:
            raise ValueError("a constrained model needs at least one EOS/stop token id")
        # llguidance reads the tokenizer as JSON; padding/truncation settings would distort it.
        # Where there are none (a GGUF's tokenizer as Kiln builds it), the JSON is read as it is:
        # the copy without them took 0.13 s of a 1B start, the GIL held.
        text = hf_tokenizer.to_str()
        if hf_tokenizer.padding is not None or hf_tokenizer.truncation is not None:
            clean = HFTokenizer.from_str(text)
            clean.no_padding()
            clean.no_truncation()
            text = clean.to_str()
        self.stop_token_ids: tuple[int, ...] = tuple(stops)
        self.ll_tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(stops))
        self._special_tokens = {
            tok.content for tok in hf_tokenizer.get_added_tokens_decoder().values() if tok.special
        }
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compile_seconds: dict[str, float] = {}

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **kwargs: Any) -> GrammarCompiler:
        """Build from kiln.worker.loading's Tokenizer (``.hf_tokenizer``, ``.eos_token_ids``)."""
        return cls(tokenizer.hf_tokenizer, tokenizer.eos_token_ids, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.ll_tokenizer.vocab_size

    def processor_for(self, text_format: Mapping[str, Any] | None) -> ConstraintProcessor | None:
        """A fresh processor for a request's ``text.format``; ``None`` when it adds no constraint."""
        if not text_format or text_format.get("type", "text") == "text":
            return None
        key = "format:" + canonical_json(_format_key(text_format))
        template = self._cached(key, lambda: grammar_for_format(text_format) or "")
        return ConstraintProcessor(template.deep_copy(), self.stop_token_ids, self.vocab_size)

    def processor_for_grammar(self, grammar: str) -> ConstraintProcessor:
        """A fresh processor for a Lark or llguidance grammar (e.g. ``tool_call_grammar``)."""
        template = self._cached("grammar:" + grammar, lambda: grammar)
        return ConstraintProcessor(template.deep_copy(), self.stop_token_ids, self.vocab_size)

    def tool_call_processor(
        self, tools: Sequence[Mapping[str, Any]], choice: ToolChoice | str | Mapping[str, Any], parallel: bool
    ) -> ConstraintProcessor:
        """Force a Hermes tool call, naming the tags as special tokens when this vocab has them."""
        special = "<tool_call>" in self._special_tokens and "</tool_call>" in self._special_tokens
        grammar = tool_call_grammar(tools, choice, parallel, tags_are_special_tokens=special)
        return self.processor_for_grammar(grammar)

    def _cached(self, key: str, make_grammar: Any) -> llguidance.LLMatcher:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        start = time.perf_counter()
        grammar = make_grammar()
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=parser_limits())
        if template.is_error():
            raise GrammarError(template.get_error())
        # Warm the shared lexer: the first mask is the expensive one (milliseconds, not microseconds).
        fill_next_token_bitmask(template.deep_copy(), _new_bitmask(self.vocab_size))
        elapsed = time.perf_counter() - start
        if elapsed > COMPILE_SLOW_S:
            log.warning("grammar compile took %.2fs", elapsed)
        with self._lock:
            self._cache[key] = template
            self.compile_seconds[key] = elapsed
            while len(self._cache) > self._cache_size:
                evicted, _ = self._cache.popitem(last=False)
                self.compile_seconds.pop(evicted, None)
        return template

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"size": len(self._cache), "max": self._cache_size}


def _format_key(text_format: Mapping[str, Any]) -> dict[str, Any]:
    """Only what shapes the grammar: not the name, description or strict flag."""
    if text_format.get("type") == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "schema": text_format.get("schema")}


def _new_bitmask(vocab_size: int) -> np.ndarray:
    return np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)


# --------------------------------------------------------------------------------------------
# The per-request logits processor
# --------------------------------------------------------------------------------------------


class ConstraintProcessor:
    """mlx-lm logits processor that keeps one sequence inside a grammar.

    Called as ``processor(tokens, logits)`` with every token so far (prompt + generated) and
    logits of shape (1, vocab). The first call fixes where the prompt ends; each later call feeds
    the tokens appended since (normally the one just sampled) to the matcher, then masks every
    token the grammar forbids to -inf. Once the grammar is complete only stop tokens survive.
    A matcher that falls into an error state (a token the mask should have forbidden) ends the
    sequence with a stop token rather than raising inside a shared batch step; ``error`` says why.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        stop_token_ids: Sequence[int],
        vocab_size: int,
        *,
        prompt_tokens: int | None = None,
    ) -> None:
        self._matcher = matcher
        self._stop_ids = np.asarray(stop_token_ids, dtype=np.int64)
        self._vocab_size = vocab_size
        self._bitmask = _new_bitmask(vocab_size)
        self._seen = prompt_tokens
        self._consumed = 0
        self._error: str | None = None
        self._use_metal = _metal_default()

    # -- state ---------------------------------------------------------------------------------

    @property
    def error(self) -> str | None:
        """Why the constraint broke, or None; a broken constraint only lets stop tokens through."""
        if self._error is None and self._matcher.is_error():
            self._error = self._matcher.get_error()
        return self._error

    def is_complete(self) -> bool:
        """True when nothing but a stop token may follow (or a stop token was consumed)."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (it may still be extendable)."""
        return self._matcher.is_accepting()

    @property
    def generated_tokens(self) -> int:
        return self._consumed

    def consume(self, token_ids: Sequence[int]) -> bool:
        """Advance the matcher by tokens the caller sampled; False if one broke the grammar."""
        for token in token_ids:
            if self.error is not None:
                return False
            if not self._matcher.consume_token(int(token)):
                self._error = self._matcher.get_error() or f"token {token} is not allowed by the grammar"
                return False
            self._consumed += 1
        return True

    # -- mlx-lm logits processor ---------------------------------------------------------------

    def __call__(self, tokens: mx.array | None, logits: mx.array) -> mx.array:
        # Start the forward pass now: reading the sampled token and filling the mask (CPU,
        # GIL released) then overlap with it instead of running after it.
        mx.async_eval(logits)
        self._advance(tokens)
        if self.error is None:
            fill_next_token_bitmask(self._matcher, self._bitmask)
        else:
            self._stop_only_bitmask()
        return self.apply_bitmask(logits)

    def _advance(self, tokens: mx.array | None) -> None:
        """Feed the matcher the tokens appended since the last call; roll back if they shrank."""
        total = 0 if tokens is None else int(tokens.shape[-1])
        if self._seen is None:
            self._seen = total
            return
        if total > self._seen:
            new = cast("list[int]", tokens.reshape(-1)[self._seen :].tolist())  # type: ignore[union-attr]  # total > 0: tokens is set
            self._seen = total
            self.consume(new)
        elif total < self._seen:
            # A speculative decoder trimmed rejected draft tokens.
            back = min(self._seen - total, self._consumed)
            if back and self.error is None:
                self._matcher.rollback(back)
                self._consumed -= back
            self._seen = total

    def _stop_only_bitmask(self) -> None:
        self._bitmask.fill(0)
        words = self._bitmask.view(np.uint32)
        for token in self._stop_ids:
            if token < self._vocab_size:
                words[0, token // 32] |= np.uint32(1 << (token % 32))

    def allowed(self) -> np.ndarray:
        """The current mask as booleans over the tokenizer vocab (after the last call)."""
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return bits[: self._vocab_size].view(np.bool_)

    def apply_bitmask(self, logits: mx.array) -> mx.array:
        """Set forbidden logits to -inf; logits may be wider than the tokenizer vocab."""
        if self._use_metal:
            from llguidance.mlx import apply_token_bitmask  # Metal kernel: macOS only

            return apply_token_bitmask(logits, self._bitmask)
        width = logits.shape[-1]
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self._vocab_size]
        if bits.shape[0] >= width:
            allowed = bits[:width]
        else:  # model vocab padded past the tokenizer's: padding ids are never allowed
            allowed = np.zeros(width, dtype=np.uint8)
            allowed[: bits.shape[0]] = bits
        mask = mx.array(allowed.view(np.bool_))
        return mx.where(mask.reshape((1,) * (logits.ndim - 1) + (width,)), logits, _NEG_INF)


def _metal_default() -> bool:
    """Use llguidance's Metal kernel only when mlx computes on a Metal GPU."""
    try:
        return bool(mx.metal.is_available()) and mx.default_device().type == mx.DeviceType.gpu
    except Exception:  # noqa: BLE001 - any failure to probe means "not Metal"
        return False


__all__ = [
    "ConstraintProcessor",
    "GrammarCompiler",
    "GrammarError",
    "JSON_COMPILE_OPTIONS",
    "canonical_json",
    "grammar_for_format",
    "parser_limits",
    "tool_call_grammar",
]
