"""V4.1 images through a live `dsv4 serve` on 127.0.0.1: the official `openai` and `anthropic`
clients and the Responses API send an image, and the server's tokens and logprobs are the
engine's own for the same prompt (computed here in-process: the tower, the spans, a prefill
from position 0, then greedy steps); the prefix cache reuses a resent image and misses a
different image of the same size; images of several messages go where they occur; bad images
are a 400 naming the field and the server lives; a remote URL is fetched (--allow-image-urls)
from a local HTTP server.

One server for the module (exact numerics, as the in-process engine): a generated V4.1 checkpoint with synth's tiny tower and the real
V4.1 tokenizer (the image placeholder at 129264).
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from server_proc import Server

from dsv4stream.text import chat
from dsv4stream.text.messages import ImagePart, Message
from dsv4stream.text.tokenizer import Tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
GEN = 4
ASK = "What colour is this?"


def png(color, size=(30, 20)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


RED, BLUE = png((200, 40, 10)), png((10, 40, 200))  # one size: the same ids to the model


def uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    from dsv4stream import synth

    root = tmp_path_factory.mktemp("v41img")
    return synth.make_checkpoint(
        root / "ck", "tiny-v41", seed=1, vocab_size=synth.REAL_VOCAB, tokenizer=True, image_token_id=129264,
        engram_compressed_vocab_size=99092,
    )  # fmt: skip


@pytest.fixture(scope="module")
def web():
    """A local HTTP server holding the red image."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/red.png" else 404)
            self.send_header("Content-Length", str(len(RED)) if self.path == "/red.png" else "0")
            self.end_headers()
            if self.path == "/red.png":
                self.wfile.write(RED)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def server(ck):
    with Server(ck, "--ctx", "512", "--allow-image-urls", "--numerics", "exact", budget="2") as s:
        yield s


def engine_answer(ck: Path, turns: list[list]) -> tuple[list[int], list[float], int]:
    """Greedy ids, their logprobs (log-softmax less the banned ids, as the server's) and the
    expanded prompt's length for user turns of text and image bytes, computed in-process."""
    from dsv4stream.engine.images import image_prompt, inputs_for
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime
    from dsv4stream.text.sampler import banned_ids

    tok = Tokenizer.from_checkpoint(ck)
    msgs = [Message("user", tuple(ImagePart("i", p) if isinstance(p, bytes) else p for p in t)) for t in turns]
    ids = chat.encode(tok, msgs, "chat", encoder="v41")
    images = [p for t in turns for p in t if isinstance(p, bytes)]
    ban = np.asarray(banned_ids(tok), dtype=np.int64)
    with Runtime.open(ck, RunOptions(budget=2 * 10**9, io="buffered", numerics="exact")) as rt:
        ip = image_prompt(rt.engine, np.asarray(ids, dtype=np.int64), inputs_for(rt.cfg, [("i", d) for d in images]))
        session = rt.session()
        x = session.prefill(ip.ids, last_only=True, spans=ip.spans)
        got, lps = [], []
        for _ in range(GEN):
            z = x[: tok.n_tokens].astype(np.float64)
            z[ban[ban < z.size]] = -np.inf
            z -= z.max() + np.log(np.exp(z - z.max()).sum())
            t = int(np.argmax(z))
            got.append(t)
            lps.append(float(z[t]))
            x = session.step(t)
    return got, lps, int(ip.ids.size)


@pytest.fixture(scope="module")
def red_answer(ck):
    return engine_answer(ck, [[RED, ASK]])


def token_bytes(tok: Tokenizer, ids: list[int]) -> list[list[int]]:
    from dsv4stream.server.decoding import token_bytes as tb

    return [list(tb(tok, i)) for i in ids]


def test_openai_client_image_is_the_engines_answer(server, ck, red_answer) -> None:
    """image_url data URI through the official client: the greedy tokens and their logprobs are
    the engine's for the same image and text, and the prompt is the expanded one."""
    import openai

    ids, lps, n_prompt = red_answer
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    r = client.chat.completions.create(
        model="ck", max_tokens=GEN, temperature=0, logprobs=True, top_logprobs=1,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri(RED)}},
                                               {"type": "text", "text": ASK}]}],
    )  # fmt: skip
    got = r.choices[0].logprobs.content
    assert [g.bytes for g in got] == token_bytes(Tokenizer.from_checkpoint(ck), ids)
    np.testing.assert_allclose([g.logprob for g in got], lps, atol=1e-4)
    assert r.usage.prompt_tokens == n_prompt


