"""Constrained decoding: grammars from text.format and forced tool calls, on the real tokenizer.

Two kinds of test. The fast ones drive ``ConstraintProcessor`` with synthetic logits (a random
walk biased towards short tokens), which checks on every one of the 50 data schemas that what the
grammar lets through is JSON that validates, in milliseconds. The model tests run the bundled
SmolLM2-135M at temperature 1 through mlx-lm's ``generate_step`` with the processor as a logits
processor: a handful of schemas by default, all 50 under ``-m slow``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from kiln.worker.structured import (
    ConstraintProcessor,
    GrammarCompiler,
    GrammarError,
    bounded_formats,
    tool_call_grammar,
)

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "data" / "schemas"
SCHEMA_FILES = sorted(SCHEMA_DIR.glob("*.json"))
MODEL_SCHEMAS = ["weather_report", "order_status"]  # short outputs: CI-cheap
# One of each feature for CI: $ref/$defs, recursion, anyOf + const, patterns, formats, enums,
# min/maxItems, additionalProperties schemas, nullable anyOf.
WALK_SCHEMAS = ["invoice", "person_tree", "payment_method", "vehicle", "calendar_event", "quiz_question", "package_manifest", "event_ticket"]

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME_TOOL = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"timezone": {"type": "string", "pattern": "^[A-Za-z]+/[A-Za-z_]+$"}},
        "required": ["timezone"],
        "additionalProperties": False,
    },
}
_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


def _load(name_or_path: str | Path) -> dict[str, Any]:
    path = name_or_path if isinstance(name_or_path, Path) else SCHEMA_DIR / f"{name_or_path}.json"
    return json.loads(path.read_text())


def _validator(schema: dict) -> jsonschema.Validator:
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def _gguf_path() -> Path:
    from kiln.worker.loading.errors import ModelNotFoundError
    from kiln.worker.loading.loader import bundled_model_path

    try:
        return bundled_model_path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tokenizer():
    """The bundled model's tokenizer, read from the GGUF metadata without loading weights."""
    from kiln.worker.loading.tokenizer import Tokenizer

    _, metadata = mx.load(str(_gguf_path()), return_metadata=True)
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler.from_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def token_lengths(compiler) -> np.ndarray:
    lt = compiler.ll_tokenizer
    return np.array([len(lt.decode_bytes([i])) for i in range(lt.vocab_size)], dtype=np.float32)


@pytest.fixture(scope="module")
def model():
    """The bundled model, in the weight format that decodes fastest in this process."""
    from kiln.worker.loading.blas import preloaded_openblas
    from kiln.worker.loading.loader import load_model

    _gguf_path()
    # Dequantized float32 pays off only with OpenBLAS preloaded; on the reference BLAS 4-bit wins.
    return load_model(None, weights="auto" if preloaded_openblas() else "native").model


_CLOSERS = [18, 77, 109, 28]  # '"', ']', '}', ',' in the SmolLM2 vocabulary (checked below)


def _walk(processor: ConstraintProcessor, stops: set[int], lengths: np.ndarray, seed: int, limit: int = 1500) -> list[int]:
    """Sample through the processor from synthetic logits that favour short tokens.

    Short tokens keep strings short, so walks end; the noise makes each seed take other branches
    (anyOf arms, optional properties, array lengths). Logits are wider than the vocab, as a
    model's padded embedding can be.
    """
    rng = np.random.default_rng(seed)
    bias = -3.0 * lengths
    bias[_CLOSERS] += 3.0  # end strings, arrays and objects soon, as a model mostly does
    context = [1, 2, 3]  # a stand-in prompt
    out: list[int] = []
    for _ in range(limit):
        noise = rng.gumbel(size=lengths.shape[0] + 64).astype(np.float32)
        noise[: lengths.shape[0]] += bias
        masked = processor(mx.array(context), mx.array(noise)[None])
        token = int(mx.argmax(masked, axis=-1).item())
        assert np.isfinite(np.array(masked)[0, token]), "every token was masked"
        context.append(token)
        if token in stops:
            return out
        out.append(token)
    raise AssertionError(f"walk did not finish in {limit} tokens")


