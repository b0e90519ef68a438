"""Create-time checks of text.format: every refusal is a 400 naming the problem and the param."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.gateway.http.errors import ApiError
from kiln.gateway.doors.schema_check import MAX_SCHEMA_BYTES, check_json_schema, check_text_format

SCHEMA_FILES = sorted((Path(__file__).resolve().parents[1] / "data" / "schemas").glob("*.json"))


def _fmt(schema, **extra):
    return {"type": "json_schema", "name": "answer", "schema": schema, **extra}


def _refused(fmt) -> ApiError:
    with pytest.raises(ApiError) as info:
        check_text_format(fmt)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    return err


def test_fifty_data_schemas():
    assert len(SCHEMA_FILES) == 50


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=[p.stem for p in SCHEMA_FILES])
def test_data_schemas_pass(path):
    case = json.loads(path.read_text())
    assert set(case) == {"name", "prompt", "schema"} and case["prompt"]
    check_text_format(_fmt(case["schema"], name=case["name"], strict=True))


@pytest.mark.parametrize("fmt", [None, {"type": "text"}, {"type": "json_object"}])
def test_unconstrained_and_json_object_pass(fmt):
    check_text_format(fmt)


@pytest.mark.parametrize(
    "fmt, param",
    [
        ("json", "text.format"),
        (["json_schema"], "text.format"),
        ({"type": "xml"}, "text.format.type"),
        ({"schema": {"type": "object"}}, "text.format.type"),
        ({"type": "json_schema", "schema": {"type": "object"}}, "text.format.name"),
        ({"type": "json_schema", "name": "has space", "schema": {"type": "object"}}, "text.format.name"),
        ({"type": "json_schema", "name": "x" * 65, "schema": {"type": "object"}}, "text.format.name"),
        ({"type": "json_schema", "name": "answer"}, "text.format.schema"),
        (_fmt("{}"), "text.format.schema"),
        (_fmt([{"type": "object"}]), "text.format.schema"),
        (_fmt({"type": "object"}, strict="yes"), "text.format.strict"),
    ],
)
def test_wrong_shape(fmt, param):
    assert _refused(fmt).param == param


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "strnig"}, "Draft 2020-12"),
        ({"type": "object", "properties": {"a": {"type": 5}}}, "properties/a/type"),
        ({"type": "array", "minItems": -1}, "minItems"),
        ({"type": "object", "required": "a"}, "required"),
        ({"type": "string", "pattern": "["}, "regex"),
    ],
)
def test_bad_schema_types(schema, words):
    err = _refused(_fmt(schema))
    assert err.param == "text.format.schema" and words in err.message


def test_unresolvable_ref():
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "$defs": {"b": {"type": "string"}}}
    err = _refused(_fmt(schema))
    assert "#/$defs/missing" in err.message and err.param == "text.format.schema"


def test_remote_ref_is_not_fetched():
    err = _refused(_fmt({"$ref": "https://example.com/schema.json"}))
    assert "cannot be resolved" in err.message


def test_ref_words_inside_enum_are_data():
    check_text_format(_fmt({"enum": [{"$ref": "#/nowhere"}, 1]}))


def test_nested_id_scopes_refs():
    schema = {
        "type": "object",
        "properties": {"p": {"$id": "urn:example:point", "$defs": {"n": {"type": "number"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}}},
    }
    check_text_format(_fmt(schema))


def test_one_megabyte_schema():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 1000} for i in range(1000)}}
    err = _refused(_fmt(schema))
    assert str(MAX_SCHEMA_BYTES) in err.message


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"type": "string", "pattern": "^(?=a)abc$"}, "look"),
    ],
)
def test_unsupported_by_the_engine(schema, keyword):
    err = _refused(_fmt(schema))
    assert "cannot be enforced" in err.message and keyword in err.message


def test_check_json_schema_names_the_param():
    with pytest.raises(ApiError) as info:
        check_json_schema({"type": 1}, param="tools[0].parameters")
    assert info.value.param == "tools[0].parameters"


def test_gateway_module_does_not_import_mlx():
    code = "import sys, kiln.gateway.doors.schema_check; sys.exit('mlx' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_tool_arguments_ignore_keywords_the_grammar_cannot_enforce():
    """``if``/``then`` and ``dependentRequired`` are valid JSON Schema that llguidance does not
    implement: a tool that uses them is served (the worker compiles tool arguments leniently, with
    the same options, kiln.protocol.grammar), while a ``text.format`` that asks for a guarantee
    Kiln cannot give is refused."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
        "if": {"properties": {"a": {"const": "x"}}},
        "then": {"required": ["b"]},
        "dependentRequired": {"a": ["b"]},
    }
    check_json_schema(schema, param="tools[0].parameters", use="tool_arguments")
    with pytest.raises(ApiError) as refused:
        check_json_schema(schema, param="text.format.schema")
    assert refused.value.status == 400 and refused.value.param == "text.format.schema"
