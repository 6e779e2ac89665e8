"""The JSON-Schema subset structured output enforces (`server/subset.py`), in-process: schemas
with no finite value and keywords the grammar cannot hold are refused in one sentence, local
`$ref`s resolve anywhere in a strict tool's parameters, enum members holding the call markup
round-trip through `dsml.parse_block`, and near the end of `max_tokens` a value ends whole
(finish "stop", valid) or the answer says "length". Answers come from random logits through
`Picker` and `Constraint`, as the engine thread applies them, and are checked with the
`jsonschema` package (an independent validator). The live server path is in
test_server_schema_live.py."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from dsv4stream import synth
from dsv4stream.server.decoding import Controls, Picker
from dsv4stream.server.grammar import GrammarError, Grammars, Shape
from dsv4stream.server.schemas import ChatRequest
from dsv4stream.server.toolgrammar import V4, V41, ToolSpec, answer_grammar, request_shape
from dsv4stream.text import dsml
from dsv4stream.text.dsml import parse_reply
from dsv4stream.text.sampler import SamplingParams
from dsv4stream.text.tokenizer import Tokenizer

# schemas with no finite value: each needs itself without end
NO_FINITE = [
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
    {
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/n"}},
    },
    {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    {"definitions": {"x": {"allOf": [{"$ref": "#/definitions/x"}, {"type": "string"}]}}, "$ref": "#/definitions/x"},
    {
        "type": "object",
        "properties": {
            "a": {"anyOf": [{"$ref": "#/properties/a"}, {"$ref": "#/properties/b"}]},
            "b": {"type": "array", "prefixItems": [{"$ref": "#/properties/a"}], "minItems": 1},
        },
        "required": ["a"],
    },
]
NO_FINITE_TOOL = [
    {"type": "object", "properties": {"v": {"$ref": "#/properties/v"}}, "required": ["v"]},
    {
        "type": "object",
        "properties": {"v": {"type": "object", "properties": {"w": {"$ref": "#/properties/v"}}, "required": ["w"]}},
    },
    {
        "type": "object",
        "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 2}},
        "properties": {"v": {"$ref": "#/$defs/n"}},
    },
]
# recursive schemas that do have finite values: accepted
FINITE = [
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    {
        "$defs": {
            "l": {
                "type": "object",
                "properties": {"next": {"anyOf": [{"$ref": "#/$defs/l"}, {"type": "null"}]}},
                "required": ["next"],
            }
        },
        "$ref": "#/$defs/l",
    },
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # untyped: a string or null is a value
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("schemas") / "tiny"
    return Tokenizer.from_checkpoint(
        synth.make_checkpoint(out, preset="tiny", seed=2, vocab_size=synth.REAL_VOCAB, tokenizer=True)
    )


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars(tok, max(tok.vocab_size, tok.n_tokens))


def generate(grammars: Grammars, shape: Shape, seed: int, budget: int) -> tuple[str, str]:
    """(text, finish_reason) of a random-weight answer through `Picker`, as the worker ends it."""
    rng = np.random.default_rng(seed)
    c = grammars.constraint(shape, thinking=False)
    pick = Picker(Controls(grammar=shape), SamplingParams(temperature=1.0), grammars.n_vocab, rng, [], budget, c)
    eos, out = grammars.tok.special.eos, []
    for _ in range(budget):
        t = pick(rng.normal(size=grammars.n_vocab).astype(np.float32) * 3)
        if t == eos:
            return grammars.tok.decode(out), "stop" if pick.complete else "length"
        out.append(t)
    return grammars.tok.decode(out), "length"


@pytest.mark.parametrize("schema", NO_FINITE)
def test_a_schema_with_no_finite_value_is_refused(grammars, schema) -> None:
    with pytest.raises(GrammarError, match="no finite value"):
        grammars.compile_schema(schema, "response_format.json_schema.schema")


@pytest.mark.parametrize("parameters", NO_FINITE_TOOL)
def test_a_strict_tool_with_no_finite_call_is_refused(parameters) -> None:
    with pytest.raises(GrammarError, match="tools: f: .*no finite value"):
        answer_grammar(V4, [ToolSpec("f", parameters, True)], "required", True, None)


@pytest.mark.parametrize("schema", FINITE)
def test_recursive_schemas_with_a_way_out_are_kept_and_answers_validate(grammars, schema) -> None:
    shape = Shape(grammars.compile_schema(schema, "s"))
    for seed in (1, 2):
        text, why = generate(grammars, shape, seed, 60)
        if why == "stop":
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
        ({"type": "array", "items": {"contains": {"const": 1}}}, "contains"),
        ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "oneOf"),
        ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
        ({"type": "string", "nullable": True}, "nullable"),  # not JSON Schema: refused, not ignored
        ({"type": "number", "minimum": 1, "exclusiveMinimum": True}, "exclusiveMinimum"),
        ({"type": "string", "x-guidance": {"lenient": True}}, "x-guidance"),
        ({"$defs": {"a": {"$dynamicAnchor": "a"}}, "$dynamicRef": "#a"}, "$dynamicRef"),
    ],
)
def test_a_keyword_the_grammar_does_not_enforce_is_refused_by_name(grammars, schema, keyword) -> None:
    with pytest.raises(GrammarError, match=f"'\\{keyword}'" if keyword.startswith("$") else f"'{keyword}'"):
        grammars.compile_schema(schema, "response_format.json_schema.schema")


def test_every_keyword_is_enforced_annotated_or_refused() -> None:
    # the three sets do not overlap, and the docs list each keyword of each set
    from dsv4stream.server import subset

    sets = [subset.ENFORCED, subset.ANNOTATIONS, set(subset.REFUSED)]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    missing = [k for s in sets for k in s if f"`{k}`" not in doc]
    assert not missing, missing


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "minProperties": 2, "maxProperties": 3},
        {"type": "object", "properties": {"a": {"type": "object", "minProperties": 1}}, "required": ["a"]},
        {
            "type": "object",
            "title": "t",
            "description": "d",
            "examples": [{}],
            "$comment": "c",
            "default": {},
            "properties": {"n": {"type": "integer", "deprecated": True, "readOnly": True, "minimum": 3}},
            "required": ["n"],
        },
        {"type": "string", "format": "email"},
        {"type": "string", "format": "uri"},
        {"type": "object", "properties": {"p": {"type": "string", "pattern": "^((ab){2}c){3}$"}}, "required": ["p"]},
        {"type": "object", "properties": {"d": {"type": "string", "format": "duration"}}, "required": ["d"]},
    ],
)
def test_accepted_keywords_hold_and_a_stop_answer_validates_at_any_budget(grammars, schema) -> None:
    shape = Shape(grammars.compile_schema(schema, "s"))
    stops = 0
    for budget in (6, 9, 14, 24, 40):
        text, why = generate(grammars, shape, budget, budget)
        if why == "stop":
            stops += 1
            jsonschema.validate(json.loads(text), schema)  # "stop" only for a whole, valid value
    assert stops >= 2  # the budget's end closes the value once the shortest one fits


@pytest.mark.parametrize("fmt", ["email", "uri", "duration"])
def test_a_string_with_a_format_is_closed_before_the_budget_ends(grammars, fmt) -> None:
    # a random model never writes the `@`/`:` the format needs: the completion search finds it
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    shape = Shape(grammars.compile_schema(schema, "s"))
    for seed in (1, 2, 3):
        text, why = generate(grammars, shape, seed, 40)
        assert why == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_a_stop_finish_needs_a_whole_value(grammars, tok) -> None:
    # a matcher that cannot go on (its error state offers only EOS) ends with "length", not "stop"
    shape = Shape(grammars.compile_schema({"type": "string", "pattern": "^((ab){2}c){3}$"}, "s"))
    pick = Picker(
        Controls(grammar=shape),
        SamplingParams(),
        grammars.n_vocab,
        np.random.default_rng(0),
        [],
        20,
        grammars.constraint(shape, thinking=False),
    )
    pick.constraint.matcher.consume_token(tok.encode('"')[0])
    assert not pick.complete
    pick.constraint.matcher.consume_token(tok.encode("zz")[0])
    assert pick.constraint.matcher.is_error() and not pick.complete


# ---- strict tools -------------------------------------------------------------------------------
def tool_shape(grammars: Grammars, parameters: dict, markup=dsml.V4):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters, "strict": True}}],
    }
    return request_shape(grammars, ChatRequest.model_validate(body), body, True, markup)


@pytest.mark.parametrize(
    "parameters",
    [
        {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 5}, "b": {"$ref": "#/properties/a"}},
            "required": ["a", "b"],
        },
        {
            "type": "object",
            "properties": {
                "a/b": {"enum": ["x", "y"]},
                "c~d": {"type": "boolean"},
                "e": {"type": "array", "items": {"$ref": "#/properties/a~1b"}, "minItems": 1},
                "f": {"$ref": "#/properties/c~0d"},
            },
            "required": ["e", "f"],
        },
        {
            "type": "object",
            "$defs": {
                "p": {
                    "type": "object",
                    "properties": {"q": {"$ref": "#/$defs/p/properties/r"}, "r": {"type": "integer"}},
                    "required": ["q"],
                }
            },
            "properties": {"p": {"$ref": "#/$defs/p"}, "s": {"$ref": "#/$defs/p/properties/r"}},
            "required": ["p", "s"],
        },
        {
            "type": "object",
            "properties": {
                "a": {"$anchor": "num", "type": "number"},
                "b": {"$ref": "#num"},
                "c": {"$ref": "#/properties/%61"},
            },
            "required": ["b", "c"],
        },
    ],
)
def test_a_local_ref_anywhere_in_a_strict_tool_resolves_and_calls_validate(grammars, parameters) -> None:
    shape = tool_shape(grammars, parameters)
    for seed in (1, 2):
        text, why = generate(grammars, shape, seed, 300)
        calls = parse_reply(text, thinking=False).tool_calls
        assert why == "stop" and len(calls) >= 1, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), parameters)


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "only references inside"),
        ({"type": "object", "properties": {"a": {"$ref": "#/properties/zz"}}}, "points at nothing"),
        ({"type": "object", "properties": {"a": {"$ref": "#nowhere"}}}, "no $anchor"),
    ],
)
def test_an_unsupported_ref_is_one_sentence_without_the_grammar(grammars, parameters, says) -> None:
    with pytest.raises(GrammarError) as e:
        tool_shape(grammars, parameters)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and "%json" not in msg and "invoke_" not in msg and len(msg) < 300


@pytest.mark.parametrize("markup", [dsml.V4, dsml.V41])
def test_an_enum_member_holding_the_call_markup_round_trips(grammars, tok, markup) -> None:
    close = markup.param_close
    members = [f"a{close}b", f"{markup.block_end}", "plain", f'x">{close}\n{markup.invoke_close}']
    parameters = {
        "type": "object",
        "properties": {"m": {"type": "string", "enum": members}, "k": {"const": members[0]}},
        "required": ["m", "k"],
    }
    shape = tool_shape(grammars, parameters, markup)
    seen = set()
    for seed in range(6):
        text, why = generate(grammars, shape, seed, 400)
        calls = parse_reply(text, thinking=False, grammar=markup).tool_calls
        assert why == "stop" and calls, text
        for call in calls:
            args = json.loads(call.arguments)
            jsonschema.validate(args, parameters)
            seen.add(args["m"])
    assert len(seen) >= 2


def test_a_nested_value_holding_the_call_markup_is_refused(grammars) -> None:
    bad = {
        "type": "object",
        "properties": {"o": {"type": "object", "properties": {"x": {"enum": [f"a{V4.param_close}"]}}}},
    }
    with pytest.raises(GrammarError, match="call markup"):
        answer_grammar(V4, [ToolSpec("f", bad, True)], "required", True, None)
    fine = {"type": "object", "properties": {"o": {"enum": [f"a{V41.param_close}"]}}}  # V4.1's tag is not V4's
    answer_grammar(V4, [ToolSpec("f", fine, True)], "required", True, None)
