"""Tool calls the request constrains: a `strict` tool's arguments parse and validate against
its schema whatever the weights, `tool_choice` "required" or a named function forces a call
(of that function), `parallel_tool_calls: false` one call. The grammar is built from the DSML
tags `dsml` reads, and accepts the official encoder's own rendering of a call. In-process:
random logits through `Constraint`, as the engine thread applies it (the live path, with the
official clients, is in test_server_api.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict, Field

from dsv4stream import synth
from dsv4stream.server.grammar import GrammarError, Grammars
from dsv4stream.server.schemas import ChatRequest
from dsv4stream.server.toolgrammar import V4, ToolSpec, answer_grammar, request_shape
from dsv4stream.text import chat, dsml
from dsv4stream.text.chat import Message, ToolCall
from dsv4stream.text.dsml import BLOCK_START, parse_reply
from dsv4stream.text.tokenizer import EOS, Tokenizer


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str
    days: int = Field(ge=1, le=14)
    unit: str = Field(pattern="^(c|f)$")
    tags: list[str]


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "days", "unit", "tags"],
    "additionalProperties": False,
}
FREE = {"type": "object", "properties": {"q": {"type": "string"}}}


def tools_body(strict: bool = True) -> list[dict]:
    return [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": strict}},
        {"type": "function", "function": {"name": "search", "parameters": FREE}},
    ]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tools") / "tiny"
    return Tokenizer.from_checkpoint(synth.make_checkpoint(out, preset="tiny", seed=2, vocab_size=synth.REAL_VOCAB,
                                                           tokenizer=True))  # fmt: skip


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars(tok, max(tok.vocab_size, tok.n_tokens))


def shape_of(grammars: Grammars, **fields):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools_body(), **fields}
    return request_shape(grammars, ChatRequest.model_validate(body), body, tools_on=True)


def generate(grammars: Grammars, shape, seed: int, budget: int, prefix: list[int] = ()) -> str:
    """A random-weight model's answer under the constraint: `prefix` ids first (as a model that
    chose to write them), then random logits, `budget` tokens at most."""
    rng = np.random.default_rng(seed)
    c = grammars.constraint(shape, thinking=False)
    out: list[int] = []
    eos = grammars.tok.special.eos
    for left in range(budget, 0, -1):
        logits = rng.normal(size=grammars.n_vocab).astype(np.float32) * 3
        if len(out) < len(prefix):
            logits[prefix[len(out)]] = 1e4
        x = c.restrict(logits, left)
        t = int(np.argmax(x + rng.gumbel(size=x.size)))
        assert np.isfinite(x[t])
        c.advance(t)
        if t == eos:
            break
        out.append(t)
    else:
        pytest.fail(f"no EOS within {budget} tokens")
    return grammars.tok.decode(out)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_strict_call_validates_whatever_the_weights(grammars, choice, seed) -> None:
    text = generate(grammars, shape_of(grammars, tool_choice=choice, parallel_tool_calls=False), seed, 400)
    reply = parse_reply(text, thinking=False)
    assert reply.content == "" and len(reply.tool_calls) == 1, text
    call = reply.tool_calls[0]
    if isinstance(choice, dict):
        assert call.name == "get_weather"
    if call.name == "get_weather":
        Weather.model_validate_json(call.arguments)
    else:
        assert isinstance(json.loads(call.arguments), dict)


def test_auto_leaves_text_free_and_constrains_a_call_once_it_opens(grammars, tok) -> None:
    shape = shape_of(grammars, tool_choice="auto")
    assert shape is not None and shape.opening == tuple(tok.encode(BLOCK_START))
    opening = tok.encode("I will look." + BLOCK_START + '\n<｜DSML｜invoke name="get_weather">\n')
    text = generate(grammars, shape, 3, 400, prefix=opening)
    reply = parse_reply(text, thinking=False)
    assert reply.content == "I will look." and reply.tool_calls[0].name == "get_weather", text
    for call in reply.tool_calls:
        if call.name == "get_weather":
            Weather.model_validate_json(call.arguments)
    assert parse_reply(generate(grammars, shape, 4, 40), thinking=False).tool_calls == ()


def test_nothing_is_constrained_without_strict_tools_or_a_forcing_choice(grammars) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools_body(strict=False)}
    assert request_shape(grammars, ChatRequest.model_validate(body), body, tools_on=True) is None
    assert request_shape(grammars, ChatRequest.model_validate(body), body, tools_on=False) is None


def test_the_grammar_accepts_the_official_encoders_rendering_of_a_call(grammars, tok) -> None:
    args = {"city": 'Paris, "centre"', "days": 3, "unit": "c", "tags": ["a b", "ü"]}
    rendered = chat.render([Message("user", "hi"), Message("assistant", "", tool_calls=(
        ToolCall("get_weather", json.dumps(args)), ToolCall("search", json.dumps({"q": "x", "n": [1]}))))], "chat")  # fmt: skip
    block = rendered[rendered.index(BLOCK_START) :].removesuffix(EOS)
    for choice in ("required", "auto"):
        shape = shape_of(grammars, tool_choice=choice)
        c = grammars.constraint(shape, thinking=False)
        ids = tok.encode(block)
        assert c.matcher.try_consume_tokens(ids) == len(ids) and c.matcher.is_accepting(), choice
    one = grammars.constraint(shape_of(grammars, tool_choice="required", parallel_tool_calls=False), thinking=False)
    assert one.matcher.try_consume_tokens(tok.encode(block)) < len(tok.encode(block))  # two calls: refused


@pytest.mark.parametrize(
    "parameters",
    [
        {"anyOf": [{"type": "object"}, {"type": "string"}]},
        {"type": "object", "properties": {"a": {"type": "string"}}, "patternProperties": {"^x": {}}},
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
        {"type": "array"},
    ],
)
def test_a_strict_schema_a_call_cannot_carry_is_refused(parameters) -> None:
    with pytest.raises(GrammarError, match="get_weather"):
        answer_grammar(V4, [ToolSpec("get_weather", parameters, True)], "auto", True, None)


def test_a_named_choice_must_be_one_of_the_tools() -> None:
    with pytest.raises(GrammarError, match="not one of the tools"):
        answer_grammar(V4, [ToolSpec("get_weather", WEATHER, True)], "get_time", True, None)


def test_unconstrained_requests_keep_no_grammar(grammars) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert request_shape(grammars, ChatRequest.model_validate(body), body, tools_on=False) is None


def test_v41_tools_are_constrained_in_v41s_tags(grammars, tok) -> None:
    # a V4.1 checkpoint's prompt names dsml.V41: its strict calls are written and read in ` calls`...
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools_body(), "tool_choice": "required"}
    shape = request_shape(grammars, ChatRequest.model_validate(body), body, True, dsml.V41)
    text = generate(grammars, shape, 5, 400)
    assert text.startswith("\n\n<｜DSML｜ calls>") and "<｜DSML｜tool_calls>" not in text, text
    calls = parse_reply(text, thinking=False, grammar=dsml.V41).tool_calls
    assert calls and all(isinstance(json.loads(c.arguments), dict) for c in calls)
    args = {"city": "Paris", "days": 3, "unit": "c", "tags": ["ü"]}
    rendered = chat.render([Message("user", "hi"), Message("assistant", "", tool_calls=(
        ToolCall("get_weather", json.dumps(args)),))], "chat", encoder="v41")  # fmt: skip
    block = rendered[rendered.index(dsml.V41.block_start) :].removesuffix(EOS)
    ids = tok.encode(block)
    c = grammars.constraint(shape, thinking=False)
    assert c.matcher.try_consume_tokens(ids) == len(ids) and c.matcher.is_accepting()
