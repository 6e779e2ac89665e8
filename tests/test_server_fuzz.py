"""Random mutations of valid requests to every POST endpoint of a live `dsv4 serve` (hypothesis):
each answer is 2xx or 4xx, never 5xx, with a JSON error body in the API's shape, and the
server still answers /health afterwards."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_proc import Server

from dsv4stream.checkpoint import synth

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

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)  # fmt: skip
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


@st.composite
def mutated(draw):
    path = draw(st.sampled_from(sorted(VALID)))
    body = json.loads(json.dumps(VALID[path]))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(body))[1:]
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