def test_anthropic_client_base64_image(server, ck, red_answer) -> None:
    import anthropic

    ids, _, n_prompt = red_answer
    client = anthropic.Anthropic(base_url=server.url, api_key="x")
    r = client.messages.create(
        model="ck", max_tokens=GEN, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(RED).decode()}},
            {"type": "text", "text": ASK}]}],
    )  # fmt: skip
    assert r.content[0].text == Tokenizer.from_checkpoint(ck).decode(ids)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n_prompt


def test_responses_input_image_and_remote_url(server, ck, red_answer, web) -> None:
    """Responses input_image with a data URI, and the same image as an http URL fetched from
    127.0.0.1 (--allow-image-urls): the engine's answer both times."""
    want = Tokenizer.from_checkpoint(ck).decode(red_answer[0])
    for url in (uri(RED), f"{web}/red.png"):
        body = {"model": "ck", "max_output_tokens": GEN, "temperature": 0, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": ASK}]}]}  # fmt: skip
        r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["output"][-1]["content"][0]["text"] == want
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={"max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{web}/missing.png"}}]}]})  # fmt: skip
    assert r.status_code == 400 and "HTTP 404" in r.json()["error"]["message"]


def ask(server, messages, **more) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"max_tokens": GEN, "temperature": 0, "messages": messages, **more})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": uri(data)}}


