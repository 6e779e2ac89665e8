"""The DSpark drafter (issue 41) against DeepSeek's V4.1 reference (stored fixture, no torch).

tests/fixtures/v41/dspark holds a generated checkpoint with a three-stage drafter and what
DeepSeek's `forward_spec` computed at every position 1..T-1-B of a random prompt, teacher-forced
(tools/v41_reference_dspark.py), in fp32 and official numerics. The thresholds are the issue's:
- fp32: draft logits within 1e-4 of max |ref| with the same argmax on clear rows (top-2 gap
  above 1e-3 of max |ref|); confidence within 1e-4 of max(1, max |ref|);
- official: median row max |d| <= 0.08 of max |ref|, argmax on >= 80 % of the clear rows,
  confidence median |d| <= 0.05 of max(1, max |ref|);
- `--mode step` (the main model one token per pass) equals prefill up to rounding.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dsv4stream.cli import main
from dsv4stream.cli.logits import logits as logits_cmd
from dsv4stream.engine.dspark_v41 import draft_positions, teacher_forced_drafts
from dsv4stream.engine.session import Engine
from dsv4stream.engine.stack_v41 import V41Options
from dsv4stream.errors import UsageError

FIXTURE = Path(__file__).parent / "fixtures" / "v41" / "dspark"


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A DeepSeek-V4 checkpoint: no V4.1 drafter."""
    from dsv4stream import synth

    return synth.make_checkpoint(tmp_path_factory.mktemp("v4") / "tiny", preset="tiny", seed=2)


@cache
def oracle() -> dict:
    with np.load(FIXTURE / "draft.npz") as z:
        return {k: z[k] for k in z.files}


@cache
def ours(numerics: str, mode: str = "prefill") -> tuple[np.ndarray, np.ndarray]:
    o = oracle()
    ids = o["token_ids"]
    eng = Engine.open(FIXTURE, v41=V41Options(numerics=numerics), threads=1)  # tiny matrices: 1 is fastest
    chunk, segment = (ids.size, None) if mode == "prefill" else (1, 1)
    _, logits, conf = teacher_forced_drafts(eng, ids, o["positions"], chunk, segment)
    return logits, conf


def clear_rows(ref: np.ndarray, frac: float) -> np.ndarray:
    s = np.sort(ref, axis=-1)
    return (s[..., -1] - s[..., -2]) > frac * np.abs(ref).max()


def test_fp32_matches_the_reference() -> None:
    logits, conf = ours("fp32")
    ref, ref_c = oracle()["logits_fp32"], oracle()["confidence_fp32"]
    assert logits.shape == ref.shape and conf.shape == ref_c.shape
    m = np.abs(ref).max()
    err = np.abs(logits - ref).max()
    assert err <= 1e-4 * m, f"draft logits max|d| {err:.2e} (max|ref| {m:.3f})"
    clear = clear_rows(ref, 1e-3)
    assert clear.mean() > 0.8
    wrong = np.argwhere((logits.argmax(-1) != ref.argmax(-1)) & clear)
    assert wrong.size == 0, f"argmax differs at (position, slot) {wrong[:5].tolist()}"
    cerr = np.abs(conf - ref_c).max()
    assert cerr <= 1e-4 * max(1.0, np.abs(ref_c).max()), f"confidence max|d| {cerr:.2e}"


def test_official_matches_the_reference() -> None:
    logits, conf = ours("official")
    ref, ref_c = oracle()["logits_official"], oracle()["confidence_official"]
    m = np.abs(ref).max()
    row = np.abs(logits - ref).max(-1) / m
    assert np.median(row) <= 0.08, f"median row max|d| {np.median(row):.3f} of max|ref|"
    clear = clear_rows(ref, 1e-3)
    agree = (logits.argmax(-1) == ref.argmax(-1))[clear].mean()
    assert agree >= 0.8, f"argmax agrees on {agree:.1%} of {clear.sum()} clear rows"
    cmed = np.median(np.abs(conf - ref_c))
    assert cmed <= 0.05 * max(1.0, np.abs(ref_c).max()), f"confidence median |d| {cmed:.3f}"


def test_the_markov_bias_and_the_noise_block_matter() -> None:
    """Slots after the first differ from the head alone: a drafter that dropped the Markov bias
    or the teacher chain would not pass the fp32 check (guards the check itself)."""
    ref = oracle()["logits_fp32"]
    assert np.abs(ref[:, 1:] - ref[:, :1]).max() > 1e-2 * np.abs(ref).max()


def test_step_mode_equals_prefill() -> None:
    lp, cp = ours("fp32")
    ls, cs = ours("fp32", "step")
    assert np.abs(ls - lp).max() <= 1e-5 * np.abs(lp).max()
    assert np.abs(cs - cp).max() <= 1e-5 * max(1.0, np.abs(cp).max())


