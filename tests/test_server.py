"""`dsv4 serve` end to end: a real server subprocess on a generated checkpoint with the real
V4 tokenizer, driven by the official `openai` client (and raw HTTP where a client hides
the wire): models, chat and completions (stream and not) equal to `dsv4 run` / a fresh
engine, multi-turn prefix reuse, the disk cache after a restart with a corrupt file,
tool schemas in the prompt, two clients at once with keep-alives, a client that goes
away mid-stream, bad requests, the API key, and Anthropic's /v1/messages."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from server_proc import CODE, Server, free_port, one_thread_engine
from test_dsml import EXPECTED_TOOLS_SECTION, WEATHER

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.engine.session import Engine
from dsv4stream.server.cache import checkpoint_identity, prefix_names
from dsv4stream.server.security import is_loopback
from dsv4stream.text import chat
from dsv4stream.text.tokenizer import Tokenizer

CTX = 512
GEN = 6
SYSTEM, USER = "You are terse.", "Name three colours."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("srv") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=7, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def kvdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def server(ckpt, kvdir):
    args = ("--kv-cache", str(kvdir), "--ctx", str(CTX), "--keep-alive", "0.05", "--max-body-mb", "0.2")
    with Server(ckpt, *args) as s:
        yield s


@pytest.fixture(scope="module")
def one_at_a_time(ckpt):
    """A server that decodes one request at a time (`--max-batch 1`): a second one waits in the
    queue (the default batches it beside the first: `test_server_batch.py`)."""
    with Server(ckpt, "--ctx", str(CTX), "--keep-alive", "0.05", "--max-batch", "1") as s:
        yield s


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_checkpoint(ckpt)


@pytest.fixture(scope="module")
def engine(ckpt):
    yield from one_thread_engine(ckpt)


def client(srv: Server, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def greedy(srv: Server, messages, n: int = GEN, **kw):
    return client(srv).chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=n, **kw)


def fresh_text(engine: Engine, tok: Tokenizer, ids: list[int], n: int = GEN) -> str:
    """Greedy reply of a session that starts from nothing: no server, no cache."""
    out = []
    for t in engine.session().generate(ids, n):
        if t == tok.special.eos:
            break
        out.append(t)
    return tok.decode(out)


def post(srv: Server, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    status, raw = r.status, r.read()
    conn.close()
    return status, json.loads(raw)


def sse_lines(srv: Server, path: str, body: dict) -> list[str]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    lines = [ln.decode().rstrip("\n") for ln in r]
    conn.close()
    return [ln for ln in lines if ln]


MSGS = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


def _get(srv: Server, path: str) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("GET", path)
    r = conn.getresponse()
    assert r.status == 200
    return json.loads(r.read())


def test_health_and_models(server) -> None:
    assert _get(server, "/health")["status"] == "ok"
    assert [m.id for m in client(server).models.list()] == ["tiny"]


def test_chat_greedy_equals_dsv4_run(server, ckpt) -> None:
    r = greedy(server, MSGS)
    text = r.choices[0].message.content or ""
    cmd = [sys.executable, "-c", CODE, "run", str(ckpt), "--chat", "--system", SYSTEM, "--prompt", USER]
    cmd += ["--greedy", "--gen", str(GEN), "--budget", "1", "--threads", "1"]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout == text + "\n"
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= GEN
    assert r.usage.completion_tokens == GEN or r.choices[0].finish_reason == "stop"


def test_chat_stream_one_chunk_per_token(server) -> None:
    whole = greedy(server, MSGS).choices[0].message.content or ""
    chunks = list(greedy(server, MSGS, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(texts) == whole
    assert 2 <= len(texts) <= chunks[-1].usage.completion_tokens <= GEN
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals in (["length"], ["stop"])
    assert chunks[0].choices[0].delta.role == "assistant"


def test_completions_equal_a_fresh_engine(server, engine, tok) -> None:
    prompt = "The capital of France is"
    c = client(server)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=GEN, temperature=0)
    ids = [tok.special.bos, *tok.encode(prompt)]
    assert r.choices[0].text == fresh_text(engine, tok, ids) and r.usage.prompt_tokens == len(ids)
    streamed = c.completions.create(model="tiny", prompt=ids, max_tokens=GEN, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == r.choices[0].text


@pytest.fixture(scope="module")
def conversation(server, tok):
    """Two greedy turns on the shared server; the second extends the first."""
    m1 = [{"role": "user", "content": "Tell me a story about a fox."}]
    r1 = greedy(server, m1)
    m2 = [*m1, {"role": "assistant", "content": r1.choices[0].message.content or ""}]
    m2.append({"role": "user", "content": "And then what happened?"})
    r2 = greedy(server, m2)
    ids2 = tok.encode(chat.render(chat.from_openai(m2)))
    return {"r1": r1, "r2": r2, "m2": m2, "ids2": ids2}


def test_second_turn_reuses_the_first_and_equals_a_fresh_engine(conversation, engine, tok) -> None:
    r1, r2, ids2 = conversation["r1"], conversation["r2"], conversation["ids2"]
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens <= cached < r2.usage.prompt_tokens == len(ids2)
    assert (r2.choices[0].message.content or "") == fresh_text(engine, tok, ids2)


def test_thinking_goes_to_reasoning_content(server) -> None:
    r = greedy(server, MSGS, extra_body={"thinking": {"type": "enabled"}})
    m = r.choices[0].message
    reasoning = (m.model_extra or {}).get("reasoning_content")
    assert isinstance(reasoning, str) and reasoning  # a random model rarely closes </think> in 6 tokens
    assert r.usage.prompt_tokens == greedy(server, MSGS).usage.prompt_tokens  # <think> vs </think>: one token


def test_tool_schemas_and_calls_reach_the_prompt_as_the_official_encoder_writes_them(server, tok) -> None:
    tools = [{"type": "function", "function": WEATHER}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    d = "｜DSML｜"
    expected = (
        f"<｜begin▁of▁sentence｜>\n\n{EXPECTED_TOOLS_SECTION}<｜User｜>Weather in Paris?<｜Assistant｜></think>"
        f'\n\n<{d}tool_calls>\n<{d}invoke name="get_weather">\n<{d}parameter name="city" string="true">Paris'
        f"</{d}parameter>\n</{d}invoke>\n</{d}tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>sunny"
        "</tool_result><｜Assistant｜></think>"
    )
    r = greedy(server, msgs, n=2, tools=tools)
    assert r.usage.prompt_tokens == len(tok.encode(expected))
    off = greedy(server, msgs, n=2, tools=tools, tool_choice="none")
    assert off.usage.prompt_tokens == len(tok.encode(expected.replace(f"\n\n{EXPECTED_TOOLS_SECTION}", "")))


def test_two_clients_at_once_queue_with_keep_alives(one_at_a_time) -> None:
    server = one_at_a_time
    other = [{"role": "user", "content": "Count to five."}]
    got: dict[str, object] = {}
    n_log = len(server.lines)
    started = threading.Event()

    def first() -> None:  # streams, so that the second starts while this one is generating
        text = ""
        for ch in greedy(server, MSGS, n=80, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
                started.set()
        got["a"] = text

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(60)
    lines = sse_lines(server, "/v1/chat/completions", {"messages": other, "max_tokens": GEN, "temperature": 0,
                                                       "stream": True})  # fmt: skip
    t.join()
    assert lines[-1] == "data: [DONE]"
    first_data = next(i for i, ln in enumerate(lines) if ln.startswith("data:"))
    assert any(ln.startswith(": keep-alive") for ln in lines), lines[:5]
    assert first_data < len(lines) - 1
    streamed = "".join(
        json.loads(ln[6:])["choices"][0]["delta"].get("content") or "" for ln in lines if ln.startswith("data: {")
    )
    assert streamed == (greedy(server, other).choices[0].message.content or "")
    assert got["a"] == greedy(server, MSGS, n=80).choices[0].message.content
    queued = [float(q) for q in re.findall(r"queued (\d+\.\d+) s", "\n".join(server.lines[n_log:]))]
    assert max(queued) > 0.1  # one waited for the other


def test_client_going_away_stops_the_generation(server) -> None:
    n_log = len(server.lines)
    stream = greedy(server, MSGS, n=400, stream=True)
    seen = 0
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            seen += 1
            if seen == 2:
                break
    stream.close()
    line = server.wait_for("the client went away", after=n_log, timeout=60)
    assert int(re.search(r"(\d+) tokens generated", line).group(1)) < 400
    assert greedy(server, MSGS, n=1).usage.completion_tokens == 1  # still serving


@pytest.mark.parametrize(
    "body,status,code",
    [
        (b'{"messages": [', 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        ({"messages": "hi"}, 400, "invalid_field"),
        ({"messages": MSGS, "max_tokens": "8"}, 400, "invalid_field"),
        ({"messages": MSGS, "temperature": "hot"}, 400, "invalid_field"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_field"),
        ({"messages": MSGS, "n": 17}, 400, "invalid_field"),
        ({"messages": [{"role": "user", "content": "word " * 700}]}, 400, "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": "x" * 300_000}]}, 413, "too_large"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, body, status, code) -> None:
    got, err = post(server, "/v1/chat/completions", body)
    assert got == status and err["error"]["code"] == code and err["error"]["message"]


def test_prompt_beyond_ctx_through_the_client(server) -> None:
    with pytest.raises(openai.BadRequestError, match="ctx"):
        greedy(server, [{"role": "user", "content": "word " * 700}])
    assert greedy(server, MSGS, n=1).usage.completion_tokens == 1


def test_anthropic_messages(server) -> None:
    want = greedy(server, MSGS).choices[0].message.content or ""
    body = {"system": SYSTEM, "messages": [{"role": "user", "content": USER}], "max_tokens": GEN, "temperature": 0}
    status, r = post(server, "/v1/messages", body)
    assert status == 200 and r["type"] == "message"
    assert "".join(b["text"] for b in r["content"] if b["type"] == "text") == want
    assert r["stop_reason"] in ("end_turn", "max_tokens") and r["usage"]["output_tokens"] <= GEN
    events = [ln[7:] for ln in sse_lines(server, "/v1/messages", {**body, "stream": True}) if ln.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert "content_block_delta" in events


def test_disk_cache_after_a_restart_skips_a_corrupt_file(conversation, ckpt, kvdir, tok, tmp_path) -> None:
    ids2 = conversation["ids2"]
    names = prefix_names(checkpoint_identity(Catalog.open(ckpt)), ids2[:-1])
    # the files as a restarted server finds them, in a folder of its own: the fixture's server
    # still runs and holds kvdir (one server per folder)
    kvdir = shutil.copytree(kvdir, tmp_path / "kv", ignore=shutil.ignore_patterns(".dsv4-kv-cache.lock"))
    on_disk = [k for k in range(len(names), 0, -1) if (kvdir / names[k - 1]).exists()]
    assert len(on_disk) >= 2, on_disk
    longest = kvdir / names[on_disk[0] - 1]
    blob = bytearray(longest.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    longest.write_bytes(bytes(blob))
    restarted = Server(ckpt, "--kv-cache", str(kvdir), "--ctx", str(CTX), "--api-key", "sekrit")
    try:
        restarted.wait_for("dsv4: loading")
        assert _health(restarted) == (503, "loading")  # the port answers while the model loads
        restarted.wait_for("listening on")
        with pytest.raises(openai.AuthenticationError):
            client(restarted, "wrong").models.list()
        r = client(restarted, "sekrit").chat.completions.create(
            model="tiny", messages=conversation["m2"], temperature=0, max_tokens=GEN
        )
        assert r.usage.prompt_tokens_details.cached_tokens == on_disk[1]
        assert r.choices[0].message.content == conversation["r2"].choices[0].message.content
        assert restarted.log.count("kv-cache: ignoring") == 1 and longest.name in restarted.log
    finally:
        assert restarted.stop() == 0 and "server stopped" in restarted.log  # SIGTERM: a clean stop


def _health(srv: Server) -> tuple[int, str]:
    for _ in range(100):
        try:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
            conn.request("GET", "/health")
            r = conn.getresponse()
            return r.status, json.loads(r.read())["status"]
        except ConnectionRefusedError:
            time.sleep(0.05)
    raise AssertionError("nothing listens")


def test_greedy_ids_do_not_depend_on_reuse(engine, tok) -> None:
    """The worker's reuse path in miniature: restore at the prompt's end, extend, compare."""
    ids = tok.encode(chat.render(chat.one_turn("Hello there", SYSTEM)))
    a = engine.session()
    a.prefill(ids)
    snap = a.snapshot()
    b = engine.session()
    b.restore(snap)
    more = tok.encode("<｜end▁of▁sentence｜><｜User｜>again<｜Assistant｜></think>")
    assert np.array_equal(a.prefill(more), b.prefill(more))


def test_start_up_errors_are_one_line(server, ckpt, capsys) -> None:
    from dsv4stream.cli import main

    def serve(*args: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as e:
            main(["serve", str(ckpt), "--threads", "1", *args])
        return e.value.code, capsys.readouterr().err

    code, err = serve("--port", str(server.port))
    assert code == 2 and "cannot listen there" in err and err.count("\n") == 1
    code, err = serve("--port", str(free_port()), "--budget", "0.01")  # fails while loading, after the bind
    assert code == 2 and "below the minimum" in err.splitlines()[-1] and "Traceback" not in err
    assert serve("--port", "0")[0] == 2


def test_loopback_hosts() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "127.1.2.3"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.4", "::", "example.com"))


def test_seed_stop_and_max_completion_tokens(server, tok) -> None:
    c = client(server)

    def sampled(seed: int) -> str:
        r = c.chat.completions.create(model="tiny", messages=MSGS, temperature=1.0, top_p=0.9, seed=seed, max_tokens=5)
        return r.choices[0].message.content or ""

    assert sampled(1) == sampled(1) and sampled(1) != sampled(2)
    whole = greedy(server, MSGS).choices[0].message.content or ""
    pieces = [tok.decode([t]) for t in tok.encode(whole)]
    stop = pieces[2].strip() or pieces[2]
    cut = greedy(server, MSGS, stop=[stop, "never appears"])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == whole[: whole.index(stop)]
    r = c.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_completion_tokens=2)
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length"


def test_stats_json(server) -> None:
    greedy(server, MSGS, n=3)
    s = _get(server, "/v1/stats")
    assert s["phase"] == "idle" and s["queue"] == 0 and s["requests_served"] >= 1 and s["prefill"] is None
    assert s["trunk"] == {"pinned_layers": 4, "streamed_layers": 0} and s["budget_gb"] == 1.0
    assert 0 < s["peak_rss_gb"] and 0 <= s["expert_hit_rate"] <= 1 and s["decode_tokens_per_s"] > 0
    last = s["last_request"]
    assert last["completion_tokens"] == 3 and last["prompt_tokens"] > 0 and last["time_to_first_token_s"] > 0
    h = s["history"]
    assert h[-1]["kind"] == "decode" and all(0 <= p["hit_rate"] <= 1 and p["read_gbps"] >= 0 for p in h), h
    assert [p["t"] for p in h] == sorted(p["t"] for p in h)


def test_reasoning_effort_is_the_checkpoints_chat_format(server, ckpt, tok) -> None:
    from dsv4stream.checkpoint.config import ModelConfig

    encoder = chat.encoder_for(ModelConfig.from_json(ckpt / "config.json").layout)
    for asked, effort in (("max", "max"), ("xhigh", "max"), ("medium", None)):
        r = greedy(server, MSGS, n=1, reasoning_effort=asked)
        want = tok.encode(chat.render(chat.from_openai(MSGS), "think", effort=effort, encoder=encoder))
        assert r.usage.prompt_tokens == len(want), asked
    assert greedy(server, MSGS, n=1, reasoning_effort="max").usage.prompt_tokens > len(
        tok.encode(chat.render(chat.from_openai(MSGS), "think", encoder=encoder))
    )