# --------------------------------------------------------------------------------------------
# Processor and cache, synthetic logits
# --------------------------------------------------------------------------------------------


def test_closer_ids(tokenizer):
    assert [tokenizer.decode([i]) for i in _CLOSERS] == ['"', "]", "}", ","]


def test_text_and_none_add_no_constraint(compiler):
    assert compiler.processor_for(None) is None
    assert compiler.processor_for({"type": "text"}) is None


def _walk_validates(compiler, tokenizer, token_lengths, name: str, seeds: range) -> None:
    case = _load(name)
    stops = set(compiler.stop_token_ids)
    for seed in seeds:
        processor = compiler.processor_for({"type": "json_schema", "name": case["name"], "schema": case["schema"]})
        text = tokenizer.decode(_walk(processor, stops, token_lengths, seed))
        assert processor.is_complete() and processor.error is None
        _validator(case["schema"]).validate(json.loads(text))


@pytest.mark.parametrize("name", WALK_SCHEMAS)
def test_data_schema_walk_validates(compiler, tokenizer, token_lengths, name):
    _walk_validates(compiler, tokenizer, token_lengths, name, range(1))


@pytest.mark.slow
@pytest.mark.parametrize("path", SCHEMA_FILES, ids=[p.stem for p in SCHEMA_FILES])
def test_every_data_schema_walk_validates(compiler, tokenizer, token_lengths, path):
    _walk_validates(compiler, tokenizer, token_lengths, path.stem, range(3))


def test_formatted_strings_get_their_natural_length_bound():
    schema = {
        "type": "object",
        "properties": {
            "to": {"type": "array", "items": {"type": "string", "format": "email"}},
            "when": {"type": "string", "format": "date-time", "maxLength": 25},
            "format": {"type": "string", "enum": ["email"]},
            "site": {"type": "string", "format": "uri"},
        },
        "default": {"format": "email"},
    }
    bounded = bounded_formats(schema)
    assert bounded["properties"]["to"]["items"]["maxLength"] == 254
    when = bounded["properties"]["when"]
    assert "format" not in when and when["pattern"].startswith("^") and when["maxLength"] == 25
    assert "maxLength" not in bounded["properties"]["format"]  # a property named "format"
    assert "maxLength" not in bounded["properties"]["site"]  # no natural bound for a URI
    assert bounded["default"] == {"format": "email"}  # data, not a subschema
    assert "maxLength" not in schema["properties"]["to"]["items"]  # the input is not modified


@pytest.mark.parametrize("fmt", ["date-time", "date", "time"])
def test_narrowed_dates_and_times_pass_python_validators(compiler, tokenizer, token_lengths, fmt):
    """Random walks through a date/time field give values jsonschema's format checker accepts
    (RFC 3339's own grammar admits second 60 and February 30, which it refuses)."""
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"], "additionalProperties": False}
    stops = set(compiler.stop_token_ids)
    for seed in range(12):
        processor = compiler.processor_for({"type": "json_schema", "name": "when", "schema": schema})
        _validator(schema).validate(json.loads(tokenizer.decode(_walk(processor, stops, token_lengths, seed))))


def test_rambling_inside_an_email_ends_at_its_bound(compiler, tokenizer, token_lengths):
    """A sampler that prefers long tokens and never closes the string by choice still ends:
    the address cannot grow past 254 characters."""
    schema = {"type": "object", "properties": {"email": {"type": "string", "format": "email"}}, "required": ["email"], "additionalProperties": False}
    processor = compiler.processor_for({"type": "json_schema", "name": "contact", "schema": schema})
    rng = np.random.default_rng(0)
    bias = 0.5 * token_lengths
    bias[_CLOSERS] -= 50.0
    context, out, stops = [1, 2, 3], [], set(compiler.stop_token_ids)
    for _ in range(400):
        noise = rng.gumbel(size=token_lengths.shape[0]).astype(np.float32) + bias
        token = int(mx.argmax(processor(mx.array(context), mx.array(noise)[None]), axis=-1).item())
        context.append(token)
        if token in stops:
            break
        out.append(token)
    else:
        pytest.fail("the email string never ended")
    value = json.loads(tokenizer.decode(out))
    assert 0 < len(value["email"]) <= 254
    _validator(schema).validate(value)


