"""Random mutations of valid requests to every POST endpoint of a live `dsv4 serve` (hypothesis):
each answer is 2xx or 4xx, never 5xx, with a JSON error body in the API's shape, and the
server still answers /health afterwards."""

from __future__ import annotations

import http.client
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_proc import Server

from dsv4stream import synth

VALID = {
    "/v1/chat/completions": {
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n"], "logprobs": True,
        "top_logprobs": 2, "n": 1, "stream": False, "response_format": {"type": "text"},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    },
    "/v1/completions": {"prompt": "Once", "max_tokens": 2, "temperature": 0.0, "logprobs": 1, "stream": False},
    "/v1/messages": {
        "system": "Be terse.", "max_tokens": 2, "temperature": 0.5, "stop_sequences": ["x"],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    },
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "Hi"}]},
    "/v1/responses": {"input": [{"role": "user", "content": "Hi"}], "instructions": "Be terse.",
                      "max_output_tokens": 2, "reasoning": {"effort": "low"}},
}  # fmt: skip

# where the client writes free JSON of its own: a JSON schema, a call's input, a map of its own keys
FREE = {"parameters", "schema", "input_schema", "input", "logit_bias", "metadata"}

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)  # fmt: skip
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def mutated(draw):
    path = draw(st.sampled_from(sorted(VALID)))
    body = json.loads(json.dumps(VALID[path]))
    for _ in range(draw(st.integers(1, 3))):
        paths = [where for where, _ in _walk(body, free=())][1:]
        if not paths:  # an earlier mutation emptied the body: that is a case of its own
            break
        where = draw(st.sampled_from(paths))
        parent = body
        for key in where[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "delete":
            del parent[where[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=12))] = draw(json_value)
        else:
            parent[where[-1]] = draw(json_value)
    # keep each request short: the mutations are about parsing, not about generating long answers
    for key in ("max_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 4:
            body[key] = 4
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
        body["n"] = 2
    return path, body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ck: Path = synth.make_checkpoint(
        tmp_path_factory.mktemp("fuzz") / "tiny", preset="tiny", seed=5, vocab_size=synth.REAL_VOCAB, tokenizer=True
    )
    with Server(ck, "--ctx", "256") as s:
        yield s


def _post(srv: Server, path: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = conn.getresponse()
    status, raw = r.status, r.read()
    conn.close()
    return status, raw


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mutated())
def test_mutated_requests_get_2xx_or_4xx_and_the_server_goes_on(server, case) -> None:
    path, body = case
    status, raw = _post(server, path, body)
    assert 200 <= status < 500, (status, raw[:300], body)
    if status >= 400:
        err = json.loads(raw)
        assert (
            (err["type"] == "error" and err["error"]["message"])
            if path.startswith("/v1/messages")
            else err["error"]["message"]
        )
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()


# ---- every field, every wrong type (in-process: refusals come before the engine) ---------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
FN = {"name": "f", "description": "d", "parameters": SCHEMA, "strict": True}
# a body per endpoint that holds every structure its request model reads, nested ones included
RICH = {
    "/v1/chat/completions": {
        "model": "tiny", "max_tokens": 2, "max_completion_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
        "min_p": 0.1, "seed": 3, "n": 1, "logit_bias": {"5": 1.0}, "frequency_penalty": 0.1, "presence_penalty": 0.1,
        "user": "u", "safety_identifier": "s", "service_tier": "auto", "prompt_cache_key": "k", "stop": ["\n"],
        "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2,
        "parallel_tool_calls": True, "store": False, "modalities": ["text"], "verbosity": "medium",
        "thinking": {"type": "enabled", "budget_tokens": 5}, "reasoning_effort": "high",
        "tools": [{"type": "function", "function": FN}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA, "strict": True,
                                                                   "description": "d"}},
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "", "reasoning_content": "r",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "ok"},
        ],
    },
    "/v1/completions": {
        "model": "tiny", "prompt": "Once", "max_tokens": 2, "temperature": 0.0, "logprobs": 1, "stream": False,
        "stop": ["\n"], "logit_bias": {"5": 1.0}, "seed": 1, "n": 1, "echo": False, "best_of": 1,
    },
    "/v1/responses": {
        "model": "tiny", "instructions": "Be terse.", "max_output_tokens": 2, "temperature": 0.5, "top_p": 0.9,
        "stream": False, "parallel_tool_calls": True, "store": False, "metadata": {"k": "v"}, "user": "u",
        "safety_identifier": "s", "prompt_cache_key": "k", "service_tier": "auto", "seed": 1,
        "truncation": "disabled", "include": ["message.output_text.logprobs"], "top_logprobs": 1,
        "reasoning": {"effort": "low", "summary": "auto"},
        "text": {"format": {"type": "json_schema", "name": "o", "schema": SCHEMA, "strict": True},
                 "verbosity": "medium"},
        "tools": [{"type": "function", **FN}], "tool_choice": {"type": "function", "name": "f"},
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}],
             "content": [{"type": "reasoning_text", "text": "r"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "done", "annotations": []}]},
        ],
    },
    "/v1/messages": {
        "model": "tiny", "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "stop_sequences": ["x"],
        "stream": False, "metadata": {"user_id": "u"}, "service_tier": "auto",
        "system": [{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "enabled", "budget_tokens": 5},
        "tools": [{"name": "f", "description": "d", "input_schema": SCHEMA, "strict": True}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "output_config": {"effort": "high"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "r", "signature": ""},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": "b"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": False,
                                          "content": [{"type": "text", "text": "ok"}]}]},
        ],
    },
    "/v1/page/tokens": {"text": "Hi"},
}  # fmt: skip
RICH["/v1/messages/count_tokens"] = {
    k: v for k, v in RICH["/v1/messages"].items()
    if k not in ("max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "stream", "metadata", "service_tier")
}  # fmt: skip
# values any client could send in place of another's: each of JSON's kinds, and numbers past any range
# fields that take several kinds of JSON (text, or a list of parts; a call's arguments as text or object)
OTHER_KINDS = {
    "stop": ("string",), "prompt": ("list",), "messages.N.content": ("string",), "system": ("string",),
    "messages.N.tool_calls.N.function.arguments": ("object",), "input": ("string",),
    "messages.N.content.N.content": ("string",), "input.N.content": ("string",), "input.N.output": ("list",),
}  # fmt: skip
WRONG = [5, 0, -1, 1.5, 10**30, 2**63 - 1, "x", "", True, None, {"k": 1}, [1], [{"k": 1}]]


def _dotted(path) -> str:
    return ".".join(str(p) for p in path)


def _walk(obj, prefix=(), free=FREE):
    """Every (path, value) of a body, not descending into the keys named in `free`."""
    yield prefix, obj
    if prefix and prefix[-1] in free:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, (*prefix, k), free)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, (*prefix, i), free)


