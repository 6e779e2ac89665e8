"""The `dsv4` command as people use it: text in, text out, sampling, the chat REPL, progress,
the report, --gpu without a GPU, and one-line errors. A generated tiny checkpoint carries the
real V4 tokenizer's vocabulary (129,280 rows), so every prompt goes through the real BPE."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_runs import stats_of

from dsv4stream import synth
from dsv4stream.cli import main
from dsv4stream.cli.repl import ChatSettings, Conversation, Interrupt, answer, chat_loop
from dsv4stream.engine.session import Engine
from dsv4stream.run.report import PrefillBar, Reads, report_lines
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.text import chat
from dsv4stream.text.tokenizer import EOS, Tokenizer

DSV4 = Path(sys.executable).with_name("dsv4")


@pytest.fixture(scope="session")
def ckpt(real_vocab_ckpt) -> Path:
    return real_vocab_ckpt


@pytest.fixture(scope="session")
def tok(real_vocab_tok) -> Tokenizer:
    return real_vocab_tok


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory) -> Path:
    """Another model: 512 embedding rows, no tokenizer of its own."""
    return synth.make_checkpoint(tmp_path_factory.mktemp("cli") / "v512", preset="tiny", seed=1)


def reply_of(ids: list[int], eos: int) -> list[int]:
    """The text part of a reply: up to, not including, EOS."""
    return ids[: ids.index(eos)] if eos in ids else ids


def text_ids(tok: Tokenizer) -> np.ndarray:
    """Ids a run may sample: the tokenizer's, less every added token of tokenizer.json but those a
    reply is made of (EOS, <think>, </think>, ｜DSML｜)."""
    added = json.loads((tok.path.parent / "tokenizer.json").read_text())["added_tokens"] if tok.path else []
    reply = {tok.special.eos, tok.special.think, tok.special.think_end, tok.special.dsml}
    banned = [t["id"] for t in added if t["id"] not in reply]
    keep = np.ones(tok.n_tokens, bool)
    keep[banned] = False
    return keep


def masked_greedy(tok: Tokenizer, ckpt: Path, ids: list[int], n: int) -> list[int]:
    """The independent expectation: an in-memory Engine, argmax over text ids, EOS stops."""
    keep = text_ids(tok)
    out = []
    pick = lambda lg: int(np.argmax(np.where(keep, lg[: tok.n_tokens], -np.inf)))
    for t in Engine.open(ckpt).session().generate(ids, n, pick=pick):
        out.append(t)
        if t == tok.special.eos:
            break
    return out


# -- generation ----------------------------------------------------------------------------


def test_text_completion_through_the_installed_command(ckpt, tok, tmp_path) -> None:
    if not DSV4.exists():
        pytest.skip(f"{DSV4} is not installed (pip install -e .)")
    stats = tmp_path / "s.json"
    r = subprocess.run(
        [str(DSV4), str(ckpt), "--prompt", "Hello there", "--gen", "5", "--budget", "1", "--stats-json", str(stats)],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    s = json.loads(stats.read_text())
    ids = [tok.special.bos, *tok.encode("Hello there")]
    assert s["prompt_tokens"] == len(ids) and s["generated_ids"] == masked_greedy(tok, ckpt, ids, 5)
    assert r.stdout == tok.decode(reply_of(s["generated_ids"], tok.special.eos)) + "\n"
    for label in (
        "time to first token",
        "prefill ",
        "decode ",
        "expert hit rate",
        "read ",
        "I/O not hidden",
        "peak RSS",
    ):
        assert label in r.stderr
    assert "of --budget 1.000 GB" in r.stderr and "Traceback" not in r.stderr


def test_one_chat_turn_uses_the_chat_format(ckpt, tok, tmp_path) -> None:
    s, _ = stats_of(tmp_path, str(ckpt), "--chat", "--system", "Be brief.", "--prompt", "Hi", "--greedy", "--gen", "3")
    want = tok.encode(chat.render(chat.one_turn("Hi", "Be brief."), "chat"))
    assert s["turn_prompt_tokens"] == [len(want)] and s["generated_ids"] == masked_greedy(tok, ckpt, want, 3)
    s, _ = stats_of(tmp_path, str(ckpt), "--think", "--prompt", "Hi", "--greedy", "--gen", "2")
    assert s["turn_prompt_tokens"] == [len(tok.encode(chat.render(chat.one_turn("Hi"), "think")))]


def test_sampling_is_reproducible_with_a_seed(ckpt, tok, tmp_path) -> None:
    args = (str(ckpt), "--chat", "--prompt", "Tell me a story", "--gen", "6", "--top-k", "50", "--top-p", "0.9")
    a, ra = stats_of(tmp_path, *args, "--seed", "7")
    b, rb = stats_of(tmp_path, *args, "--seed", "7")
    c, _ = stats_of(tmp_path, *args, "--seed", "8")
    assert a["generated_ids"] == b["generated_ids"] and ra.stdout == rb.stdout
    assert c["generated_ids"] != a["generated_ids"]
    # the chat default: DeepSeek's temperature 1.0; greedy would not depend on the seed
    assert a["sampling"] == {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "min_p": 0.0, "seed": 7}
    assert max(a["generated_ids"] + c["generated_ids"]) < tok.n_tokens  # only printable ids are drawn


def test_greedy_equals_temperature_zero(ckpt, tok, tmp_path) -> None:
    args = (str(ckpt), "--chat", "--prompt", "Why is the sky blue?", "--gen", "6")
    g, rg = stats_of(tmp_path, *args, "--greedy")
    z, rz = stats_of(tmp_path, *args, "--temperature", "0", "--seed", "3")
    assert g["generated_ids"] == z["generated_ids"] and rg.stdout == rz.stdout
    assert g["sampling"]["temperature"] == z["sampling"]["temperature"] == 0.0
    want = masked_greedy(tok, ckpt, tok.encode(chat.render(chat.one_turn("Why is the sky blue?"), "chat")), 6)
    assert g["generated_ids"] == want


def test_prompt_ids_print_ids(ckpt, tmp_path) -> None:
    s, res = stats_of(tmp_path, str(ckpt), "--prompt-ids", "0,5,9", "--gen", "4")
    assert res.stdout.strip() == ",".join(map(str, s["generated_ids"])) and len(s["generated_ids"]) == 4
    assert s["generated_ids"] == list(Engine.open(ckpt).session().generate([0, 5, 9], 4))


# -- the REPL ------------------------------------------------------------------------------


def test_repl_second_turn_prefills_only_its_new_tokens(ckpt, tok, tmp_path) -> None:
    if not DSV4.exists():
        pytest.skip(f"{DSV4} is not installed (pip install -e .)")
    stats = tmp_path / "s.json"
    r = subprocess.run(
        [str(DSV4), str(ckpt), "--chat", "--greedy", "--gen", "4", "--budget", "1", "--stats-json", str(stats)],
        input="Hello there\nHow are you?\n", capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    s = json.loads(stats.read_text())
    eos = tok.special.eos
    first = tok.encode(chat.render(chat.one_turn("Hello there"), "chat"))
    reply1 = masked_greedy(tok, ckpt, first, 4)
    pending = [reply1[-1]] if reply1[-1] == eos else [reply1[-1], eos]
    second = pending + tok.encode("<｜User｜>How are you?<｜Assistant｜></think>")
    assert s["turn_prompt_tokens"] == [len(first), len(second)]
    # the kept session answers exactly as a fresh one fed everything at once
    fed = first + reply1[:-1] + second
    assert s["generated_ids"] == reply1 + masked_greedy(tok, ckpt, fed, 4)
    texts = [tok.decode(reply_of(x, eos)) for x in (reply1, s["generated_ids"][len(reply1) :])]
    assert r.stdout == "".join(t + "\n" for t in texts)  # no "> " prompt when stdin is not a terminal
    assert r.stderr.count("time to first token") == 1  # the report once, at exit


def test_repl_commands(ckpt, tok, tmp_path) -> None:
    script = "/system Be brief.\nHi\n/think\nWhy?\nAnd?\n/nothink\n/reset\nHello\n/stats\n/help\n/bogus\n/quit\nnever\n"
    s, res = stats_of(tmp_path, str(ckpt), "--chat", "--greedy", "--gen", "3", input=script)
    n = s["turn_prompt_tokens"]
    assert len(n) == 4  # /quit stopped before "never"
    assert n[0] == len(tok.encode(chat.render([chat.Message("system", "Be brief."), chat.Message("user", "Hi")])))
    # chat -> think keeps the session: earlier turns render the same, the new one opens <think>
    r1 = s["generated_ids"][:3]
    pending = 1 if r1[-1] == tok.special.eos else 2
    assert n[1] == pending + len(tok.encode("<｜User｜>Why?<｜Assistant｜><think>"))
    # think mode drops the reasoning of earlier turns: the whole conversation is read again
    assert "think mode drops earlier turns' reasoning: re-reading the whole conversation" in res.stderr
    assert n[3] == len(tok.encode(chat.render([chat.Message("system", "Be brief."), chat.Message("user", "Hello")])))
    assert "(thinking on)" in res.stderr and "(conversation cleared)" in res.stderr and "/reset" in res.stderr
    assert res.stderr.count("time to first token") == 2  # /stats, then the report at exit
    assert "dsv4: unknown command /bogus" in res.stderr


def test_repl_refuses_a_turn_beyond_ctx_and_keeps_the_session(ckpt, tok, tmp_path) -> None:
    long = " ".join(["word"] * 60)
    s, res = stats_of(tmp_path, str(ckpt), "--chat", "--greedy", "--gen", "3", "--ctx", "40",
                      input=f"Hi\n{long}\nOk\n")  # fmt: skip
    alone = len(tok.encode(chat.render(chat.one_turn(long))))
    # /reset cannot help a turn longer than --ctx on its own: only a larger --ctx
    assert (
        f"leaving no room to answer within --ctx 40; restart with a larger --ctx (at least {alone + 1})" in res.stderr
    )
    assert "/reset" not in res.stderr
    first = len(tok.encode(chat.render(chat.one_turn("Hi"))))
    r1 = s["generated_ids"][:3]
    pending = 1 if r1[-1] == tok.special.eos else 2
    assert s["turn_prompt_tokens"] == [first, pending + len(tok.encode("<｜User｜>Ok<｜Assistant｜></think>"))]


@pytest.fixture()
def rt(ckpt):
    with Runtime.open(ckpt, RunOptions(budget=10**9, io="buffered", chunk=8)) as r:
        yield r


def test_ctrl_c_stops_the_answer_between_tokens_and_the_chat_goes_on(rt, tok) -> None:
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs in the background
    conv = Conversation(tok, "chat")
    turn = conv.prepare("Hello")
    session = rt.session()
    n = 0

    def pick(logits: np.ndarray) -> int:
        nonlocal n
        n += 1
        if n == 3:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, handled between tokens
        return int(np.argmax(logits[: tok.n_tokens]))

    out = io.StringIO()
    with Interrupt() as flag:
        reply = answer(rt, session, turn.ids, gen=20, pick=pick, tok=tok, interrupt=flag, out=out)
    assert reply.stopped and len(reply.ids) == 3 and session.pos == len(turn.ids) + 2
    assert reply.reason == "interrupted" and rt.stats().stop_reasons == ["interrupted"]
    conv.commit(turn, session, reply.ids)
    nxt = conv.prepare("Go on")
    assert not nxt.fresh and nxt.ids[:2] == [reply.ids[-1], tok.special.eos]
    assert conv.fed_text == turn.text + tok.decode(reply.ids) + EOS
    assert signal.getsignal(signal.SIGINT) is before  # handler given back


def test_ctrl_c_at_the_prompt_leaves_cleanly(rt, tok) -> None:
    class CtrlC(io.StringIO):
        def readline(self, *a) -> str:
            raise KeyboardInterrupt

    said: list[str] = []
    chat_loop(rt, Conversation(tok), ChatSettings(4, 64, lambda lg: 0), said.append, lambda: None, stdin=CtrlC())
    assert rt.stats().turn_prompt_tokens == []


# -- progress and report -------------------------------------------------------------------


def test_prefill_progress_in_segments_and_layers_equals_one_prefill(rt, tok, ckpt) -> None:
    ids = [tok.special.bos, *tok.encode(" ".join(["one", "two", "three"] * 9))][:19]
    calls: list[tuple[int, int]] = []
    layers: list[str] = []
    s = rt.engine.session(chunk_size=4, segment=8)
    got = list(
        rt.generate(s, ids, 3, progress=lambda d, t: calls.append((d, t)), on_layer=lambda p: layers.append(p.where()))
    )
    assert calls == [(8, 19), (16, 19), (19, 19)]
    n = rt.cfg.n_layers
    assert layers == [f"layer {i}/{n}, segment {j}/3" for j in (1, 2, 3) for i in range(1, n + 1)]
    assert got == list(Engine.open(ckpt).session(chunk_size=64).generate(ids, 3))
    lines = io.StringIO()
    bar = PrefillBar(lambda: Reads(10, 5, 3_000_000), file=lines, enabled=True, tick=0.01)
    bar.start(19)
    bar(8, 19, "layer 2/4, segment 1/3")
    bar.note("stopping after this layer")
    bar(19, 19)
    bar.close()
    text = lines.getvalue()
    assert "prefill" in text and "19/19 tokens" in text and "read 0.0 MB" in text
    assert "layer 2/4, segment 1/3" in text and "stopping after this layer" in text
    assert PrefillBar(lambda: Reads(0, 0, 0), file=io.StringIO()).__call__(1, 2) is None  # not a tty: silent


def test_report_separates_prefill_from_decode(rt) -> None:
    list(rt.generate(rt.session(), [0, 1, 2, 3, 4], 4))
    s = rt.stats()
    lines = report_lines(s)
    assert s.turn_prompt_tokens == [5] and len(s.first_token_seconds) == 1 and s.decode_tokens == 3
    decode = next(line for line in lines if line.startswith("decode"))
    assert f"{s.decode_seconds_per_token:.3f} s/token, {3 / (3 * s.decode_seconds_per_token):.2f} tokens/s" in decode
    assert "over 3 tokens (prefill excluded)" in decode
    assert any(line.startswith("prefill") and "5 tokens" in line for line in lines)


# -- --gpu and errors ----------------------------------------------------------------------


def test_gpu_without_cupy_says_so_once_and_runs_on_the_cpu(ckpt, tmp_path) -> None:
    from dsv4stream import gpu

    ok, _ = gpu.available()
    if ok:
        pytest.skip("a working GPU: the fallback is not taken here")
    g, res = stats_of(tmp_path, str(ckpt), "--prompt", "Hi", "--gen", "3", "--gpu", "--vram", "2")
    c, _ = stats_of(tmp_path, str(ckpt), "--prompt", "Hi", "--gen", "3")
    gpu_lines = [line for line in res.stderr.splitlines() if "--gpu" in line]
    assert len(gpu_lines) == 1 and gpu_lines[0].startswith("dsv4: --gpu: ") and "running on the CPU" in gpu_lines[0]
    assert g["generated_ids"] == c["generated_ids"]


def errors(ckpt: Path, small_vocab: Path, tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "empty").mkdir(exist_ok=True)
    c = str(ckpt)
    p = ["--prompt", "Hi"]
    return [
        (["/no/such/dir", *p], "no such checkpoint directory"),
        ([str(tmp / "empty"), *p], "not a checkpoint directory (no config.json)"),
        ([c, *p, "--trunk", "/no/such"], "--trunk /no/such: no such directory"),
        ([c, *p, "--trunk", f"{c}/config.json"], "is a file; pass the directory `dsv4 pack-trunk"),
        ([c, *p, "--trunk", str(tmp / "empty")], "no packed trunk here"),
        ([c, *p, "--tok", "/no/such.pack"], "--tok /no/such.pack: no such file"),
        ([c, *p, "--tok", f"{c}/config.json"], "not a packed dsv4 tokenizer"),
        ([str(small_vocab), *p, "--tok", f"{c}/dsv4-tokenizer.pack"], "this checkpoint has 512"),
        ([c, *p, "--budget", "0.01"], "--budget 0.01 GB is below the minimum"),
        ([c, *p, "--ctx", "2"], "the prompt (2 tokens) leaves no room to answer within --ctx 2; raise --ctx above 2"),
        ([c, *p, "--chat", "--think"], "--chat and --think conflict"),
        ([c, *p, "--prompt-file", f"{c}/config.json"], "--prompt and --prompt-file conflict"),
        ([c, *p, "--prompt-ids", "1"], "--prompt and --prompt-ids conflict"),
        ([c, *p, "--greedy", "--temperature", "0.5"], "--greedy and --temperature 0.5 conflict"),
        ([c, *p, "--top-k", "5"], "--top-k: no effect with greedy decoding"),
        ([c, *p, "--chat", "--greedy", "--min-p", "0.1"], "--min-p: no effect with --greedy"),
        ([c, "--prompt-ids", "1", "--chat"], "--prompt-ids is a raw id prompt"),
        ([c, *p, "--system", "x"], "--system needs --chat or --think"),
        ([c, *p, "--vram", "2"], "--vram applies to --gpu"),
        ([c], "give --prompt TEXT, --prompt-file F or --prompt-ids 1,2,3, or --chat"),
        ([c, *p, "--gen", "0"], "--gen 0: give at least 1"),
        ([c, *p, "--chat", "--top-p", "1.5"], "--top-p 1.5: give a probability in (0, 1]"),
        ([c, *p, "--temperature", "-1"], "--temperature -1.0: give 0 (greedy) or more"),
        ([c, *p, "--temperature", "inf"], "--temperature inf: give 0 (greedy) or more, a finite number"),
        ([c, *p, "--temperature", "nan"], "--temperature nan: give 0 (greedy) or more"),
        ([c, "--prompt-ids", "1,x"], "--prompt-ids: token list: entry 2, 'x', is not an integer id"),
        ([c, "--prompt-ids", "1,999999"], "--prompt-ids: id 999999 is outside the vocabulary 0..129279"),
        ([c, "--prompt-file", "/no/such.txt"], "--prompt-file /no/such.txt: no such file"),
        ([c, "--prompt", ""], "the prompt is empty"),
        ([c, *p, "--prompt-file", str(tmp)], "--prompt and --prompt-file conflict"),
        ([c, "--prompt-file", str(tmp)], f"{tmp}: --prompt-file (for --ctx 4096) is a directory, not a regular file"),
        ([c, *p, "--stats-json", str(tmp)], f"--stats-json {tmp}: is a directory; give a file name"),
        ([c, *p, "--route-log", "/no/such/dir/r.log"], "directory /no/such/dir does not exist"),
    ]


def test_every_mistake_is_one_line_and_exit_2(ckpt, small_vocab, tmp_path, capsys) -> None:
    for args, want in errors(ckpt, small_vocab, tmp_path):
        argv = args if "--budget" in args else [*args, "--budget", "1"]
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2, (args, err)
        assert err.startswith("dsv4: ") and err.count("\n") == 1 and want in err, (args, err)


def test_errors_through_a_real_process_with_and_without_debug(ckpt) -> None:
    if not DSV4.exists():
        pytest.skip(f"{DSV4} is not installed (pip install -e .)")
    args = [str(DSV4), str(ckpt), "--prompt", "Hi", "--budget", "0.01"]
    r = subprocess.run(args, capture_output=True, text=True, check=False, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("dsv4: --budget 0.01 GB")
    r = subprocess.run([*args, "--debug"], capture_output=True, text=True, check=False, timeout=60)
    assert r.returncode == 2 and "Traceback" in r.stderr and r.stderr.splitlines()[-1].startswith("dsv4: --budget")