def test_cache_reuses_a_resent_image_and_misses_another(server, red_answer) -> None:
    """The next turn of a conversation resends the red image: its state is reused (past the
    span). A blue image of the same size makes the same ids: a miss all the same."""
    first = [{"role": "user", "content": [part(RED), {"type": "text", "text": ASK}]}]
    a = ask(server, first)
    reply = a["choices"][0]["message"]["content"]
    b = ask(server, [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And now?"}])
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= red_answer[2]
    c = ask(server, [{"role": "user", "content": [part(BLUE), {"type": "text", "text": ASK}]}])
    assert c["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"]
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_images_of_several_messages_in_order(server, ck) -> None:
    """Blue in the first user turn, red in the second: the engine's answer to that order (not
    the other)."""
    ids, lps, n = engine_answer(ck, [[BLUE, "one"], [RED, "two"]])
    msgs = [{"role": "user", "content": [part(BLUE), {"type": "text", "text": "one"}]},
            {"role": "user", "content": [part(RED), {"type": "text", "text": "two"}]}]  # fmt: skip
    r = ask(server, msgs, logprobs=True)
    got = r["choices"][0]["logprobs"]["content"]
    assert [g["bytes"] for g in got] == token_bytes(Tokenizer.from_checkpoint(ck), ids)
    np.testing.assert_allclose([g["logprob"] for g in got], lps, atol=1e-4)
    assert r["usage"]["prompt_tokens"] == n


def _bomb() -> bytes:
    out = io.BytesIO()
    Image.new("L", (7000, 7000)).save(out, "PNG")
    return out.getvalue()


def test_bad_images_are_a_400_and_the_server_lives(server) -> None:
    whole = png((1, 2, 3), (64, 64))
    bad = [
        ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnope").decode(), "not a readable image"),
        (uri(whole[: len(whole) // 2]), "not a readable image"),
        (uri(_bomb()), "megapixels"),
        ("data:image/jpeg;base64," + base64.b64encode(RED).decode(), "declared image/jpeg"),
        ("data:image/png;base64,%%%", "base64"),
    ]
    for url, why in bad:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={"max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}]})  # fmt: skip
        err = r.json()["error"]
        assert r.status_code == 400 and why in err["message"], r.text
        assert err["param"] == "messages.0.content.1.image_url.url"
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={"model": "ck", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/gif",
         "data": base64.b64encode(RED).decode()}}]}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["type"] == "error" and "source.data" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert ask(server, [{"role": "user", "content": "hi"}])["choices"][0]["finish_reason"] in ("stop", "length")


# ---- the chat page in a headless browser (Debian's chromium + chromedriver) ----------------------


@pytest.fixture(scope="module")
def browser():
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("no chromium/chromedriver here: `sudo apt-get install chromium chromium-driver`")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,860"):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(driver), options=opts)
    yield d
    d.quit()


def _until(cond, timeout: float = 120.0):
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("timed out")


def _ready(d) -> None:
    js = "return document.getElementById('status').textContent === 'connected' && !!document.getElementById('stop').disabled;"
    _until(lambda: d.execute_script(js))


def test_page_drop_an_image_ask_reload(server, browser, ck, red_answer) -> None:
    """Drop an image on the page, ask: the answer is the engine's for that image and text; after
    a reload the image is still in the conversation (the data URI as sent). A file that only
    claims to be an image is refused, and a stored non-image data: URI is never shown."""
    d = browser
    d.get(server.url + "/")
    d.execute_async_script(
        "const done = arguments[arguments.length - 1]; localStorage.clear();"
        " const r = indexedDB.deleteDatabase('dsv4stream'); r.onsuccess = r.onerror = r.onblocked = () => done();"
    )
    d.refresh()
    _ready(d)
    _until(lambda: d.execute_script("return document.getElementById('attach').title.includes('image');"))
    for k, v in (("max_tokens", str(GEN)), ("temperature", "0")):
        d.execute_script(
            "const e = document.getElementById(arguments[0]); e.value = arguments[1]; e.dispatchEvent(new Event('change'));",
            k, v,
        )  # fmt: skip
    drop = (
        "const dt = new DataTransfer();"
        " dt.items.add(new File([new Uint8Array(arguments[0])], arguments[1], {type: 'image/png'}));"
        " document.getElementById('input').dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true,"
        " cancelable: true}));"
    )
    d.execute_script(drop, list(b"<svg onload=alert(1)>"), "fake.png")
    _until(lambda: "fake.png: not a PNG, JPEG, WebP or GIF" in d.find_element("id", "composer-note").text)
    d.execute_script(drop, list(RED), "red.png")
    _until(lambda: d.execute_script("return document.querySelectorAll('#attachments img.thumb').length;") == 1)
    d.find_element("id", "input").send_keys(ASK)
    d.find_element("id", "send").click()
    content = "return [...document.querySelectorAll('.msg.assistant .content')].map(e => e.textContent);"
    _until(lambda: d.execute_script(content) and d.execute_script("return !!document.getElementById('stop').disabled;"))
    want = Tokenizer.from_checkpoint(ck).decode(red_answer[0])
    assert d.execute_script(content) == [want.strip()] or d.execute_script(content) == [want]
    stats = d.execute_script("return document.querySelector('.msg.assistant .stats').textContent;")
    assert f"prompt {red_answer[2]} tokens" in stats
    d.refresh()
    _ready(d)
    thumbs = "return [...document.querySelectorAll('.msg.user img.thumb')].map(e => e.getAttribute('src'));"
    assert _until(lambda: d.execute_script(thumbs)) == [uri(RED)]
    assert d.execute_script("return document.querySelector('.msg.user .content').textContent;") == ASK
    for bad in ("data:text/html;base64,PHNjcmlwdD4=", 'data:image/png;base64,AA" onerror="alert(1)', "javascript:1"):
        assert d.execute_script("return Images.safe(arguments[0]);", bad) == ""


# a tower of the release's width (one block): its activations for the largest image (1,024
# tokens) are about 1.4 GB, more than --budget 1 leaves after the text model
WIDE_TOWER = {
    "model_type": "deepseek_v41_vision", "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 2816,
    "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3, "max_image_tokens": 1024, "min_pixels": 295936,
    "max_wh_ratio": None, "num_hidden_layers": 1,
}  # fmt: skip


def test_a_budget_without_room_for_the_tower_serves_text_and_refuses_images(tmp_path) -> None:
    """--budget 1 holds the text model but not a release-width tower and its largest image's
    activations: the server starts, answers text, and refuses an image with a 400 saying to
    give a larger budget (before, it refused to start at all)."""
    from dsv4stream import synth

    ck = synth.make_checkpoint(
        tmp_path / "ck", "tiny-v41", seed=1, vocab_size=synth.REAL_VOCAB, tokenizer=True, image_token_id=129264,
        engram_compressed_vocab_size=99092, vision_config=WIDE_TOWER,
    )  # fmt: skip
    with Server(ck, "--ctx", "512", budget="1") as s:
        s.wait_for("images are refused")
        msg = {"role": "user", "content": [{"type": "text", "text": ASK}, {"type": "image_url", "image_url": {"url": uri(RED)}}]}  # fmt: skip
        r = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={"max_tokens": 1, "messages": [msg]})
        assert r.status_code == 400 and "larger --budget" in r.json()["error"]["message"], r.text
        r = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={"max_tokens": 2, "messages": [
            {"role": "user", "content": ASK}]})  # fmt: skip
        assert r.status_code == 200, r.text