def _with(body, path, value):
    out = json.loads(json.dumps(body))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from dsv4stream.server.app import create_app
    from dsv4stream.server.toolkit import ApiError, ServerState
    from dsv4stream.text.tokenizer import Tokenizer

    ckpt = synth.make_checkpoint(tmp_path_factory.mktemp("walk") / "tiny", preset="tiny", seed=3,
                                 vocab_size=synth.REAL_VOCAB, tokenizer=True)  # fmt: skip
    srv = ServerState("tiny", Tokenizer.from_checkpoint(ckpt), 512, lambda line: None)

    def submit(job):  # a request that passed every check: answered here without an engine
        raise ApiError(409, "checked and queued", code="reached_engine")

    srv.worker = SimpleNamespace(queued=0, ahead=0, submit=submit)
    with TestClient(create_app(srv), raise_server_exceptions=False) as c:
        yield c


def _answer(client, path: str, body) -> tuple[int, str]:
    """(status, the error's message: "" for an answer)."""
    r = client.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    err = r.json()
    return r.status_code, err.get("error", {}).get("message") or "" if isinstance(err.get("error"), dict) else ""


@pytest.mark.parametrize("path", sorted(RICH))
def test_the_rich_bodies_are_valid(inproc, path) -> None:
    status, message = _answer(inproc, path, RICH[path])
    assert status in PASSED, message


PASSED = (200, 409)  # answered (count_tokens, page/tokens) or checked and queued
# a field whose change may be refused as the other field of a rule between the two
RELATED = {
    "tools": ("tool_choice",), "thinking": ("output_config.effort",), "tool_choice": ("tools",),
    "logprobs": ("top_logprobs",), "include": ("top_logprobs",), "stream": ("stream_options",),
}  # fmt: skip


def _kind(value) -> str:
    return {bool: "bool", int: "number", float: "number", str: "string", list: "list", dict: "object"}.get(
        type(value), "null"
    )


@pytest.mark.parametrize("path", sorted(RICH))
def test_every_field_with_every_wrong_type_is_a_4xx_naming_it(inproc, path) -> None:
    """Each field of the endpoint's body (nested ones included) replaced by each kind of JSON
    value: never a 5xx; a refusal names the field, or the object holding it (a rule between
    its fields, a required key gone), or the field a rule ties it to. A value of another kind
    than the one in the valid body may pass only where the field takes several (`OTHER_KINDS`)."""
    bad = []
    for where, value in list(_walk(RICH[path]))[1:]:
        field = _dotted(where)
        for wrong in WRONG:
            if wrong == value and type(wrong) is type(value):
                continue
            if where[-1] in FREE and isinstance(wrong, dict):
                continue  # a JSON schema's own content is the grammar's to judge (test_server_grammar)
            status, message = _answer(inproc, path, _with(RICH[path], where, wrong))
            named = message.split(":", 1)[0]
            if status in PASSED:
                kinds = OTHER_KINDS.get(re.sub(r"\.\d+", ".N", field), ())
                if _kind(wrong) not in (_kind(value), "null", *kinds):
                    bad.append((field, wrong, status, "passed"))
                continue
            near = _dotted(where[:-1])
            # a rule between two fields may be told in words by the module that checks it
            related = (where[0], *RELATED[where[0]]) if where[0] in RELATED else ()
            ok = named.startswith(field) or named == near or message.startswith(related)
            if status >= 500 or not 400 <= status < 500 or not ok:
                bad.append((field, wrong, status, message[:160]))
    assert not bad, "\n".join(map(str, bad))


@pytest.mark.parametrize("path", sorted(RICH))
def test_an_unknown_field_anywhere_is_a_400_naming_it(inproc, path) -> None:
    bad = []
    for where, value in _walk(RICH[path]):
        if isinstance(value, dict) and not (where and where[-1] in FREE):
            status, message = _answer(inproc, path, _with(RICH[path], (*where, "zz_unknown"), 1) if where
                                            else {**value, "zz_unknown": 1})  # fmt: skip
            if status != 400 or not message.startswith(_dotted((*where, "zz_unknown")) + ": not supported here"):
                bad.append((_dotted(where), status, message[:160]))
    assert not bad, "\n".join(map(str, bad))


@pytest.mark.parametrize("key", ["9" * 5000, "1" * 30, "-1", "x", " 5", "٣"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_logit_bias_key_that_is_no_token_id_is_a_400(inproc, path, key) -> None:
    status, message = _answer(inproc, path, {**RICH[path], "logit_bias": {key: 1.0}})
    assert status == 400 and message.startswith("logit_bias"), message