def usage_error(capsys, args: list[str]) -> str:
    """`dsv4 logits ARGS` exits 2 with one line on stderr; that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["logits", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("dsv4: "), err
    return err


def test_draft_positions() -> None:
    assert draft_positions("all", 10, 5).tolist() == [1, 2, 3, 4]
    assert draft_positions("4,1,4", 10, 5).tolist() == [1, 4]
    for bad in ("0", "5", "1,x", ""):
        with pytest.raises(UsageError):
            draft_positions(bad, 10, 5)
    with pytest.raises(UsageError):
        draft_positions("all", 6, 5)


def test_cli_writes_the_draft_arrays(tmp_path, capsys) -> None:
    ids = oracle()["token_ids"][:12]
    tok = tmp_path / "ids.txt"
    tok.write_text(",".join(map(str, ids)))
    out, d = tmp_path / "x.npy", tmp_path / "d.npz"
    args = [str(FIXTURE), "--tokens-file", str(tok), "--out", str(out), "--numerics", "fp32", "--threads", "1"]
    r = CliRunner().invoke(logits_cmd, [*args, "--draft-out", str(d), "--draft-positions", "2,6"])
    assert r.exit_code == 0, r.output
    with np.load(d) as z:
        assert sorted(z.files) == ["confidence", "logits", "positions"]
        assert z["positions"].dtype == np.int64 and z["positions"].tolist() == [2, 6]
        assert z["logits"].dtype == np.float32 and z["logits"].shape == (2, 5, 64)
        assert z["confidence"].dtype == np.float32 and z["confidence"].shape == (2, 5)
        # position 6 of the fixture's own run, through a prompt cut after it
        ref = oracle()["logits_fp32"][oracle()["positions"].tolist().index(6)]
        assert np.abs(z["logits"][1] - ref).max() <= 1e-4 * np.abs(ref).max()
    assert np.load(out).shape == (12, 64)
    err = usage_error(capsys, [*args, "--draft-out", str(d), "--draft-positions", "7"])
    assert "outside 1..6" in err


def test_cli_refuses_a_checkpoint_without_this_drafter(tmp_path, tiny_ckpt, capsys) -> None:
    tok = tmp_path / "ids.txt"
    tok.write_text("1,2,3,4,5,6,7,8,9")
    args = [str(tiny_ckpt), "--tokens-file", str(tok), "--out", str(tmp_path / "x.npy"), "--threads", "1"]
    assert "DSpark" in usage_error(capsys, [*args, "--draft-out", str(tmp_path / "d.npz")])
    assert not (tmp_path / "x.npy").exists()


@pytest.mark.parametrize(("k", "prompt", "chunk"), [(1, 2, 64), (3, 2, 64), (5, 2, 64), (3, 16, 64), (2, 28, 13)])
def test_the_loops_drafts_match_the_reference(k: int, prompt: int, chunk: int) -> None:
    """The drafter as speculative decoding runs it (the taps it is handed cycle by cycle, from
    one-token steps and verification passes, rejections and re-fed tokens included; a prompt
    longer than the taps keep whole, in one pass or in passes of 13) drafts what DeepSeek's code drafts at the
    same position: the main model is made to pick the fixture's tokens, so each cycle's block
    starts with tokens[p + 1] as in the teacher-forced reference, whose first slot it then is
    (later slots follow the drafter's own picks). The fixture's window (8) is shorter than a
    verification pass can be (a block plus one carried tokens, the token, a block of drafts)."""
    from dsv4stream.engine.spec_policy import FixedDrafts
    from dsv4stream.engine.speculate import speculative_generate
    from dsv4stream.engine.speculate_v41 import DSparkDrafter

    o = oracle()
    ids, ref, ref_c = o["token_ids"], o["logits_fp32"], o["confidence_fp32"]
    eng = Engine.open(FIXTURE, v41=V41Options(numerics="fp32"), threads=1)
    drafter = DSparkDrafter(eng)
    assert drafter.window < 2 * (drafter.block + 1) < prompt or prompt < drafter.window
    seen: dict[int, tuple[int, float]] = {}  # p -> the first draft and its raw confidence
    propose = drafter.propose

    def recorded(token: int, n: int):
        drafts, conf = propose(token, n)
        seen[drafter.last] = (drafts[0], conf[0])
        return drafts, conf

    drafter.propose = recorded
    forced = iter(ids[prompt:].tolist())
    session = eng.session(chunk_size=chunk, segment=chunk)
    gen = speculative_generate(
        session, ids[:prompt], ids.size - prompt, lambda lg: next(forced), drafter, FixedDrafts(k)
    )
    assert list(gen) == ids[prompt:].tolist()
    checked = [p for p in seen if p <= int(o["positions"][-1])]
    assert len(checked) >= 6, seen.keys()
    clear = clear_rows(ref, 1e-3)
    cm = max(1.0, np.abs(ref_c).max())
    for p in checked:
        i = p - 1  # positions start at 1
        draft, conf = seen[p]
        assert abs(conf - ref_c[i, 0]) <= 1e-4 * cm, (p, conf, ref_c[i, 0])
        if clear[i, 0]:
            assert draft == int(ref[i, 0].argmax()), p


def test_a_drafter_fed_by_batched_passes_drafts_as_the_reference() -> None:
    """A batching server's request in the batch's passes (`engine.batch.forward_many`, beside
    another sequence): its drafter, fed by the session's `Observer` trace (a prompt segment, then
    one-token rows through the family's joined `attend_rows`), drafts what DeepSeek's code drafts
    at each position, as if it had drafted all along."""
    from dsv4stream.engine.batch import Feed, forward_many
    from dsv4stream.engine.speculate import Observer
    from dsv4stream.engine.speculate_v41 import DSparkDrafter

    o = oracle()
    ids, ref, ref_c = o["token_ids"], o["logits_fp32"], o["confidence_fp32"]
    eng = Engine.open(FIXTURE, v41=V41Options(numerics="fp32"), threads=1)
    ours_, other = eng.session(chunk_size=64), eng.session(chunk_size=64)
    drafter = DSparkDrafter(eng)
    ours_.trace = Observer(ours_, drafter)
    forward_many([Feed(other, ids[:3][::-1].copy())])
    forward_many([Feed(ours_, ids[:12], "last"), Feed(other, ids[3:4])])  # a prompt segment beside a step
    clear = clear_rows(ref, 1e-3)
    cm = max(1.0, np.abs(ref_c).max())
    checked = 0
    for p in range(12, int(o["positions"][-1]) + 1):
        forward_many([Feed(ours_, ids[p : p + 1]), Feed(other, ids[p - 8 : p - 7])])
        assert drafter.last == p
        drafts, conf = drafter.propose(int(ids[p + 1]), 1)
        assert abs(conf[0] - ref_c[p - 1, 0]) <= 1e-4 * cm, (p, conf[0], ref_c[p - 1, 0])
        if clear[p - 1, 0]:
            assert drafts[0] == int(ref[p - 1, 0].argmax()), p
        checked += 1
    assert checked >= 10


def test_tokens_carried_into_a_batched_pass_are_observed_once() -> None:
    """A drafting call handed to the batch after a rejected draft (`engine.speculate.HandOver`):
    the session is back before the tokens it carried, whose taps its drafter saw in the pass that
    kept them, and the batch's next pass feeds them with the next token. The `Observer` takes only
    the new position: the drafter goes on without starting afresh and drafts as the reference."""
    from dsv4stream.engine.batch import Feed, forward_many
    from dsv4stream.engine.speculate import Observer
    from dsv4stream.engine.speculate_v41 import DSparkDrafter

    o = oracle()
    ids, ref_c = o["token_ids"], o["confidence_fp32"]
    eng = Engine.open(FIXTURE, v41=V41Options(numerics="fp32"), threads=1)
    mine, other = eng.session(chunk_size=64), eng.session(chunk_size=64)
    drafter = DSparkDrafter(eng)
    mine.trace = Observer(mine, drafter)
    forward_many([Feed(mine, ids[:12], "last")])
    cm = max(1.0, np.abs(ref_c).max())
    resets: list[int] = []
    reset = drafter.reset
    drafter.reset = lambda: (resets.append(mine.pos), reset())[1]
    for p in (14, 19, 25):
        while mine.pos < p - 1:  # positions up to p - 2
            forward_many([Feed(mine, ids[mine.pos : mine.pos + 1]), Feed(other, ids[:1])])
        snap = mine.snapshot()
        forward_many([Feed(mine, ids[p - 1 : p + 1], "last")])  # a verification pass kept p - 1 and p
        assert drafter.last == p
        mine.restore(snap)  # ... then rejected: the session is back before them
        forward_many([Feed(mine, ids[p - 1 : p + 2], "last"), Feed(other, ids[1:2])])  # carried + next
        assert not resets and drafter.last == p + 1 and mine.pos == p + 2, resets
        _, conf = drafter.propose(int(ids[p + 2]), 1)
        assert abs(conf[0] - ref_c[p, 0]) <= 1e-4 * cm, (p, conf[0], ref_c[p, 0])


def test_a_copied_drafter_goes_on_apart() -> None:
    """`DSparkDrafter.copy` (a server's later choice starts from the first's drafter at the prompt's
    end): the copy drafts as the reference at the position it was copied at, while the original,
    fed a further position, drafts as the reference there; neither sees the other's."""
    from dsv4stream.engine.batch import Feed, forward_many
    from dsv4stream.engine.speculate import Observer
    from dsv4stream.engine.speculate_v41 import DSparkDrafter

    o = oracle()
    ids, ref_c = o["token_ids"], o["confidence_fp32"]
    eng = Engine.open(FIXTURE, v41=V41Options(numerics="fp32"), threads=1)
    s = eng.session(chunk_size=64)
    first = DSparkDrafter(eng)
    s.trace = Observer(s, first)
    forward_many([Feed(s, ids[:12], "last")])
    first.propose(int(ids[12]), 1)  # (its held streams pushed into its windows: a copy after that too)
    second = first.copy()
    forward_many([Feed(s, ids[12:13])])
    assert (first.last, second.last) == (12, 11)
    cm = max(1.0, np.abs(ref_c).max())
    for d, p in ((second, 11), (first, 12), (second, 11)):
        _, conf = d.propose(int(ids[p + 1]), 1)
        assert abs(conf[0] - ref_c[p - 1, 0]) <= 1e-4 * cm, (p, conf[0], ref_c[p - 1, 0])
