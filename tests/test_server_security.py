"""Who may use a local `dsv4 serve`, and what a client can make it do: Host and Origin checks
(DNS rebinding, cross-site requests), CORS for allowed origins, JSON-only POST bodies, the
API key (and its refusal when blank), error bodies in each API's shape, request checks
that used to pass through (seed, stream_options, nesting), slow and many clients, a full
queue, and a large body that must not stall /health. A real server on 127.0.0.1, driven by
raw HTTP (the checks are about headers clients normally hide) and the official clients."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import openai
import pytest
from server_proc import Server, free_port, health_seconds, trickling

from dsv4stream import synth
from dsv4stream.errors import UsageError
from dsv4stream.server.security import Policy, host_name, normalize_origins

KEY = "test-key-123"
ALLOWED = "http://app.example:3000"
MSGS = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sec") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=3, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def server(ckpt):
    args = ("--ctx", "256", "--api-key", KEY, "--cors-origin", ALLOWED, "--max-queue", "0", "--header-timeout", "1",
            "--body-timeout", "2", "--max-connections", "6", "--max-body-mb", "8")  # fmt: skip
    with Server(ckpt, *args) as s:
        yield s


@pytest.fixture(scope="module")
def one_at_a_time(ckpt):
    """No queue (`--max-queue 0`) and one request decoded at a time (`--max-batch 1`; the default
    batches a second request beside the first, and a batch that has room is no full queue)."""
    with Server(ckpt, "--ctx", "256", "--api-key", KEY, "--max-queue", "0", "--max-batch", "1") as s:
        yield s


def request(srv: Server, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    h.update(headers or {})
    conn.request(method, path, data, {k: v for k, v in h.items() if v is not None})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), (json.loads(raw) if raw else None)


CHAT = {"messages": MSGS, "max_tokens": 2, "temperature": 0}


def served(srv: Server) -> int:
    return request(srv, "GET", "/v1/stats")[2]["requests_served"]


def test_text_plain_and_form_posts_are_refused_before_anything_runs(server) -> None:
    before = served(server)
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        status, _, body = request(server, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(),
                                  {"Content-Type": ctype})  # fmt: skip
        assert status == 415 and body["error"]["code"] == "unsupported_media_type", ctype
    status, _, _ = request(
        server, "POST", "/v1/chat/completions", CHAT, {"Content-Type": "application/json; charset=utf-8"}
    )
    assert status == 200
    assert served(server) == before + 1


def test_a_foreign_origin_is_refused_and_the_own_and_allowed_ones_pass(server) -> None:
    status, _, body = request(server, "POST", "/v1/chat/completions", CHAT, {"Origin": "http://evil.example"})
    assert status == 403 and body["error"]["code"] == "origin_not_allowed"
    assert request(server, "GET", "/v1/models", headers={"Origin": "null"})[0] == 403
    own = f"http://127.0.0.1:{server.port}"
    status, headers, _ = request(server, "POST", "/v1/chat/completions", CHAT, {"Origin": own})
    assert status == 200 and "access-control-allow-origin" not in {k.lower() for k in headers}
    status, headers, _ = request(server, "POST", "/v1/chat/completions", CHAT, {"Origin": ALLOWED})
    assert status == 200 and {k.lower(): v for k, v in headers.items()}["access-control-allow-origin"] == ALLOWED


def test_preflight_from_an_allowed_origin_needs_no_key(server) -> None:
    asked = {"Origin": ALLOWED, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type", "Authorization": None}  # fmt: skip
    status, headers, _ = request(server, "OPTIONS", "/v1/chat/completions", headers=asked)
    h = {k.lower(): v for k, v in headers.items()}
    assert status == 200 and h["access-control-allow-origin"] == ALLOWED
    assert "POST" in h["access-control-allow-methods"] and "authorization" in h["access-control-allow-headers"]
    status, _, _ = request(
        server, "OPTIONS", "/v1/chat/completions", headers={**asked, "Origin": "http://evil.example"}
    )
    assert status == 403


def test_a_rebound_host_name_is_refused_on_loopback(server) -> None:
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.nip.io", "0.0.0.0"):
        status, _, body = request(server, "GET", "/v1/models", headers={"Host": host})
        assert status == 403 and body["error"]["code"] == "host_not_allowed", host
    for host in (f"localhost:{server.port}", "LOCALHOST", f"[::1]:{server.port}", "127.0.0.1"):
        assert request(server, "GET", "/v1/models", headers={"Host": host})[0] == 200, host


def test_host_and_origin_rules() -> None:
    assert [host_name(h) for h in ("[::1]:80", "LocalHost:1", "a.b", "::1")] == ["[::1]", "localhost", "a.b", "::1"]
    loop = Policy(loopback=True)
    assert loop.host_ok("localhost:8000") and not loop.host_ok("example.com") and loop.host_ok(None)
    assert Policy(loopback=True, allowed_hosts=("box.lan",)).host_ok("box.lan:8000")
    assert Policy(loopback=False).host_ok("anything") and not Policy(loopback=False, allowed_hosts=("a",)).host_ok("b")
    assert normalize_origins(["http://A.example:3000/, https://b.example", "*"]) == (
        "http://a.example:3000",
        "https://b.example",
        "*",
    )
    for bad in ("a.example", "http://", "http://a/b"):
        with pytest.raises(ValueError):
            normalize_origins([bad])


def test_the_api_key_and_error_shapes(server) -> None:
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    status, _, body = request(server, "POST", "/v1/messages", {"max_tokens": 1, "messages": MSGS},
                              {"Authorization": None, "x-api-key": "nope"})  # fmt: skip
    assert status == 401 and body == {"type": "error", "error": {"type": "authentication_error",
                                                                 "message": body["error"]["message"]}}  # fmt: skip
    assert request(server, "GET", "/metrics", headers={"Authorization": None})[0] == 401
    status, _, body = request(server, "GET", "/v1/nothing-here")
    assert status == 404 and body["error"]["code"] == "not_found" and set(body["error"]) >= {"message", "type"}
    status, _, body = request(server, "GET", "/v1/messages/nothing")
    assert status == 404 and body["type"] == "error" and body["error"]["type"] == "not_found_error"
    status, _, body = request(server, "GET", "/v1/chat/completions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    c = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=0, messages=MSGS)
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_the_api_paths_answer_without_v1_behind_the_same_key(server) -> None:
    root = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    name = root.models.list().data[0].id
    assert root.models.retrieve(name).id == name
    assert root.chat.completions.create(model=name, messages=MSGS, max_tokens=2, temperature=0).choices[0].message
    assert root.completions.create(model=name, prompt="Hi", max_tokens=2, temperature=0).choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="nope", max_retries=0).models.list()
    assert request(server, "POST", "/chat/completions", CHAT, {"Content-Type": "text/plain"})[0] == 415
    assert request(server, "GET", "/stats")[0] == 404  # only the API routes are aliased


def test_models_retrieve(server) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    name = c.models.list().data[0].id
    assert c.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


@pytest.mark.parametrize(
    "change,status",
    [
        ({"seed": -1}, 200),
        ({"seed": 2**64 - 1}, 200),
        ({"seed": -2}, 400),
        ({"seed": 2**64}, 400),
        ({"seed": 1.5}, 400),
        ({"stream_options": {"include_usage": True}}, 400),
        ({"stream_options": None}, 200),
        ({"response_format": {"type": "sound"}}, 400),
        ({"response_format": {"type": "json_schema"}}, 400),
        ({"top_logprobs": 21, "logprobs": True}, 400),
    ],
)
def test_request_fields_out_of_range_are_400_not_500(server, change, status) -> None:
    got, _, body = request(server, "POST", "/v1/chat/completions", {**CHAT, **change})
    assert got == status, body


def test_deeply_nested_bodies_are_400(server) -> None:
    head = json.dumps(CHAT).encode()[:-1]
    for depth in (101, 5000, 100_000):
        raw = head + b', "metadata": ' + b"[" * depth + b"]" * depth + b"}"
        status, _, body = request(server, "POST", "/v1/chat/completions", raw)
        assert status == 400 and body["error"]["code"] == "invalid_json", depth
    assert request(server, "POST", "/v1/chat/completions", CHAT)[0] == 200


def test_blank_api_key_is_refused(ckpt, capsys) -> None:
    from dsv4stream.cli import main

    for key in ("", "   "):
        with pytest.raises(SystemExit) as e:
            main(["serve", str(ckpt), "--port", str(free_port()), "--api-key", key])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--api-key is empty" in err and err.count("\n") == 1


def _serve_exits(ckpt: Path, *args: str) -> subprocess.CompletedProcess:
    """`dsv4 serve` in a child that must exit by itself (one that serves fails here, not hangs)."""
    cmd = [sys.executable, "-c", "from dsv4stream.cli import main; main()", "serve", str(ckpt), "--threads", "1"]
    return subprocess.run(
        [*cmd, "--port", str(free_port()), *args], check=False, capture_output=True, text=True, timeout=90
    )


def test_allowed_hosts_that_name_no_host_are_refused(ckpt) -> None:
    from dsv4stream.cli.serve import _allowed_hosts

    for value in ("", " ", ",", "box.lan,,other", ":8000", "a b", "box.lan/x", "[::1", "*.lan", "\x00", "a\nb"):
        with pytest.raises(UsageError, match="not a host name"):
            _allowed_hosts((value,), host_name)
    assert _allowed_hosts(("Box.LAN:8000,10.0.0.2", "[::1]:80", "*"), host_name) == (
        "box.lan",
        "10.0.0.2",
        "[::1]",
        "*",
    )
    got = _serve_exits(ckpt, "--allowed-host", "")
    assert (
        got.returncode == 2 and got.stderr.count("\n") == 1 and "--allowed-host '': '' is not a host name" in got.stderr
    )


def test_a_kv_cache_folder_another_server_holds_is_refused_before_loading(ckpt, tmp_path) -> None:
    code = "import sys, time; from dsv4stream.server.cache import FolderLock; FolderLock(sys.argv[1]); print('held', flush=True); time.sleep(120)"
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        got = _serve_exits(ckpt, "--kv-cache", str(tmp_path), "--kv-cache-gb", "1")
        assert got.returncode == 2 and f"(pid {holder.pid} on " in got.stderr and "--kv-cache" in got.stderr
        assert got.stderr.count("\n") == 1 and "loading" not in got.stderr, got.stderr
    finally:
        holder.kill()
        holder.wait()


def test_non_loopback_without_a_key_warns(ckpt) -> None:
    s = Server(ckpt, "--host", "0.0.0.0", "--ctx", "64")
    try:
        s.wait_for("without --api-key")
    finally:
        s.stop()


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes `sock` (recv returns b"" or the connection resets)."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"still open after {seconds} s") from None
    return time.monotonic() - t0


def test_slow_headers_and_bodies_are_cut_and_connections_capped(server) -> None:
    slow = socket.create_connection(("127.0.0.1", server.port))
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # never ends its headers
    assert _closed_within(slow, 5) < 3
    body_slow = socket.create_connection(("127.0.0.1", server.port))
    body_slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{")  # fmt: skip
    assert _closed_within(body_slow, 6) < 4.5
    # the cap holds when every connection has a request under way (here: bodies still coming)
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(6)]
    for s in held:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{")  # fmt: skip
    time.sleep(0.3)
    extra = socket.create_connection(("127.0.0.1", server.port))
    assert _closed_within(extra, 2) < 1
    for s in held:
        s.close()
    time.sleep(0.2)
    assert request(server, "GET", "/health")[0] == 200
    assert "already open" in server.log


def test_slow_header_senders_do_not_lock_out_a_new_client(ckpt) -> None:
    # issue 40: 64 connections (the default cap) send their headers a byte at a time, each well
    # within its deadline; a new /health request is still answered at once, in place of the one
    # that has waited longest, and the others keep trickling until their own deadline
    opening = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: "
    with Server(ckpt, "--ctx", "64", "--header-timeout", "8") as srv, trickling(srv.port, opening, 64, 0.5):
        time.sleep(1.0)  # all 64 open and trickling
        for _ in range(3):
            assert health_seconds(srv, timeout=3) < 2
        assert "for request headers to admit a new one" in srv.log
        assert "refused a connection" not in srv.log


def test_a_full_queue_answers_429_with_retry_after(one_at_a_time) -> None:
    server = one_at_a_time
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    started = threading.Event()

    def long() -> None:
        for ch in c.chat.completions.create(model="t", messages=MSGS, max_tokens=150, temperature=0, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                started.set()

    t = threading.Thread(target=long)
    t.start()
    try:
        assert started.wait(60)
        assert request(server, "GET", "/health")[2]["running"] == 1
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(model="t", messages=MSGS, max_tokens=1)
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        t.join()
    assert request(server, "GET", "/health")[2] == {**request(server, "GET", "/health")[2], "waiting": 0, "running": 0}


def test_health_stays_fast_while_a_7_mb_body_is_parsed_and_tokenized(server) -> None:
    big = {"messages": [{"role": "user", "content": "lorem ipsum dolor sit amet " * 260_000}], "max_tokens": 1}
    raw = json.dumps(big).encode()
    assert len(raw) > 7_000_000
    result: dict[str, object] = {}

    def send() -> None:
        result["status"] = request(server, "POST", "/v1/chat/completions", raw)[0]

    t = threading.Thread(target=send)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert request(server, "GET", "/health")[0] == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    assert result["status"] == 400  # past --ctx, found by tokenizing it
    assert worst < 1.0, worst


def test_tokenizing_a_long_text_leaves_other_threads_running(ckpt) -> None:
    from dsv4stream.text.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(ckpt)
    text = "lorem ipsum dolor sit amet " * 40_000
    t = threading.Thread(target=tok.encode, args=(text,))
    t0 = time.monotonic()
    t.start()
    worst, last = 0.0, time.monotonic()
    while t.is_alive():
        time.sleep(0.005)
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    assert worst < max(0.5, (last - t0) / 4), (worst, last - t0)
