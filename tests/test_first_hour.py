"""What a new user tripped over in their first hour, each checked where it happens: why generation
stopped, a full --ctx, Ctrl-C during a prefill, special ids never sampled, one plan from
inspect / doctor / run / bench, chat input, command typos and short flags, doctor's advice,
bench's summary, and small file-handling fixes. The tiny checkpoint carries the real V4
tokenizer (`real_vocab_ckpt` in conftest.py); expectations come from an in-memory Engine, the
tokenizer.json file itself, or the planner's own arithmetic on the numbers printed."""

from __future__ import annotations

import io
import json
import os
import signal
import stat

import numpy as np
import pytest
from cli_runs import stats_of
from click.testing import CliRunner

from dsv4stream import synth
from dsv4stream.cli import main
from dsv4stream.cli import run as run_mod
from dsv4stream.cli.bench import below_working_set, budget_slots, memory_needs, sweep_title
from dsv4stream.cli.doctor import doctor
from dsv4stream.cli.inspect import inspect
from dsv4stream.cli.repl import Interrupt, Stopped, answer, no_echo, read_turn
from dsv4stream.engine.session import Engine
from dsv4stream.errors import BudgetError
from dsv4stream.run import ticker
from dsv4stream.run.planner import GB, minimum_budget, plan
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.text import chat
from dsv4stream.text import sampler as sampler_mod
from dsv4stream.text.sampler import SamplingParams, banned_ids, make_pick
from dsv4stream.text.tokenizer import real_tokenizer_files
from dsv4stream.trunkpack.packdir import pack_hint

PLACEHOLDER = 128091  # <｜place▁holder▁no▁91｜> in the release tokenizer.json


def run_cli(*args: str, input: str | None = None):
    return CliRunner().invoke(run_mod.run, list(args), input=input, catch_exceptions=False)


@pytest.fixture(scope="module")
def ckpt(real_vocab_ckpt):  # the CLI tests' checkpoint and tokenizer, shared through conftest.py
    return real_vocab_ckpt


@pytest.fixture(scope="module")
def tok(real_vocab_tok):
    return real_vocab_tok


# -- why it stopped, and --ctx ---------------------------------------------------------------


def test_stop_reason_decode_rate_and_load_time_are_reported(ckpt, tmp_path) -> None:
    s, res = stats_of(tmp_path, str(ckpt), "--prompt", "Hello", "--gen", "3")
    assert s["stop_reason"] == "gen_limit" and s["stop_reasons"] == ["gen_limit"] and len(s["generated_ids"]) == 3
    assert s["stopped_in_think"] == [False]
    assert s["decode_tokens_per_second"] == pytest.approx(1 / s["decode_seconds_per_token"])
    assert 0 < s["kernel_warmup_seconds"] <= s["load_seconds"]
    rows = dict(line.split(None, 1) for line in res.stderr.splitlines() if line.startswith(("stopped ", "load ")))
    assert rows["stopped"].strip() == "at the --gen limit"
    assert rows["load"].startswith(f"{s['load_seconds']:.2f} s before the prefill")


def test_generation_stops_when_the_context_is_full(ckpt, tmp_path) -> None:
    # ids in, ids out: no tokenizer, so no EOS can end it first
    s, res = stats_of(tmp_path, str(ckpt), "--prompt-ids", "0,5,9", "--gen", "100", "--ctx", "12")
    assert s["stop_reason"] == "context_full"
    # the session may hold --ctx positions: the prompt and every generated token but the last
    assert len(s["generated_ids"]) == 12 - 3 + 1
    assert s["generated_ids"] == list(Engine.open(ckpt).session().generate([0, 5, 9], 10))
    assert "with the context full (--ctx)" in res.stderr