def test_json_object_allows_any_object_only(compiler, tokenizer, token_lengths):
    processor = compiler.processor_for({"type": "json_object"})
    value = json.loads(tokenizer.decode(_walk(processor, set(compiler.stop_token_ids), token_lengths, 0)))
    assert isinstance(value, dict)
    fresh = compiler.processor_for({"type": "json_object"})
    assert not fresh.consume(tokenizer.encode("[1]"))  # an array is JSON but not an object


def test_grammar_cached_per_schema_not_per_name(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
    reordered = {"required": ["a"], "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}
    before = compiler.cache_info()["size"]
    first = compiler.processor_for({"type": "json_schema", "name": "one", "schema": schema})
    second = compiler.processor_for({"type": "json_schema", "name": "two", "schema": reordered, "strict": True})
    assert compiler.cache_info()["size"] == before + 1
    assert first is not second and first._matcher is not second._matcher  # independent state


def test_complete_grammar_allows_only_stop_tokens(compiler, tokenizer):
    processor = compiler.processor_for({"type": "json_schema", "name": "x", "schema": _load("geo_point")["schema"]})
    prompt = [1, 2, 3]
    body = tokenizer.encode('{"name": "Eiffel Tower", "latitude": 48.85, "longitude": 2.29}')
    processor(mx.array(prompt), mx.zeros((1, compiler.vocab_size)))  # first call: prompt only
    logits = processor(mx.array(prompt + body), mx.zeros((1, compiler.vocab_size + 128)))
    assert processor.is_complete()
    finite = set(np.flatnonzero(np.isfinite(np.array(logits)[0])).tolist())
    assert finite and finite <= set(compiler.stop_token_ids)


def test_padding_past_tokenizer_vocab_is_masked(compiler):
    processor = compiler.processor_for({"type": "json_object"})
    logits = processor(mx.array([1]), mx.zeros((1, compiler.vocab_size + 77)))
    assert not np.isfinite(np.array(logits)[0, compiler.vocab_size :]).any()


def test_two_schemas_side_by_side(compiler, tokenizer):
    """Batched requests: each sequence has its own processor; interleaving does not mix state."""
    a = compiler.processor_for({"type": "json_schema", "name": "a", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}})
    b = compiler.processor_for({"type": "json_schema", "name": "b", "schema": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}})
    ctx_a, ctx_b = [9], [9, 9]
    for tok_a, tok_b in zip(tokenizer.encode('{"n": 42}'), tokenizer.encode("[true]"), strict=False):
        for proc, ctx, tok in ((a, ctx_a, tok_a), (b, ctx_b, tok_b)):
            logits = proc(mx.array(ctx), mx.zeros((1, compiler.vocab_size)))
            assert np.isfinite(np.array(logits)[0, tok]), tokenizer.decode([tok])
            ctx.append(tok)
    assert a.error is None and b.error is None


def test_shrinking_context_rolls_back(compiler, tokenizer):
    """A speculative decoder may drop rejected draft tokens; the matcher follows."""
    processor = compiler.processor_for({"type": "json_object"})
    processor(mx.array([5]), mx.zeros((1, compiler.vocab_size)))
    ids = tokenizer.encode('{"a": 1')
    processor(mx.array([5] + ids), mx.zeros((1, compiler.vocab_size)))
    assert processor.generated_tokens == len(ids)
    processor(mx.array([5] + ids[:1]), mx.zeros((1, compiler.vocab_size)))
    assert processor.generated_tokens == 1 and processor.error is None
    assert processor.consume(ids[1:]) and not processor.is_accepting()
    assert processor.consume(tokenizer.encode("}")) and processor.is_complete()


def test_forbidden_token_ends_with_stop_only(compiler, tokenizer):
    processor = compiler.processor_for({"type": "json_object"})
    assert not processor.consume(tokenizer.encode("hello"))
    assert processor.error
    logits = processor(mx.array([1]), mx.zeros((1, compiler.vocab_size)))
    finite = set(np.flatnonzero(np.isfinite(np.array(logits)[0])).tolist())
    assert finite == set(compiler.stop_token_ids)


