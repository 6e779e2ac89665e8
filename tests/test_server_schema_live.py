"""Structured output through a live `dsv4 serve` and the official clients (chat, Responses,
Anthropic): a schema with no finite value or a keyword the grammar cannot hold is a 400 that
says why in one sentence; a strict tool's local `$ref` and an enum member holding the call
markup give a call that validates; near `max_tokens` a "stop" answer is a whole, valid value.
Answers are checked with the `jsonschema` package."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
from server_proc import Server

from dsv4stream import synth
from dsv4stream.text import dsml

MSGS = [{"role": "user", "content": "Answer."}]
CYCLE = {"type": "object", "properties": {"me": {"$ref": "#/$defs/n"}}, "required": ["me"],
         "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out: Path = tmp_path_factory.mktemp("schema_live") / "tiny"
    ckpt = synth.make_checkpoint(out, preset="tiny", seed=5, vocab_size=synth.REAL_VOCAB, tokenizer=True)
    with Server(ckpt, "--ctx", "1024") as s:
        yield s


def oa(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def one_sentence(err: Exception) -> str:
    msg = json.dumps(getattr(err, "body", None) or str(err))
    assert "%json" not in msg and "invoke_" not in msg and "x-guidance" not in msg, msg
    return msg


def test_no_finite_value_and_unenforced_keywords_are_400s_on_every_api(server) -> None:
    c = oa(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="t", messages=MSGS, max_tokens=8, response_format=fmt(CYCLE))
    assert "no finite value" in one_sentence(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="t", input="Answer.", max_output_tokens=8,
                           text={"format": {"type": "json_schema", "name": "x", "schema": CYCLE}})  # fmt: skip
    assert "no finite value" in one_sentence(e.value)
    a = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="t", messages=MSGS, max_tokens=8,
                          output_config={"format": {"type": "json_schema", "schema": CYCLE}})  # fmt: skip
    assert "no finite value" in one_sentence(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="t", messages=MSGS, max_tokens=8, tool_choice={"type": "any"},
                          tools=[{"name": "f", "input_schema": CYCLE, "strict": True}])  # fmt: skip
    assert "no finite value" in one_sentence(e.value)
    for schema, word in [({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
                         ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="t", messages=MSGS, max_tokens=8, response_format=fmt(schema))
        assert word in one_sentence(e.value)


def test_strict_tool_refs_and_markup_enums_give_calls_that_validate(server) -> None:
    c = oa(server)
    close = dsml.V4.param_close
    params = {"type": "object", "required": ["a", "b", "kind"],
              "properties": {"a": {"type": "integer", "minimum": 2}, "b": {"$ref": "#/properties/a"},
                             "kind": {"enum": [f"x{close}y", f"{dsml.V4.block_end}", "z"]}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": params, "strict": True}}]
    for seed in (1, 2, 3):
        r = c.chat.completions.create(model="t", messages=MSGS, max_tokens=200, temperature=1.0, seed=seed,
                                      tools=tools, tool_choice="required")  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls, r
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), params)


def test_a_stop_answer_near_max_tokens_is_whole_and_valid(server) -> None:
    c = oa(server)
    schema = {"type": "object", "additionalProperties": False, "required": ["mail"],
              "properties": {"mail": {"type": "string", "format": "email"}}}  # fmt: skip
    stops = 0
    for max_tokens in (16, 24, 32):
        r = c.chat.completions.create(model="t", messages=MSGS, max_tokens=max_tokens, temperature=1.0, seed=max_tokens,
                                      response_format=fmt(schema))  # fmt: skip
        choice = r.choices[0]
        if choice.finish_reason == "stop":
            stops += 1
            jsonschema.validate(json.loads(choice.message.content), schema)
        else:
            assert choice.finish_reason == "length"
    assert stops >= 2