def test_chat_answers_until_the_context_is_full_then_offers_reset(ckpt, tok, tmp_path) -> None:
    s, res = stats_of(tmp_path, str(ckpt), "--chat", "--greedy", "--ctx", "24", input="Hi\nHi again\n/reset\nHi\n")
    first = len(tok.encode(chat.render(chat.one_turn("Hi"))))
    assert s["stop_reasons"] == ["context_full", "context_full"]  # no --gen: to the end of --ctx
    assert len(s["generated_ids"]) == 2 * (24 - first + 1)
    assert "(stopped with the context full (--ctx))" in res.stderr
    # the second turn cannot start; /reset would help, since it fits alone
    assert f"after the {24} the conversation holds, leaving no room to answer within --ctx 24; /reset" in res.stderr
    assert s["turn_prompt_tokens"] == [first, first]


def test_ctrl_c_during_a_prefill_is_acknowledged_at_once_and_counted(ckpt, tok) -> None:
    ids = [tok.special.bos, *tok.encode(" ".join(["word"] * 40))]
    err, seen = io.StringIO(), []

    def ctrl_c_in_the_first_layer(layer: int, positions, experts) -> None:
        if not seen and positions[0] >= 8:  # the second segment
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, mid-prefill
            seen.append(err.getvalue())  # what was said before the forward pass went on

    with Runtime.open(ckpt, RunOptions(budget=GB, io="buffered", chunk=8)) as rt:
        session = rt.engine.session(chunk_size=8, segment=8, on_route=ctrl_c_in_the_first_layer)
        with Interrupt(err=err) as flag, pytest.raises(Stopped) as e:
            answer(rt, session, ids, gen=4, pick=lambda lg: 0, tok=tok, interrupt=flag, out=io.StringIO())
        s = rt.stats()
    assert "stopping the prefill after this layer" in seen[0]
    done = e.value.done
    assert done == 8 < len(ids) == e.value.total and session.pos == done and session.torn  # within one layer
    assert s.turn_prompt_tokens == [done] and s.prompt_tokens == done and s.stop_reason == "interrupted"


def test_a_think_answer_cut_by_gen_says_so(ckpt, tok) -> None:
    ids = tok.encode(chat.render(chat.one_turn("Hi"), "think"))
    never_closes = lambda lg: 5
    with Runtime.open(ckpt, RunOptions(budget=GB, io="buffered")) as rt:
        reply = answer(rt, rt.session(), ids, gen=3, pick=never_closes, tok=tok, thinking=True, out=io.StringIO())
        s = rt.stats()
    assert (reply.reason, reply.in_think) == ("gen_limit", True)
    assert s.stop_reasons == ["gen_limit"] and s.stopped_in_think == [True]


# -- special ids ---------------------------------------------------------------------------


def test_control_ids_are_never_sampled_but_eos_and_reply_tokens_are(tok) -> None:
    data = json.loads(real_tokenizer_files()[0].read_text(encoding="utf-8"))
    added = {t["id"] for t in data["added_tokens"]}
    reply = {tok.special.eos, tok.special.think, tok.special.think_end, tok.special.dsml}
    banned = set(banned_ids(tok))
    assert banned == added - reply and PLACEHOLDER in banned and tok.special.user in banned and len(banned) > 1000
    assert not {tok.special.eos, tok.special.think_end, tok.special.think, tok.special.dsml} & banned
    logits = np.zeros(tok.vocab_size, np.float32)
    logits[PLACEHOLDER], logits[tok.special.think_end] = 50.0, 10.0
    rng = np.random.default_rng(0)
    assert make_pick(SamplingParams(), tok.n_tokens, rng, sorted(banned))(logits) == tok.special.think_end
    drawn = make_pick(SamplingParams(temperature=5.0), tok.n_tokens, rng, sorted(banned))
    assert not {drawn(logits) for _ in range(300)} & banned
    assert make_pick(SamplingParams(), tok.n_tokens, rng, banned_ids(tok, allow_special=True))(logits) == PLACEHOLDER


