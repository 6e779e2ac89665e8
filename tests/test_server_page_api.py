"""What `dsv4 serve` gives the chat page beyond the OpenAI API, over real HTTP: the page's
info (reasoning efforts of the checkpoint's chat format), token counts of a text, the
expert cache picture (most recently used first), and the per-answer figures and queue
positions that the chat stream carries as SSE comments, which the official client skips."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from fastapi.testclient import TestClient
from server_proc import Server

from dsv4stream import synth
from dsv4stream.checkpoint.config import ModelConfig
from dsv4stream.server.app import create_app
from dsv4stream.server.security import Guard, Policy
from dsv4stream.server.toolkit import ServerState
from dsv4stream.text import chat
from dsv4stream.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pageapi") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=5, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def server(ckpt):
    with Server(ckpt, "--ctx", "4096", "--prefill-segment", "16") as s:
        yield s


@pytest.fixture(scope="module")
def one_at_a_time(ckpt):
    """A server that decodes one request at a time (`--max-batch 1`): a second one waits in the
    queue and is told its place (the default batches it beside the first)."""
    with Server(ckpt, "--ctx", "4096", "--prefill-segment", "16", "--max-batch", "1") as s:
        yield s


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_checkpoint(ckpt)


def get(srv: Server, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def post(srv: Server, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def stream_lines(srv: Server, body: dict) -> list[str]:
    """Every line of a streamed chat answer, comments included."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    return r.read().decode().splitlines()


def page_events(lines: list[str]) -> list[tuple[str, object]]:
    out = []
    for line in lines:
        if line.startswith(": dsv4 "):
            (kind, payload), *rest = json.loads(line[7:]).items()
            assert not rest
            out.append((kind, payload))
    return out


