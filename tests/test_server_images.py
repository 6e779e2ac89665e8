"""The server's image parts without a model: decoding and refusing them (`server.images`), remote
URLs against a local HTTP server on 127.0.0.1, the prompt text an image part makes (checked
against DeepSeek's V4.1 encoder), the cache keys of image spans, and V4's refusal.

The live server (OpenAI and Anthropic clients, the cache, the engine's own answer) is
test_server_images_live.py.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import re
import threading
import time
from typing import ClassVar

import pytest
from PIL import Image

from dsv4stream.checkpoint.config import VisionConfig
from dsv4stream.server import toolkit
from dsv4stream.server.anthropic import to_openai
from dsv4stream.server.cache import KEY_BASE, StateCache, image_keys, keyed_decode
from dsv4stream.server.images import ImageError, ImagePolicy, fetch, load
from dsv4stream.server.prompt import chat_prompt
from dsv4stream.server.responses import input_messages
from dsv4stream.server.schemas import AnthropicRequest, ChatRequest
from dsv4stream.text.tokenizer import Tokenizer
from dsv4stream.text.vocab import write_tokenizer_files

IMAGE_ID = 129264
VISION = VisionConfig(2, 32, 2, 48, 2, 10000.0, 2, 16, 64, None)  # synth's tiny-v41 tower
POLICY = ImagePolicy(VISION, image_token_id=IMAGE_ID)


def png(color=(200, 40, 10), size=(30, 20), fmt="PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, fmt)
    return out.getvalue()


def uri(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41")
    write_tokenizer_files(d, "v41")
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": {"vocab_size": 129280}}))
    return Tokenizer.from_checkpoint(d)


def prompt(tok, content, policy=POLICY, **more):
    body = {"messages": content if isinstance(content[0], dict) and "role" in content[0] else
            [{"role": "user", "content": content}], **more}  # fmt: skip
    return chat_prompt(tok, ChatRequest.model_validate(body), body, "v41", policy)


def image_part(data: bytes, kind: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": uri(data, kind)}}


# ---- the prompt text, as DeepSeek's V4.1 encoder writes it -------------------------------------
# The official encoder (encoding/encoding.py of DeepSeek-V4.1-Flash, as vendored in ftllm 1.9.0)
# turns each image block into a text block "<｜deepseek_image｜>" (`_process_image_blocks`) and
# renders a user message's content blocks joined by "\n\n" (`render_message`); consecutive user
# messages are merged into one, their blocks joined the same way (`merge_tool_messages`).
OFFICIAL = [
    ([["IMG", "What is it?"]], "<｜User｜><｜deepseek_image｜>\n\nWhat is it?<｜Assistant｜></think>"),
    ([["A", "IMG", "B"]], "<｜User｜>A\n\n<｜deepseek_image｜>\n\nB<｜Assistant｜></think>"),
    ([["IMG"]], "<｜User｜><｜deepseek_image｜><｜Assistant｜></think>"),
    ([["IMG", "IMG", "x"]], "<｜User｜><｜deepseek_image｜>\n\n<｜deepseek_image｜>\n\nx<｜Assistant｜></think>"),
    ([["hi"], ["IMG"]], "<｜User｜>hi\n\n<｜deepseek_image｜><｜Assistant｜></think>"),
]


@pytest.mark.parametrize(("turns", "want"), OFFICIAL)
def test_prompt_text_is_the_official_encoders(tok, turns, want) -> None:
    """An image part is the placeholder joined to the parts around it by a blank line; the ids
    are that text with each placeholder expanded to its span (keyed)."""
    data = png()
    msgs = [
        {"role": "user", "content": [image_part(data) if p == "IMG" else {"type": "text", "text": p} for p in t]}
        for t in turns
    ]
    p = prompt(tok, msgs)
    n = sum(t.count("IMG") for t in turns)
    marked = p.images.real(p.ids)
    assert sum(1 for k, i in enumerate(p.ids) if i >= KEY_BASE and (k == 0 or p.ids[k - 1] < KEY_BASE)) == n
    collapsed = [i for k, i in enumerate(p.ids) if i < KEY_BASE or p.ids[k - 1] < KEY_BASE]
    assert tok.decode([i if i < KEY_BASE else IMAGE_ID for i in collapsed]) == "<｜begin▁of▁sentence｜>" + want
    assert all(i == IMAGE_ID for i, k in zip(marked, p.ids, strict=True) if k >= KEY_BASE)


def test_three_apis_make_one_prompt(tok) -> None:
    """OpenAI image_url, Anthropic base64 image and Responses input_image parts, in place between
    text: the same ids."""
    data = png()
    openai = prompt(tok, [{"type": "text", "text": "A"}, image_part(data), {"type": "text", "text": "B"}])
    b64 = base64.b64encode(data).decode()
    areq = AnthropicRequest.model_validate({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "A"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png",
        "data": b64}}, {"type": "text", "text": "B"}]}]})  # fmt: skip
    body = to_openai(areq, images=POLICY)
    anthropic = chat_prompt(tok, ChatRequest.model_validate(body), body, "v41", POLICY)
    msgs = input_messages(
        [{"role": "user", "content": [{"type": "input_text", "text": "A"},
         {"type": "input_image", "image_url": uri(data)}, {"type": "input_text", "text": "B"}]}], POLICY
    )  # fmt: skip
    responses = prompt(tok, msgs)
    assert openai.ids == anthropic.ids == responses.ids


def test_same_size_images_get_other_keys(tok) -> None:
    """Two images of one size: the same ids to the model, other keys; the same image resent (even
    as another file format holding the same pixels): the same keys."""
    red, blue = prompt(tok, [image_part(png())]), prompt(tok, [image_part(png((10, 40, 200)))])
    assert red.images.real(red.ids) == blue.images.real(blue.ids)
    assert red.ids != blue.ids
    again = prompt(tok, [image_part(png(fmt="GIF"), "image/gif")])
    assert again.ids == red.ids
    cache = StateCache(1 << 20)

    class State:
        nbytes, pos = 1, len(red.ids) - 1

    cache.put(red.ids[:-1], State())
    assert cache.lookup(red.ids) is not None and cache.lookup(blue.ids) is None


def test_keyed_decode_never_confuses_images(tok) -> None:
    """Surrogates decode to texts of their own: splice finds no equal text across two images."""
    a = image_keys([5, 6, 7, 8], [1], [2], [b"a"])
    b = image_keys([5, 6, 7, 8], [1], [2], [b"b"])
    dec = keyed_decode(tok.decode)
    assert dec(a) != dec(b) and dec([5]) == tok.decode([5]) and dec(a).startswith(tok.decode([5]))
    assert all(i < 1 << 31 for i in a)  # what a state file takes


# ---- bad images ---------------------------------------------------------------------------------


def truncated() -> bytes:
    out = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(out, "PNG")
    return out.getvalue()[:-200]


def bomb_header() -> bytes:
    """A PNG of 7000 x 7000 (49 megapixels, over the limit) that compresses to a few kB."""
    out = io.BytesIO()
    Image.new("L", (7000, 7000)).save(out, "PNG")
    return out.getvalue()


BAD = [
    (uri(b"\x89PNG\r\n\x1a\n" + b"junk" * 40), "not a readable image"),
    (uri(truncated()), "not a readable image"),
    (uri(bomb_header()), "megapixels"),
    (uri(png(fmt="BMP"), "image/bmp"), "a BMP image"),
    (uri(png(), "image/jpeg"), "declared image/jpeg but the bytes are a PNG image"),
    (uri(png(), "image/tiff"), "not one of"),
    ("data:image/png;base64,@@@@", "base64 is not valid"),
    ("data:image/png," + "abc", "must be base64"),
    ("ftp://example.com/a.png", "scheme 'ftp'"),
    ("http://127.0.0.1:9/a.png", "--allow-image-urls"),
]


@pytest.mark.parametrize(("url", "why"), BAD, ids=[w for _, w in BAD])
def test_bad_images_are_a_400_naming_the_field(tok, url, why) -> None:
    body_content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(toolkit.ApiError) as e:
        toolkit.build(lambda: prompt(tok, body_content))
    assert e.value.status == 400 and e.value.param == "messages.0.content.1.image_url.url"
    assert why in e.value.message and e.value.message.startswith("messages.0.content.1.image_url.url: ")


def test_anthropic_and_responses_name_their_own_fields() -> None:
    areq = AnthropicRequest.model_validate({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
         "data": base64.b64encode(png()).decode()}}]}]})  # fmt: skip
    with pytest.raises(ImageError, match=r"^messages\.0\.content\.0\.source\.data: declared image/jpeg"):
        to_openai(areq, images=POLICY)
    with pytest.raises(ImageError, match=r"^input\.0\.content\.1\.image_url: not a readable image"):
        input_messages([{"role": "user", "content": [{"type": "input_text", "text": "x"},
                        {"type": "input_image", "image_url": uri(b"junk")}]}], POLICY)  # fmt: skip


def test_v4_and_towerless_checkpoints_take_no_images(tok) -> None:
    from dsv4stream.checkpoint.config import ModelConfig
    from dsv4stream.server.images import policy_for

    v4 = policy_for(ModelConfig.from_json(_v4_config()))
    with pytest.raises(toolkit.ApiError) as e:
        toolkit.build(lambda: prompt(tok, [image_part(png())], v4))
    assert (
        e.value.status == 400 and "this model takes no images" in e.value.message and "DeepSeek-V4 " in e.value.message
    )
    with pytest.raises(toolkit.ApiError, match="no vision tower"):
        toolkit.build(
            lambda: prompt(tok, [image_part(png())], ImagePolicy(None, "this checkpoint has no vision tower"))
        )


def _v4_config():
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "dsv4stream" / "v4_flash_config.json"


# ---- remote URLs ----------------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: ClassVar[dict] = {}

    def do_GET(self):
        kind, value = self.routes.get(self.path, ("status", 404))
        if kind == "status":
            self.send_response(value)
            self.end_headers()
        elif kind == "redirect":
            self.send_response(302)
            self.send_header("Location", value)
            self.end_headers()
        elif kind == "bytes":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(value)))
            self.end_headers()
            self.wfile.write(value)
        elif kind == "endless":  # no length, more than any limit
            self.send_response(200)
            self.end_headers()
            for _ in range(value):
                self.wfile.write(b"x" * 4096)
        elif kind == "slow":
            self.send_response(200)
            self.end_headers()
            for _ in range(100):  # 10 s in all
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    _Handler.routes = {
        "/red.png": ("bytes", png()),
        "/big.png": ("bytes", png(size=(200, 200)) + b"\0" * 5000),
        "/endless": ("endless", 64),
        "/slow": ("slow", None),
        "/to-red": ("redirect", "/red.png"),
        "/to-file": ("redirect", "file:///etc/passwd"),
        "/loop": ("redirect", "/loop"),
        "/gone": ("status", 404),
    }
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield base
    srv.shutdown()


def test_fetch_limits(web) -> None:
    assert fetch(f"{web}/red.png", "u", 10_000, 5) == png()
    assert fetch(f"{web}/to-red", "u", 10_000, 5) == png()  # a redirect to http is followed
    for path, size, seconds, why in [
        ("/big.png", 1000, 5, "over the limit of 1,000"),  # refused by its Content-Length
        ("/endless", 100_000, 5, "over the limit of 100,000"),  # no length: counted while it streams
        ("/slow", 100_000, 1, "took over 1 s"),
        ("/to-file", 1000, 5, "not an http(s) URL"),
        ("/loop", 1000, 5, "redirects more than"),
        ("/gone", 1000, 5, "HTTP 404"),
    ]:
        t0 = time.monotonic()
        with pytest.raises(ImageError, match=re.escape(why)):
            fetch(f"{web}{path}", "u", size, seconds)
        assert time.monotonic() - t0 < 3 * seconds


def test_urls_need_the_flag(web) -> None:
    with pytest.raises(ImageError, match="--allow-image-urls"):
        load(POLICY, f"{web}/red.png", "u")
    allowed = ImagePolicy(VISION, image_token_id=IMAGE_ID, allow_urls=True)
    data, inp = load(allowed, f"{web}/red.png", "u")
    assert data == png() and inp.plan.span_len > 2
