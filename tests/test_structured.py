"""Structured output (`llama.decoding.grammar`): answers decoded under a JSON schema's grammar are valid, even from
random weights, through `Llama.chat_completion(response_format=...)`; a schema that cannot compile is a clear error.
Over HTTP (response_format, a named tool_choice, the openai client's parse): tests/test_serve.py."""

import json

import pytest
from helpers import import_or_skip

jsonschema = import_or_skip("jsonschema", "pip install -e '.[test]'")
import_or_skip("llguidance", "pip install -e '.[serve]'")

from llama.decoding.grammar import GrammarError  # noqa: E402

SHORT = {"type": "string", "maxLength": 12}  # a random model closes a string only when it must
STEP = 0.25  # and writes digits after the point for as long as it may: multipleOf bounds them
SCHEMAS = [
    {"type": "object", "properties": {"name": SHORT}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": STEP}},
        "required": ["x"],
    },
    {"type": "object", "properties": {"tags": {"type": "array", "items": SHORT, "maxItems": 3}}, "required": ["tags"]},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"a": SHORT, "b": SHORT}, "required": ["a"]},  # b optional
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {"v": {"type": ["integer", "null"], "maximum": 99, "minimum": 0}},
        "required": ["v"],
    },
    {
        "type": "object",
        "properties": {"kind": {"const": "event"}, "day": {"enum": ["mon", "tue"]}},
        "required": ["kind", "day"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 3}},
            }
        },
        "required": ["matrix"],
    },
    {
        "anyOf": [
            {"type": "object", "properties": {"cat": SHORT}, "required": ["cat"], "additionalProperties": False},
            {"type": "object", "properties": {"dog": SHORT}, "required": ["dog"], "additionalProperties": False},
        ]
    },
    {
        "type": "object",
        "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000, "multipleOf": STEP}},
        "required": ["price"],
    },
    {
        "type": "object",
        "properties": {
            "people": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["name", "age"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["people"],
    },
    {
        "$defs": {"leaf": {"type": "integer", "minimum": 0, "maximum": 9}},
        "type": "object",
        "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
        "required": ["left", "right"],
    },
    {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": STEP},
            "label": {"enum": ["low", "high"]},
            "note": SHORT,
        },
        "required": ["ratio", "label"],
        "additionalProperties": False,
    },
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 10**6},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        },
        "required": ["id", "flags"],
    },
]


def closed(schema):
    """`schema` with every object closed to the properties it names, as OpenAI's strict schemas are: a random model
    adds properties of random names for as long as it may."""
    if isinstance(schema, dict):
        schema = {key: closed(value) for key, value in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(value) for value in schema]
    return schema


SCHEMAS = [closed(schema) for schema in SCHEMAS]


@pytest.fixture(scope="module")
def generator(tiny_checkpoint, tokenizer_path, process_group):
    from llama import Llama

    return Llama.build(str(tiny_checkpoint), tokenizer_path, max_seq_len=160, max_batch_size=2, device="cpu")


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_twenty_schemas_give_valid_answers_from_random_weights(generator, temperature):
    dialogs = [[{"role": "user", "content": "Answer in JSON."}], [{"role": "user", "content": "And again."}]]
    for schema in SCHEMAS:
        results = generator.chat_completion(
            dialogs, temperature=temperature, max_gen_len=100, response_format=response_format(schema)
        )
        for result in results:
            assert result["stop_reason"] == "end_of_turn", (schema, result)  # the grammar ended it, not the length
            jsonschema.validate(json.loads(result["generation"]["content"]), schema)


def test_json_object_gives_an_object_and_plain_text_is_unconstrained(generator):
    dialog = [{"role": "user", "content": "Hi"}]
    constrained = generator.chat_completion(
        [dialog], temperature=0, max_gen_len=40, response_format={"type": "json_object"}
    )[0]
    free = generator.chat_completion([dialog], temperature=0, max_gen_len=40)[0]
    assert constrained["generation"]["content"].startswith("{")
    text = generator.chat_completion([dialog], temperature=0, max_gen_len=40, response_format={"type": "text"})[0]
    assert text == free
    assert not free["generation"]["content"].startswith("{")  # what this model writes when nothing constrains it


@pytest.mark.parametrize(
    "schema, named",
    [
        ({"type": "object", "properties": {"x": {"type": "strng"}}}, "strng"),
        ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, "missing"),
        ({"type": "string", "pattern": "(("}, "unclosed group"),
    ],
)
def test_a_schema_that_cannot_compile_is_an_error_that_names_the_part(generator, schema, named):
    with pytest.raises(GrammarError, match=named):
        generator.chat_completion([[{"role": "user", "content": "Hi"}]], response_format=response_format(schema))


def test_an_unknown_response_format_type_is_an_error(generator):
    with pytest.raises(ValueError, match="json_schema"):
        generator.chat_completion([[{"role": "user", "content": "Hi"}]], response_format={"type": "yaml"})
