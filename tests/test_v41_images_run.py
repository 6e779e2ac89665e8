"""V4.1 images through `dsv4 run --image` and the chat's `/image`, on the stored fixture
(tests/fixtures/v41/vision: a generated checkpoint with a 2-block vision tower).

The reference for `run` is `dsv4 logits --image` (checked against DeepSeek's own code in
test_v41_vision.py): the ids `run` generates greedily are the argmax of the logits of the same
prompt extended by them, position by position.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest

from dsv4stream.cli import main
from dsv4stream.text import chat
from dsv4stream.text.messages import ImagePart, Message
from dsv4stream.text.tokenizer import Tokenizer

FIX = Path(__file__).parent / "fixtures" / "v41" / "vision"
MARK = 62  # the fixture's image_token_id
A, B = FIX / "square.png", FIX / "wide.png"


def cli(*args: str) -> tuple[int, str, str]:
    err, out, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code or 0
    return code, out.getvalue(), err.getvalue()


def run_ids(*args: str) -> list[int]:
    code, out, err = cli("run", str(FIX), "--budget", "2", "--greedy", *args)
    assert code == 0, err
    return [int(t) for t in out.strip().split(",")]


def test_run_image_matches_logits(tmp_path) -> None:
    """Two images at their markers: the generated ids are the logits' argmax (clear rows);
    without markers the images go before the text (after BOS): the same ids."""
    prompt = [0, 5, MARK, 6, MARK, 7]
    got = run_ids("--prompt-ids", ",".join(map(str, prompt)), "--image", str(A), "--image", str(B), "--gen", "4")
    toks = tmp_path / "t.txt"
    toks.write_text(",".join(map(str, prompt + got[:-1])))
    code, _, err = cli(
        "logits", str(FIX), "--tokens-file", str(toks), "--image", str(A), "--image", str(B),
        "--out", str(tmp_path / "x.npy"), "--embeds-out", str(tmp_path / "e.npz"),
    )  # fmt: skip
    assert code == 0, err
    x = np.load(tmp_path / "x.npy")[-len(got) :]
    top2 = np.sort(x, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-3 * np.abs(x).max()
    assert clear.any()
    np.testing.assert_array_equal(np.asarray(got)[clear], x.argmax(1)[clear])
    with np.load(tmp_path / "e.npz") as e:
        assert (e["types"] >= 0).sum() > 2 * 3  # both spans expanded
    before = run_ids("--prompt-ids", "0,5,6,7", "--image", str(A), "--image", str(B), "--gen", "4")
    after = run_ids("--prompt-ids", f"0,{MARK},{MARK},5,6,7", "--image", str(A), "--image", str(B), "--gen", "4")
    assert before == after


@pytest.fixture(scope="module")
def chat_ck(tmp_path_factory) -> Path:
    """A generated V4.1 checkpoint with a small vision tower and the real V4.1 tokenizer (the
    chat format's tokens, the image placeholder at 129264)."""
    from PIL import Image

    from dsv4stream import synth

    root = tmp_path_factory.mktemp("v41chat")
    ck = synth.make_checkpoint(
        root / "ck",
        "tiny-v41",
        seed=1,
        vocab_size=synth.REAL_VOCAB,
        tokenizer=True,
        image_token_id=129264,
        engram_compressed_vocab_size=99092,  # the real tokenizer's classes
    )
    Image.new("RGB", (30, 20), (200, 40, 10)).save(root / "red.png")
    return ck


def test_chat_renders_image_parts(chat_ck) -> None:
    """An image part is the placeholder (the control token) before the text, joined by a blank
    line; typed placeholder text stays refused; images in another role are refused."""
    tok = Tokenizer.from_checkpoint(chat_ck)
    part = ImagePart("a.png", b"")
    msgs = [Message("user", (part, "what is it?"))]
    pieces = chat.pieces(msgs, "chat", encoder="v41")
    assert "<｜User｜><｜deepseek_image｜>\n\nwhat is it?<｜Assistant｜>" in pieces.text
    ids = tok.encode_prompt(pieces.items)
    assert ids.count(129264) == 1
    assert (
        tok.encode_prompt(chat.pieces([Message("user", "x <｜User｜>")], "chat", encoder="v41").items).count(129264)
        == 0
    )
    with pytest.raises(Exception, match="as text"):
        chat.pieces([Message("user", "see <｜deepseek_image｜>")], "chat", encoder="v41")
    with pytest.raises(Exception, match="only be part of a user message"):
        chat.pieces([Message("user", "hi"), Message("assistant", (part, "x"))], "chat", encoder="v41")


def one_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dsv4: "), err
    return lines[0]


def test_run_image_refusals(tmp_path, tiny_v41, real_vocab_ckpt) -> None:
    assert "DeepSeek-V4 " in one_line(*_refused(real_vocab_ckpt, "--prompt", "hi", "--image", str(A)))
    from dsv4stream.synth import make_checkpoint

    nv = make_checkpoint(tmp_path / "nv", "tiny-v41", seed=1, vision_config=None)
    assert "no vision tower" in one_line(*_refused(nv, "--prompt-ids", "0,5", "--image", str(A)))
    assert "image marker" in one_line(*_refused(FIX, "--prompt-ids", f"0,{MARK},{MARK}", "--image", str(A)))
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image")
    assert "not a readable image" in one_line(*_refused(FIX, "--prompt-ids", "0,5", "--image", str(junk)))


def _refused(ck, *args: str) -> tuple[int, str]:
    code, _, err = cli("run", str(ck), "--budget", "2", *args)
    return code, err


def test_run_chat_image(chat_ck) -> None:
    """--chat --image: the image part's span is in the prompt (more prompt tokens than the text
    alone by the span's length) and the answer comes."""
    import json

    img = chat_ck.parent / "red.png"
    stats = chat_ck.parent / "s.json"
    args = ("run", str(chat_ck), "--budget", "2", "--chat", "-p", "hi", "--gen", "2", "--greedy")
    code, _, err = cli(*args, "--image", str(img), "--stats-json", str(stats))
    assert code == 0, err
    with_image = json.loads(stats.read_text())["turn_prompt_tokens"][0]
    code, _, err = cli(*args, "--stats-json", str(stats))
    assert code == 0, err
    text_only = json.loads(stats.read_text())["turn_prompt_tokens"][0]
    assert with_image > text_only + 3  # the span (start, rows, end) and the blank line


def test_chat_image_command(chat_ck) -> None:
    """/image attaches to the next turn: that turn reads the conversation afresh with the
    image's span; the next text-only turn continues the session; a bad file is one line."""
    from dsv4stream.cli.repl import ChatSettings, Conversation, chat_loop
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    tok = Tokenizer.from_checkpoint(chat_ck)
    said: list[str] = []
    img = chat_ck.parent / "red.png"
    script = f"hello\n/image {chat_ck.parent / 'missing.png'}\n/image {img}\nwhat is this?\nand now?\n"
    with Runtime.open(chat_ck, RunOptions(budget=2 * 10**9, io="buffered")) as rt:
        conv = Conversation(tok, "chat", encoder="v41")
        out = io.StringIO()
        chat_loop(rt, conv, ChatSettings(2, 512, lambda lg: int(np.argmax(lg))), said.append, lambda: None,
                  stdin=io.StringIO(script), out=out)  # fmt: skip
        prompts = rt.stats().turn_prompt_tokens
    assert any(s.startswith("dsv4: ") and "missing.png" in s for s in said), said
    assert any("attached to your next message" in s for s in said), said
    assert any("re-reading the whole conversation" in s for s in said), said
    assert len(prompts) == 3 and prompts[1] > prompts[0] + 2 * 3 and prompts[2] < prompts[1]
    assert [type(p).__name__ for p in conv.messages[2].content] == ["ImagePart", "str"]
    assert conv.attached == []


def test_plan_counts_the_tower_with_images() -> None:
    """With images the plan holds the tower's stored bytes and an image's activations (a
    printed line; the tower leaves the 'unused' line); the activations estimate covers what
    encoding the fixture's largest images allocates (tracemalloc sees numpy's buffers)."""
    import tracemalloc

    from dsv4stream.checkpoint.catalog import Catalog
    from dsv4stream.engine.images import decode_images, image_prompt
    from dsv4stream.engine.session import Engine
    from dsv4stream.run import planner
    from dsv4stream.run.memory import measure
    from dsv4stream.run.runinfo import RunOptions

    text = measure(FIX, RunOptions(budget=planner.GB, io="buffered"))
    imgs = measure(FIX, RunOptions(budget=planner.GB, io="buffered", images=True))
    tower = sum(e.nbytes for n, e in Catalog.open(FIX).entries.items() if n.startswith(("vision.", "aligner.")))
    assert text.vision_weight_bytes == 0 and imgs.vision_weight_bytes >= tower > 0
    assert imgs.fixed_bytes == text.fixed_bytes + imgs.vision_weight_bytes + imgs.vision_activation_bytes
    lines = planner.plan(imgs, 2 * planner.GB).lines()
    assert any(line.startswith("  vision: tower") for line in lines), lines
    assert "vision tower" in (text.unused or "")
    assert "vision" not in (imgs.unused or "") and "aligner" not in (imgs.unused or "")
    eng = Engine.open(FIX)
    peak = 0
    for p in (FIX / "big.png", FIX / "wide.png", FIX / "square.png"):
        inputs = decode_images(eng, [(p.name, p.read_bytes())])
        tracemalloc.start()
        image_prompt(eng, np.array([0, MARK, 5]), inputs)
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert imgs.vision_weight_bytes + imgs.vision_activation_bytes >= peak, (peak, imgs.vision_activation_bytes)