def test_uncompilable_grammar_raises(compiler):
    with pytest.raises(GrammarError):
        compiler.processor_for({"type": "json_schema", "name": "x", "schema": {"type": "array", "uniqueItems": True}})
    with pytest.raises(GrammarError):
        compiler.processor_for_grammar("start: undefined_rule\n")


# --------------------------------------------------------------------------------------------
# Tool-call grammar
# --------------------------------------------------------------------------------------------


def _accepts(compiler: GrammarCompiler, tokenizer, grammar: str, text: str) -> bool:
    processor = compiler.processor_for_grammar(grammar)
    return processor.consume(tokenizer.encode(text)) and processor.is_accepting()


def test_tool_call_grammar_required(compiler, tokenizer):
    grammar = tool_call_grammar([WEATHER_TOOL, TIME_TOOL, {"type": "web_search"}], "required", parallel=False)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
    assert _accepts(compiler, tokenizer, grammar, call)
    assert not _accepts(compiler, tokenizer, grammar, call.replace("get_time", "get_weather"))  # wrong args
    assert not _accepts(compiler, tokenizer, grammar, call.replace("get_time", "rm_rf"))
    assert not _accepts(compiler, tokenizer, grammar, call + "\n" + call)  # not parallel


def test_tool_call_grammar_named_and_parallel(compiler, tokenizer):
    grammar = tool_call_grammar([WEATHER_TOOL, TIME_TOOL], {"type": "function", "name": "get_weather"}, parallel=True)
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    assert _accepts(compiler, tokenizer, grammar, one + "\n" + one)
    other = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
    assert not _accepts(compiler, tokenizer, grammar, other)
    with pytest.raises(GrammarError):
        tool_call_grammar([WEATHER_TOOL], {"type": "function", "name": "nope"}, parallel=False)
    with pytest.raises(GrammarError):
        tool_call_grammar([{"type": "web_search"}], "required", parallel=False)


def test_tool_call_grammar_required_among_allowed_tools(compiler, tokenizer):
    """``allowed_tools`` in required mode: a call is forced, and only to a tool of the subset."""
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    grammar = tool_call_grammar([WEATHER_TOOL, TIME_TOOL], choice, parallel=False)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
    assert _accepts(compiler, tokenizer, grammar, call)
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    assert _accepts(compiler, tokenizer, tool_call_grammar([WEATHER_TOOL, TIME_TOOL], "required", parallel=False), weather)
    assert not _accepts(compiler, tokenizer, grammar, weather)  # declared, but not allowed
    with pytest.raises(GrammarError):
        tool_call_grammar([WEATHER_TOOL], choice, parallel=False)  # the subset names no declared tool