def test_the_run_command_masks_what_it_samples(ckpt, tok, monkeypatch) -> None:
    special = {t["id"] for t in json.loads(real_tokenizer_files()[0].read_text())["added_tokens"] if t["special"]}
    seen: list[np.ndarray] = []
    real = sampler_mod.sample
    monkeypatch.setattr(sampler_mod, "sample", lambda x, p, rng: seen.append(x.copy()) or real(x, p, rng))
    run_cli(str(ckpt), "--chat", "--prompt", "Hi", "--gen", "2", "--budget", "1", "--seed", "1")
    banned = sorted(special - {tok.special.eos})
    assert seen and all(np.isneginf(x[banned]).all() and np.isfinite(x[tok.special.eos]) for x in seen)
    seen.clear()
    run_cli(str(ckpt), "--chat", "--prompt", "Hi", "--gen", "2", "--budget", "1", "--seed", "1", "--allow-special")
    assert seen and all(np.isfinite(x[banned]).all() for x in seen)


# -- one planner ---------------------------------------------------------------------------


def plan_block(text: str) -> list[str]:
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("budget "))
    return lines[at : at + 4]


def test_inspect_doctor_run_and_bench_agree_on_the_plan(ckpt, tmp_path) -> None:
    ins = CliRunner().invoke(inspect, [str(ckpt), "--budget", "0.37"], catch_exceptions=False)
    minimum = next(line for line in ins.output.splitlines() if line.startswith("smallest budget that runs"))
    low = float(minimum.split()[4])
    doc = CliRunner().invoke(doctor, [str(ckpt), "--seconds", "0.05", "--depths", "1"], catch_exceptions=False)
    assert f"smallest budget that runs: {low:.2f} GB" in doc.output
    out = tmp_path / "s.json"
    res = run_cli(str(ckpt), "--prompt", "Hi", "--gen", "2", "--budget", "0.37", "--stats-json", str(out))
    assert plan_block(res.stderr) == plan_block(ins.output)
    assert json.loads(out.read_text())["cache_slots"] == budget_slots(memory_needs(ckpt)[0], 0.37)
    with pytest.raises(BudgetError, match=f"below the minimum of {low:.2f} GB"):
        run_cli(str(ckpt), "--prompt", "Hi", "--budget", f"{low - 0.01:.2f}")
    assert run_cli(str(ckpt), "--prompt", "Hi", "--gen", "1", "--budget", f"{low:.2f}").exit_code == 0


def test_doctor_recommends_the_smallest_budget_for_its_plan_and_says_why(ckpt) -> None:
    r = CliRunner().invoke(doctor, [str(ckpt), "--seconds", "0.05", "--depths", "1"], catch_exceptions=False)
    assert "TARGET" not in r.output and "ModuleNotFoundError" not in r.output
    vram = next(line for line in r.output.splitlines() if line.startswith("vram:"))
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert "no CuPy" in vram
    rec = next(line for line in r.output.splitlines() if line.startswith("recommended --budget "))
    gb = float(rec.split()[2].rstrip(":"))
    needs = memory_needs(ckpt)[0]
    # one step below, unless that is below the minimum (whose pool may already hold every expert)
    below = round((gb - 0.01) * GB)
    p, q = plan(needs, round(gb * GB)), plan(needs, below) if below >= minimum_budget(needs) else None
    assert p.pinned_layers == len(needs.layer_bytes) and p.expert_slots == needs.total_experts
    assert "every trunk layer and every expert fits: more buys nothing" in rec
    assert q is None or (q.pinned_layers, q.expert_slots) < (p.pinned_layers, p.expert_slots)


# -- chat input, typos, short flags --------------------------------------------------------


def test_multi_line_turns_with_a_backslash_or_a_block() -> None:
    stdin = io.StringIO('one \\\ntwo\n"""\na\n\nb\n"""\nlast\n"""\ncut by EOF\n')
    turns = [read_turn(stdin, False) for _ in range(5)]
    assert turns == ["one \ntwo", "a\n\nb", "last", "cut by EOF", None]


def test_commands_with_a_stray_argument_are_refused(ckpt, tok, tmp_path) -> None:
    s, res = stats_of(tmp_path, str(ckpt), "--chat", "--greedy", "--gen", "2", input="/think extra\nHi\n")
    # refused with a line naming what was wrong (whatever efforts /think may take), nothing changed
    said = [line for line in res.stderr.splitlines() if line.startswith("dsv4: /think") or "'extra'" in line]
    assert len(said) == 1 and "extra" in said[0] and "(thinking on)" not in res.stderr
    assert s["turn_prompt_tokens"] == [len(tok.encode(chat.render(chat.one_turn("Hi"), "chat")))]  # mode unchanged


