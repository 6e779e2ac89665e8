"""Speculation through a live `dsv4 serve` with its default --max-batch (issue 41), on a generated
V4-Flash-0731 checkpoint with its DSpark drafter and the release tokenizer.

- The plan printed at start-up holds the drafter (a batching server drafts too).
- One request at a time: greedy answers with `speculate` 2 and auto equal `speculate: off`, and
  /v1/stats' `speculation` (and /metrics' dsv4_speculation_*) sums what was drafted (acceptance, mean accepted length, drafted and
  verified tokens, time with drafts and the estimate without), consistent with itself.
- Two requests at once: each gets its solo answer, and their passes were shared (the first one
  drafted alone, then decoded in plain batched passes once the second was in flight).
- A long request taken beside a short one drafts once the short one has ended, with `off`'s answer.
"""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Server

from dsv4stream import synth
from dsv4stream.text.tokenizer import Tokenizer

N = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("spec") / "c0731"
    return synth.make_checkpoint(out, "tiny-0731", seed=2, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def server(ckpt):
    with Server(ckpt, "--ctx", "512", "--keep-states", "0", budget="1.5") as s:
        yield s


def stats(srv: Server) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/v1/stats")
    got = json.loads(conn.getresponse().read())
    conn.close()
    return got


def metrics(srv: Server) -> dict[tuple, float]:
    """/metrics' samples: (name, sorted label items) -> value."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for fam in text_string_to_metric_families(text)
        for x in fam.samples
    }


def answer(srv: Server, content: str, speculate, no_eos: dict, n: int = N) -> tuple[str, int]:
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
    r = c.chat.completions.create(
        model="t", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=n, logit_bias=no_eos,
        extra_body={"speculate": speculate},
    )  # fmt: skip
    return r.choices[0].message.content, r.usage.completion_tokens


def streamed(srv: Server, content: str, speculate, no_eos: dict, started: threading.Event) -> str:
    """A greedy answer of N tokens, streamed; `started` is set once its first chunks have come."""
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
    stream = c.chat.completions.create(
        model="t", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=N, logit_bias=no_eos,
        extra_body={"speculate": speculate}, stream=True,
    )  # fmt: skip
    parts = []
    for k, chunk in enumerate(stream):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if k == 4:
            started.set()
    return "".join(parts)


def test_a_batching_server_drafts_alone_and_shares_passes_together(server, ckpt) -> None:
    no_eos = {str(Tokenizer.from_checkpoint(ckpt).special.eos): -100}
    server.wait_for("drafter: DSpark dense weights")  # planned though requests may be decoded together
    assert stats(server)["batch"]["max_batch"] > 1 and stats(server)["speculation"] is None

    off = answer(server, "Count to ten.", "off", no_eos)
    assert off[1] == N
    assert stats(server)["speculation"] is None  # an off request drafts nothing and is not summed
    for setting in (2, "auto"):
        assert answer(server, "Count to ten.", setting, no_eos) == off, setting
    s = stats(server)["speculation"]
    assert s is not None and s["drafted_tokens"] > 0 and s["tokens"] == 2 * (N - 1)
    assert s["verified_tokens"] == s["drafted_tokens"] + s["verify_passes"]
    assert 0.0 <= s["acceptance"] <= 1.0 and s["accepted_tokens"] == round(s["acceptance"] * s["drafted_tokens"])
    assert s["seconds"] > 0 and s["seconds_without_estimated"] >= 0 and s["one_token_pass_seconds"] >= 0
    assert s["mean_accepted_length"] >= 1.0
    assert stats(server)["batch"]["largest"] == 1
    m = metrics(server)  # /metrics exports the same counts
    for name, key in (("drafted_tokens", "drafted_tokens"), ("accepted_tokens", "accepted_tokens"),
                      ("verified_tokens", "verified_tokens"), ("verify_passes", "verify_passes"),
                      ("plain_steps", "plain_steps"), ("tokens", "tokens"), ("watches", "watches"),
                      ("watch_drafted_tokens", "watch_drafted_tokens"),
                      ("watch_accepted_tokens", "watch_accepted_tokens")):  # fmt: skip
        assert m[(f"dsv4_speculation_{name}_total", ())] == s[key], name
    cycles = {k[1][0][1]: v for k, v in m.items() if k[0] == "dsv4_speculation_cycles_total"}
    assert cycles == {k: float(v) for k, v in s["draft_lengths"].items()}
    assert m[("dsv4_speculation_seconds_total", ())] == pytest.approx(s["seconds"], abs=1e-3)

    # the second request joins while the first is decoding (after a few of its tokens, drafted alone)
    prompts = ["Count to ten.", "Tell me a story."]
    solo = [off[0], answer(server, prompts[1], "off", no_eos)]
    drafted, started = s["drafted_tokens"], threading.Event()

    def first() -> str:
        return streamed(server, prompts[0], 2, no_eos, started)

    def second() -> tuple[str, int]:
        assert started.wait(300)
        return answer(server, prompts[1], 2, no_eos)

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(first), pool.submit(second)
        together = [a.result(), b.result()]
    assert together == solo
    after = stats(server)
    assert after["batch"]["largest"] >= 2, after["batch"]  # the two shared passes
    assert after["speculation"]["drafted_tokens"] > drafted  # and the first drafted while alone


def test_a_request_left_alone_drafts_again(server, ckpt) -> None:
    """A long request taken beside another (so decoding in batched passes) drafts once the other has
    ended (`worker._SoloDrafts`), and its answer is still `off`'s."""
    no_eos = {str(Tokenizer.from_checkpoint(ckpt).special.eos): -100}
    server.wait_for("listening on http://127.0.0.1")
    short, long = "Name three colours.", "Write a long poem about the sea."
    alone = answer(server, long, "off", no_eos, 2 * N)
    counts = ("drafted_tokens", "verify_passes", "verified_tokens", "tokens")
    before = stats(server)["speculation"] or dict.fromkeys(counts, 0)
    shared = ("dsv4_decode_passes_total", ()), ("dsv4_decode_pass_rows_total", ())
    m0 = metrics(server)
    started = threading.Event()

    def first() -> str:  # `off`: it never drafts, so whatever was drafted is the long request's
        return streamed(server, short, "off", no_eos, started)

    def second() -> tuple[str, int]:
        assert started.wait(300)
        return answer(server, long, 2, no_eos, 2 * N)

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(first), pool.submit(second)
        a.result()
        overlapped = b.result()
    after = stats(server)
    assert overlapped == alone
    m1 = metrics(server)
    passes, rows = (m1[k] - m0[k] for k in shared)
    assert rows > passes, (passes, rows)  # the two shared passes: the long one was taken beside the short one
    assert after["speculation"] is not None, "nothing was drafted"
    s = {k: after["speculation"][k] - before[k] for k in counts}
    assert s["drafted_tokens"] > 0, s  # and the long one drafted once alone again
    assert s["verified_tokens"] == s["drafted_tokens"] + s["verify_passes"]
    assert 0 < s["tokens"] < 2 * N - 1  # some of its tokens were decoded beside the other's