def test_tool_call_grammar_namespace_and_chat_style(compiler, tokenizer):
    tools = [
        {"type": "namespace", "name": "multi_agent", "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}]},
        {"type": "function", "function": {"name": "legacy", "parameters": {"type": "object"}}},
    ]
    grammar = tool_call_grammar(tools, "required", parallel=False)
    assert _accepts(compiler, tokenizer, grammar, '<tool_call>\n{"name": "multi_agent.spawn", "arguments": {"n": 2}}\n</tool_call>')
    assert _accepts(compiler, tokenizer, grammar, '<tool_call>\n{"name": "legacy", "arguments": {}}\n</tool_call>')


# --------------------------------------------------------------------------------------------
# The real model at temperature 1
# --------------------------------------------------------------------------------------------


def _generate(model, tokenizer, processor: ConstraintProcessor, prompt: str, *, seed: int, max_tokens: int, allow_cap: bool = False) -> str | None:
    """The constrained output; None if it hit max_tokens first and ``allow_cap`` (the server
    reports that as status "incomplete")."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = tokenizer.encode(ids) if isinstance(ids, str) else list(ids)
    out: list[int] = []
    steps = generate_step(mx.array(ids), model, max_tokens=max_tokens, sampler=make_sampler(temp=1.0), logits_processors=[processor])
    for token, _ in steps:
        token = int(token)
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    if allow_cap and not processor.is_complete() and len(out) >= max_tokens:
        return None
    assert processor.is_complete(), f"no stop within {max_tokens} tokens: {tokenizer.decode(out)!r}"
    return tokenizer.decode(out)


def _generate_schema(model, tokenizer, compiler, name: str, seed: int, max_tokens: int, allow_cap: bool = False) -> bool:
    """Whether the output completed (it then validates); False only for a cap hit when allowed."""
    case = _load(name)
    fmt = {"type": "json_schema", "name": case["name"], "schema": case["schema"], "strict": True}
    prompt = case["prompt"] + " Answer in JSON."
    text = _generate(model, tokenizer, compiler.processor_for(fmt), prompt, seed=seed, max_tokens=max_tokens, allow_cap=allow_cap)
    if text is None:
        return False
    _validator(case["schema"]).validate(json.loads(text))
    return True


# In-process generation runs on mlx's reference BLAS (pytest is not re-executed with OpenBLAS),
# so these are slow here; tests/e2e covers the same path through a real worker in CI.
@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_SCHEMAS)
def test_model_output_validates(model, tokenizer, compiler, name):
    _generate_schema(model, tokenizer, compiler, name, seed=0, max_tokens=160)


@pytest.mark.slow
def test_model_forced_tool_call_validates(model, tokenizer, compiler):
    processor = compiler.tool_call_processor([WEATHER_TOOL, TIME_TOOL], "required", parallel=False)
    text = _generate(model, tokenizer, processor, "What's the weather in Paris right now?", seed=0, max_tokens=80)
    calls = _CALL_RE.findall(text)
    assert len(calls) == 1 and _CALL_RE.sub("", text) == ""
    call = json.loads(calls[0])
    tool = {t["name"]: t for t in (WEATHER_TOOL, TIME_TOOL)}[call["name"]]
    _validator(tool["parameters"]).validate(call["arguments"])


@pytest.mark.slow
@pytest.mark.parametrize("path", SCHEMA_FILES, ids=[p.stem for p in SCHEMA_FILES])
def test_model_output_validates_all_schemas(model, tokenizer, compiler, path):
    # At temperature 1 the small model sometimes lists items until the cap (the server answers
    # that with status "incomplete"); every output that completes must validate, and one of
    # the two must complete.
    completed = [_generate_schema(model, tokenizer, compiler, path.stem, seed=seed, max_tokens=600, allow_cap=True) for seed in range(2)]
    assert any(completed), "both samples ran to the token cap"


def test_tool_call_grammar_ignores_keywords_it_cannot_enforce(compiler):
    """The same lenient options the gateway checks tool arguments with (kiln.protocol.grammar):
    a tool whose parameters use ``if``/``then`` and ``dependentRequired`` compiles here too."""
    tool = {
        "type": "function",
        "name": "book_room",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "nights": {"type": "integer"}, "breakfast": {"type": "boolean"}},
            "required": ["city"],
            "if": {"properties": {"breakfast": {"const": True}}},
            "then": {"required": ["nights"]},
            "dependentRequired": {"breakfast": ["city"]},
        },
    }
    processor = compiler.processor_for_grammar(tool_call_grammar([tool], "required", parallel=False))
    assert processor.error is None


def test_a_tokenizer_set_to_pad_and_truncate_constrains_alike(compiler, tokenizer):
    """llguidance reads the tokenizer's JSON: one set to pad and truncate (as a folder's may be)
    is read without those settings, and allows exactly the tokens the plain one allows."""
    from tokenizers import Tokenizer as HFTokenizer

    padded = HFTokenizer.from_str(tokenizer.hf_tokenizer.to_str())
    padded.enable_padding(length=64)
    padded.enable_truncation(max_length=8)
    other = GrammarCompiler(padded, tokenizer.eos_token_ids)
    schema = {"type": "json_schema", "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}
    allowed = [np.isfinite(np.array(c.processor_for(schema)(mx.array([9]), mx.zeros((1, c.vocab_size))))[0]) for c in (compiler, other)]
    np.testing.assert_array_equal(allowed[0], allowed[1])
    assert padded.padding is not None  # the caller's tokenizer is left as it was