def test_keys_typed_during_an_answer_are_not_echoed() -> None:
    import termios

    master, slave = os.openpty()
    with os.fdopen(slave, "r") as f, os.fdopen(master, "w"):
        with no_echo(f):
            assert not termios.tcgetattr(slave)[3] & termios.ECHO
        assert termios.tcgetattr(slave)[3] & termios.ECHO


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["inpsect", "somewhere"], "did you mean `dsv4 inspect`?"),
        (["docter"], "did you mean `dsv4 doctor`?"),
        (["bench", "simulat", "route.log"], "did you mean `dsv4 bench simulate`?"),
    ],
)
def test_command_typos_get_a_suggestion(argv, want, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and want in err


def test_short_flags_are_the_long_ones(ckpt, tmp_path) -> None:
    short, _ = stats_of(tmp_path, str(ckpt), "-p", "Hello", "-n", "3", "-c", "64", "-t", "1", "-s", "7",
                        "--temperature", "0.9")  # fmt: skip
    long, _ = stats_of(tmp_path, str(ckpt), "--prompt", "Hello", "--gen", "3", "--ctx", "64", "--threads", "1",
                       "--seed", "7", "--temperature", "0.9")  # fmt: skip
    assert short["generated_ids"] == long["generated_ids"] and short["sampling"] == long["sampling"]


# -- bench, files, compile ticker ------------------------------------------------------------


def test_bench_summary_warns_below_the_working_set_and_titles_the_plot() -> None:
    recs = [{"budget_gb": 1, "cache_slots": 20, "working_set_experts": 36}, {"budget_gb": 2, "cache_slots": 40,
            "working_set_experts": 36}]  # fmt: skip
    lines = below_working_set(recs, 1.42)
    assert len(lines) == 1 and "--budget 1 the cache holds 20 experts, fewer than the working set of 36" in lines[0]
    assert "from --budget 1.42 up" in lines[0]
    meta = {"checkpoint": "/x/demo", "routing": "generated, uniform routing (route_skew 0): ...",
            "working_set_experts": 36, "machine": {"cpus": 2}}  # fmt: skip
    title = sweep_title(meta, 16)
    assert "--budget" in title and "demo" in title and "uniform routing" in title and "2 CPUs" in title


def test_tokenizer_json_is_accepted_for_tok(ckpt, tmp_path) -> None:
    a, _ = stats_of(tmp_path, str(ckpt), "--prompt", "Hello", "--gen", "2", "--tok", str(ckpt / "tokenizer.json"))
    b, _ = stats_of(tmp_path, str(ckpt), "--prompt", "Hello", "--gen", "2")
    assert a["generated_ids"] == b["generated_ids"]


def test_generated_shards_are_world_readable(tmp_path) -> None:
    path = synth.make_checkpoint(tmp_path / "c", preset="tiny", seed=0)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    assert all(m & 0o044 == 0o044 for m in modes.values()), modes


def test_read_only_checkpoint_hints_point_elsewhere(tmp_path, monkeypatch) -> None:
    assert f"`dsv4 pack-trunk {tmp_path}` once" in pack_hint(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as on a read-only mount (root ignores modes)
    hint = pack_hint(tmp_path)
    assert "read-only" in hint and f"`dsv4 pack-trunk {tmp_path} OUT_DIR`" in hint and "--trunk OUT_DIR" in hint


def test_compile_ticker_shows_elapsed_time_on_a_terminal() -> None:
    out = io.StringIO()
    with ticker.elapsed("compiling", file=out, tick=0.01, enabled=True):
        __import__("time").sleep(0.05)
    text = out.getvalue()
    assert text.startswith("\rcompiling ... 0 s") and text.endswith(" s\n") and text.count("\r") >= 3
    quiet = io.StringIO()
    with ticker.elapsed("compiling", file=quiet):  # not a terminal: nothing
        pass
    assert quiet.getvalue() == ""
