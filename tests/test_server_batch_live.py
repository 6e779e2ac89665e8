"""Continuous batching through live servers with the clients people use: LangChain's `abatch`
of 4 prompts (sent at once) gets the answers it gets one prompt at a time, the chat page's live
panel shows the batch while the page and another client are answered together, and a
DeepSeek-V4.1 checkpoint's concurrent requests get their solo answers too.

Each server keeps no states (`--keep-states 0`), so a prompt sent again is prefilled the same way:
the only difference between the runs is who shares the decode passes."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from server_proc import Server

from dsv4stream import synth
from dsv4stream.text.tokenizer import Tokenizer

N = 40  # tokens per answer: long enough for the requests to overlap on the tiny models
PROMPTS = ["Count to ten.", "Tell me about cats.", "Name a colour.", "Write a haiku."]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("batch_live") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=13, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def server(ckpt):
    with Server(ckpt, "--ctx", "1024", "--max-batch", "4", "--keep-states", "0") as s:
        yield s


def no_eos(ck: Path) -> dict[str, int]:
    return {str(Tokenizer.from_checkpoint(ck).special.eos): -100}


def stats(srv: Server) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/v1/stats")
    got = json.loads(conn.getresponse().read())
    conn.close()
    return got


def test_langchain_abatch_gets_the_solo_answers(server, ckpt) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="tiny", max_tokens=N, temperature=0,
                     max_retries=0, timeout=300, logit_bias=no_eos(ckpt))  # fmt: skip
    solo = [llm.invoke(p).content for p in PROMPTS]
    assert stats(server)["batch"]["largest"] == 1  # one at a time so far
    together = asyncio.run(llm.abatch(PROMPTS, config={"max_concurrency": len(PROMPTS)}))
    assert [m.content for m in together] == solo
    assert len(set(solo)) == len(PROMPTS)  # four different answers: a mixed-up row would show
    assert stats(server)["batch"]["largest"] >= 2  # the passes really carried several of them


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="no chromium/chromedriver here (CI installs them)")
def test_the_page_shows_the_batch_while_answering_beside_another_client(server, ckpt) -> None:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service
    from test_server_page import answers, busy, ready, send, set_field, text, wait

    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Story."}], "max_tokens": 6 * N,
            "temperature": 0, "logit_bias": no_eos(ckpt)}  # fmt: skip
    solo = c.chat.completions.create(**body).choices[0].message.content
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,860"):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        d.get(server.url + "/")
        ready(d)
        set_field(d, "max_tokens", str(6 * N))
        got: list[str] = []
        other = threading.Thread(
            target=lambda: got.append(c.chat.completions.create(**body).choices[0].message.content)
        )
        other.start()
        wait(lambda: stats(server)["batch"]["running"] == 1)
        send(d, "Tell me a long story.")
        shown = wait(lambda: (t := text(d, "#stat-batch")) and t.startswith("2 of 4 running") and t)
        assert "tok/s each" in shown, shown
        other.join(timeout=300)
        wait(lambda: not busy(d), timeout=300)
        assert got == [solo]  # the other client's answer, decoded beside the page's, is its solo one
        assert answers(d)[-1]["content"] and answers(d)[-1]["stats"]
    finally:
        d.quit()


@pytest.fixture(scope="module")
def v41(tmp_path_factory) -> Path:
    return synth.make_checkpoint(
        tmp_path_factory.mktemp("batch_v41") / "ck", "tiny-v41", seed=1, vocab_size=synth.REAL_VOCAB, tokenizer=True,
        image_token_id=129264, engram_compressed_vocab_size=99092,
    )  # fmt: skip


def test_a_v41_server_answers_concurrent_requests_as_alone(v41) -> None:
    bias = no_eos(v41)
    bodies = [{"model": "v41", "messages": [{"role": "user", "content": p}], "max_tokens": N, "logit_bias": bias,
               **({"temperature": 0} if k % 2 == 0 else {"temperature": 1.0, "seed": k})}
              for k, p in enumerate(PROMPTS)]  # fmt: skip
    with Server(v41, "--ctx", "1024", "--max-batch", "4", "--keep-states", "0") as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)

        def answer(b: dict) -> str:
            return c.chat.completions.create(**b).choices[0].message.content

        solo = [answer(b) for b in bodies]
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(answer, bodies))
        assert together == solo and len(set(solo)) == len(bodies)
        assert stats(srv)["batch"]["largest"] >= 2
        req = urllib.request.Request(srv.url + "/metrics")
        assert b"dsv4_decode_pass_rows_total" in urllib.request.urlopen(req, timeout=30).read()
