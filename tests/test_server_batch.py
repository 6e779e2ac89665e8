"""Continuous batching through a live `dsv4 serve --max-batch 4` and the OpenAI client: requests sent
at once (greedy, seeded sampling, structured output, a forced tool call) each get exactly the
answer they get alone, the stats show the passes really carried several of them, and a client
that goes away mid-answer leaves the others' answers unchanged.

The server keeps no states (`--keep-states 0`), so a request sent again prefills its prompt the
same way as the first time: the only difference between the runs is who shares the passes. Its
prefill segments are 8 tokens, so a prompt joining the batch is read in several segments with
the running requests' decode passes between them."""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from server_proc import Server

from dsv4stream import synth
from dsv4stream.text.tokenizer import Tokenizer

N = 40  # tokens per answer: long enough for the requests to overlap on the tiny model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("batch") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=11, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def server(ckpt):
    # segments of 8 tokens: a prompt joining the batch is read in several, the others decoding between them
    with Server(ckpt, "--ctx", "1024", "--max-batch", "4", "--keep-states", "0", "--prefill-segment", "8") as s:
        yield s


@pytest.fixture(scope="module")
def no_eos(ckpt) -> dict[str, int]:
    return {str(Tokenizer.from_checkpoint(ckpt).special.eos): -100}


def oa(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def requests(no_eos: dict[str, int]) -> list[dict]:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n"]}
    tool = {"type": "function", "function": {"name": "add", "strict": True, "parameters": schema}}
    return [
        {"messages": [{"role": "user", "content": "Count."}], "temperature": 0, "logit_bias": no_eos},
        {"messages": [{"role": "user", "content": "Tell me a story about a cat."}], "temperature": 1.0, "seed": 7,
         "logit_bias": no_eos, "logprobs": True, "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "JSON please."}], "temperature": 1.0, "seed": 3,
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
        {"messages": [{"role": "user", "content": "Add."}], "temperature": 0.8, "seed": 5, "tools": [tool],
         "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 300},
    ]  # fmt: skip


def answer(c: openai.OpenAI, body: dict) -> dict:
    r = c.chat.completions.create(model="t", **{"max_tokens": N, **body})
    ch = r.choices[0]
    lp = [(t.token, t.logprob) for t in ch.logprobs.content] if ch.logprobs and ch.logprobs.content else None
    calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
    return {"text": ch.message.content, "calls": calls, "finish": ch.finish_reason, "logprobs": lp}


def batch_stats(srv: Server) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/v1/stats")
    got = json.loads(conn.getresponse().read())
    conn.close()
    return got["batch"]


def test_concurrent_requests_get_their_solo_answers(server, no_eos) -> None:
    c = oa(server)
    bodies = requests(no_eos)
    solo = [answer(c, b) for b in bodies]
    assert batch_stats(server)["largest"] == 1  # one after another: every pass carried one request
    assert solo[3]["calls"] and solo[3]["calls"][0][0] == "add"  # the tool request really called it
    json.loads(solo[2]["text"])  # the structured one is a whole JSON value
    assert len({a["text"] for a in solo[:2]}) == 2
    for _ in range(2):  # twice: which requests share a pass differs from run to run
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(lambda b: answer(c, b), bodies))
        assert together == solo
    b = batch_stats(server)
    assert b["largest"] >= 2 and b["max_batch"] == 4, b  # the passes really carried several requests
    assert b["running"] == 0 and b["requests"] == []
    metrics = scrape(server)
    assert metrics["dsv4_max_batch"] == 4
    assert metrics["dsv4_decode_pass_rows_total"] > metrics["dsv4_decode_passes_total"] > 0
    server.wait_for("requests a pass")  # the access log says how many shared its passes


def scrape(srv: Server) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))}


def test_a_client_gone_mid_answer_leaves_the_others_unchanged(server, no_eos) -> None:
    c = oa(server)
    long = [{"messages": [{"role": "user", "content": f"Story {k}."}], "temperature": 1.0, "seed": k,
             "logit_bias": no_eos} for k in range(3)]  # fmt: skip
    solo = [answer(c, b)["text"] for b in long]
    started = threading.Event()

    def quitter() -> None:
        stream = c.chat.completions.create(model="t", max_tokens=N * 4, stream=True, **long[0])
        for k, _ in enumerate(stream):
            if k == 3:
                started.set()
                stream.close()  # the client goes away mid-answer
                return

    def stays(body: dict) -> str:
        started.wait(timeout=120)  # join while the quitter is decoding
        return answer(c, body)["text"]

    with ThreadPoolExecutor(3) as pool:
        q = pool.submit(quitter)
        rest = list(pool.map(stays, long[1:]))
        q.result()
    assert rest == solo[1:]
    assert answer(c, long[0])["text"] == solo[0]  # and the server serves on
    server.wait_for("the client went away")