def chat_body(text: str, n: int, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": n, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, **kw}  # fmt: skip


def test_page_info_names_the_checkpoint_and_its_reasoning_efforts(server, ckpt) -> None:
    status, info = get(server, "/v1/page/info")
    assert status == 200 and info["model"] == "tiny" and info["ctx"] == 4096 and info["ready"] is True
    # the generated checkpoint has the preview's mtp layout: the preview's chat format, high/max
    assert info["chat_format"] == chat.encoder_for(ModelConfig.from_json(ckpt / "config.json").layout) == "preview"
    assert info["reasoning_effort"] == {"kind": "levels", "values": ["high", "max"], "default": "high"}
    cfg = json.loads((ckpt / "config.json").read_text())
    assert (info["layers"], info["experts"]) == (cfg["num_hidden_layers"], cfg["n_routed_experts"])
    assert info["experts_per_token"] == cfg["num_experts_per_tok"] and info["slots"] >= 1


def test_0731_checkpoints_offer_their_own_efforts(tok) -> None:
    srv = ServerState("tiny", tok, 512, lambda line: None, encoder="0731")
    with TestClient(create_app(srv)) as client:
        info = client.get("/v1/page/info").json()
    assert info["reasoning_effort"] == {"kind": "levels", "values": ["low", "high", "max"], "default": "low"}
    assert info["ready"] is False and "layers" not in info


def test_token_count_of_a_text_is_the_tokenizers(server, tok) -> None:
    text = "def f(x):\n    return x * 2  # ünïcode ✓\n" * 50
    status, got = post(server, "/v1/page/tokens", json.dumps({"text": text}).encode())
    assert status == 200 and got == {"tokens": len(tok.encode(text)), "characters": len(text)}
    assert post(server, "/v1/page/tokens", b'{"text": ""}') == (200, {"tokens": 0, "characters": 0})
    for bad in (b'{"text": 3}', b"{}", b'{"text": ["a"]}'):
        status, err = post(server, "/v1/page/tokens", bad)
        assert status == 400 and err["error"]["message"].startswith("text: give the text"), (bad, err)
    status, err = post(server, "/v1/page/tokens", b"not json")
    assert status == 400 and err["error"]["code"] == "invalid_json"


def test_a_numeric_effort_format_offers_its_range(tok) -> None:
    # a chat format without named V4 levels (V4.1's) takes a number 1-100
    srv = ServerState("tiny", tok, 512, lambda line: None, encoder="v41")
    with TestClient(create_app(srv)) as client:
        info = client.get("/v1/page/info").json()
    assert info["reasoning_effort"] == {
        "kind": "range", "min": 1, "max": 100, "default": 75, "named": {"low": 50, "high": 75, "max": 100}
    }  # fmt: skip


def test_page_routes_are_behind_the_api_key(tok) -> None:
    srv = ServerState("tiny", tok, 512, lambda line: None)
    guarded = Guard(create_app(srv), Policy(api_key="sesame", allowed_hosts=("testserver",)))
    with TestClient(guarded) as client:
        for path in ("/v1/page/info", "/v1/page/experts"):
            assert client.get(path).status_code == 401
        assert client.post("/v1/page/tokens", json={"text": "a"}).status_code == 401
        assert client.get("/v1/page/info", headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_the_expert_picture_lists_resident_experts_most_recent_first(tok) -> None:
    # the store keeps least recently used first; the picture wants the last token's first
    keys = [(0, 3), (1, 2), ("mtp", 0), (2, 9), (3, 7), (1, 0)]
    store = SimpleNamespace(slots=8, resident=lambda: list(keys))
    cfg = SimpleNamespace(n_layers=4, n_routed_experts=16, num_experts_per_tok=2)
    srv = ServerState("tiny", tok, 512, lambda line: None)
    srv.worker = SimpleNamespace(rt=SimpleNamespace(cfg=cfg, store=store))
    with TestClient(create_app(srv)) as client:
        got = client.get("/v1/page/experts").json()
    assert got == {"layers": 4, "experts": 16, "slots": 8, "per_token": 8,
                   "resident": [[1, 0], [3, 7], [2, 9], [1, 2], [0, 3]]}  # fmt: skip
    srv.worker = None
    with TestClient(create_app(srv)) as client:
        r = client.get("/v1/page/experts")
    assert r.status_code == 503 and r.json()["error"]["code"] == "loading"


def test_the_expert_picture_of_a_live_server_holds_the_last_tokens_experts(server, ckpt) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    stream_lines(server, chat_body("Fill the cache", 4))
    status, pic = get(server, "/v1/page/experts")
    assert status == 200 and 0 < len(pic["resident"]) <= pic["slots"]
    assert len({tuple(c) for c in pic["resident"]}) == len(pic["resident"])
    assert all(
        0 <= layer < cfg["num_hidden_layers"] and 0 <= e < cfg["n_routed_experts"] for layer, e in pic["resident"]
    )
    assert pic["per_token"] == cfg["num_hidden_layers"] * cfg["num_experts_per_tok"]
    if pic["slots"] >= pic["per_token"]:  # the last token asked each layer for its top-k: those come first
        hot = [layer for layer, _ in pic["resident"][: pic["per_token"]]]
        assert sorted(hot) == sorted(list(range(cfg["num_hidden_layers"])) * cfg["num_experts_per_tok"])


def test_the_chat_stream_carries_the_answers_figures_as_comments(server) -> None:
    n = 6
    lines = stream_lines(server, chat_body("word " * 60, n))
    events = page_events(lines)
    kinds = [k for k, _ in events]
    assert kinds[0] == "queued" and events[0][1] == 0  # served at once
    samples = [p for k, p in events if k == "sample"]
    prefill = [s for s in samples if s["phase"] == "prefill"]
    decode = [s for s in samples if s["phase"] == "decode"]
    usage = next(json.loads(x[6:])["usage"] for x in lines if x.startswith("data: {") and '"usage"' in x)
    # one per segment of 16 prompt tokens, one per token (the first token's is a prefill sample when
    # prompt tokens were left after the last segment)
    n_prompt = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert len(prefill) >= n_prompt // 16 >= 2 and len(prefill) + len(decode) >= n_prompt // 16 + n, (prefill, decode)
    assert len(decode) in (usage["completion_tokens"] - 1, usage["completion_tokens"])
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
    assert all(s["tok_s"] > 0 and s["read_mb_s"] >= 0 and 0 <= s["hit_rate"] <= 1 for s in samples)
    (summary,) = [p for k, p in events if k == "summary"]
    assert kinds.index("summary") > max(i for i, k in enumerate(kinds) if k == "sample")
    for key in ("prompt_tokens", "completion_tokens"):
        assert summary[key] == usage[key]
    assert summary["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert summary["disk_mb"] > 0 and 0 <= summary["expert_hit_rate"] <= 1
    assert summary["expert_requests"] >= summary["expert_hits"] >= 0 and summary["expert_requests"] > 0
    assert summary["prefill_tokens_per_s"] > 0 and summary["decode_tokens_per_s"] > 0
    assert summary["time_to_first_token_s"] > 0
    # the same request again: its prompt comes from the kept state, and says so
    again = page_events(stream_lines(server, chat_body("word " * 60, n)))
    (summary2,) = [p for k, p in again if k == "summary"]
    assert summary2["cached_tokens"] > 0
    # the official client reads the same stream as if the comments were not there
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(**{**chat_body("word " * 60, n), "stream": True}))
    assert chunks[-1].usage.completion_tokens == usage["completion_tokens"]


def test_a_queued_request_learns_its_position(one_at_a_time) -> None:
    server = one_at_a_time
    first_lines: list[str] = []
    first = threading.Thread(target=lambda: first_lines.extend(stream_lines(server, chat_body("busy " * 1500, 2))))
    first.start()
    end = time.monotonic() + 120
    while get(server, "/v1/stats")[1].get("phase") != "prefill":
        assert time.monotonic() < end
        time.sleep(0.02)
    second = page_events(stream_lines(server, chat_body("me next", 2)))
    first.join()
    queued = [p for k, p in second if k == "queued"]
    assert queued == [1, 0], second[:3]
    assert [p for k, p in page_events(first_lines) if k == "queued"] == [0]
