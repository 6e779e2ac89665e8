"""A client that goes away stops its work, streaming or not, on each generating endpoint
(chat completions, completions, Responses, Anthropic messages): a live `dsv4 serve`, a long
request on a raw socket, the socket closed while tokens flow; the engine must log the stop
within a few seconds and answer the next request at once, instead of generating on to
max_tokens for nobody."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from pathlib import Path

import pytest
from server_proc import Server

from dsv4stream import synth
from dsv4stream.text.tokenizer import Tokenizer

LONG = 3000  # tokens asked for: many seconds of decoding on the tiny model, far past the checks below
MSG = [{"role": "user", "content": "Count."}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cancel") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=11, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def server(ckpt):
    with Server(ckpt, "--ctx", "4096") as s:
        yield s


@pytest.fixture(scope="module")
def eos(ckpt) -> int:
    return Tokenizer.from_checkpoint(ckpt).special.eos


def bodies(eos: int) -> dict[str, dict]:
    """A long request per endpoint; end of sequence pushed away where the API allows it, so the
    answer runs on to max tokens unless the request is stopped."""
    bias = {str(eos): -100}
    return {
        "/v1/chat/completions": {"messages": MSG, "max_tokens": LONG, "n": 4, "logit_bias": bias, "seed": 1},
        "/v1/completions": {"prompt": "Once", "max_tokens": LONG, "n": 4, "logit_bias": bias, "seed": 1},
        "/v1/responses": {"input": "Count.", "max_output_tokens": LONG, "temperature": 1.0},
        "/v1/messages": {"messages": MSG, "max_tokens": LONG, "temperature": 1.0},
    }


def work_done(srv: Server) -> int:
    """Routed experts the engine has asked for so far (a live Prometheus counter: it grows with
    every token and prefill chunk of the running request)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    m = re.search(r"^dsv4_expert_requests_total (\d+(?:\.\d+)?)", text, re.MULTILINE)
    assert m, text
    return int(float(m.group(1)))


def stats(srv: Server) -> str:
    """The engine's phase (idle, prefill, decode) from /v1/stats."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/v1/stats")
    phase = json.loads(conn.getresponse().read()).get("phase", "")
    conn.close()
    return phase


def open_request(srv: Server, path: str, body: dict) -> socket.socket:
    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    s.sendall(head.encode() + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return s


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
def test_a_client_that_goes_away_stops_its_work(server, eos, path, stream) -> None:
    n_log = len(server.lines)
    sock = open_request(server, path, {**bodies(eos)[path], "stream": stream})
    end = time.monotonic() + 120
    while "decode" not in stats(server):  # the engine is generating this request's answer
        assert time.monotonic() < end, server.log[-3000:]
        time.sleep(0.1)
    time.sleep(0.5)
    sock.close()
    gone = time.monotonic()
    line = server.wait_for("the client went away", after=n_log, timeout=30)
    stopped = time.monotonic() - gone
    assert int(re.search(r"(\d+) tokens generated", line).group(1)) < LONG
    idle = work_done(server)
    time.sleep(1.0)
    assert work_done(server) == idle, "the engine still works after the stop"
    # the next request is served at once, not after the abandoned one's thousands of tokens
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": MSG, "max_tokens": 1}).encode(),
                 {"Content-Type": "application/json"})  # fmt: skip
    r = conn.getresponse()
    r.read()
    waited = time.monotonic() - t0
    conn.close()
    assert r.status == 200
    print(f"{path} stream={stream}: stopped {stopped:.2f} s after the client left, next answered in {waited:.2f} s")
    # about a second on an idle machine; the bounds leave room for a loaded test machine
    assert stopped < 5.0, f"the work went on {stopped:.1f} s after the client left"
    assert waited < 10.0, f"the next request waited {waited:.1f} s"
