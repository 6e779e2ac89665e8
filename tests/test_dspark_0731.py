"""V4-Flash-0731's DSpark drafter (issue 41): its tensors read at their shapes, its block checked
against V4's own block code, and speculation with it giving the same ids as without drafts.

On the 0731-layout fixture (tests/fixtures/dspark0731: 3 layers, three DSpark stages of 8 experts
top-2, block 5, window 16). No DeepSeek code for this drafter is in the repository: the block of
one token is compared with V4's production `attention_half` / `ffn_half` / `hc_head` (checked
against DeepSeek's V4 reference by tests/test_forward_oracle.py), whose window holds keys V4's own
`attention` computed from main_x, and with taps taken from the "hidden" trace (the streams after
the layer before), not the "input" trace the drafter uses. A V4.1-style block (collapse with the
FFN's pre, one sublayer ahead) or another tap point fails it.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.checkpoint.tensors import is_drafter
from dsv4stream.engine.dspark_v41 import expert_source
from dsv4stream.engine.session import Engine
from dsv4stream.engine.spec_draws import PositionUniforms
from dsv4stream.engine.spec_policy import AutoDrafts, FixedDrafts
from dsv4stream.engine.speculate import speculative_generate
from dsv4stream.engine.speculate_v41 import DSparkDrafter, drafter_for, speculative_greedy
from dsv4stream.kernels import matmul
from dsv4stream.model.mhc import hc_head
from dsv4stream.model.ops import rms_norm
from dsv4stream.model.v4.attention import attention, new_attn_state
from dsv4stream.model.v4.block import attention_half, ffn_half
from dsv4stream.model.v4.dspark import draft, new_state, observe
from dsv4stream.run import planner
from dsv4stream.run.memory import measure
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.text.sampler import SamplingParams, make_pick
from dsv4stream.weights.loading_dspark_0731 import load_dspark_0731

FIXTURE = Path(__file__).parent / "fixtures" / "dspark0731"
N = 16


@cache
def engine() -> Engine:
    return Engine.open(FIXTURE, threads=1)


@cache
def ids() -> np.ndarray:
    with np.load(FIXTURE / "oracle.npz") as z:
        return z["token_ids"][:12].astype(np.int64)


@cache
def off() -> list[int]:
    return list(engine().session(chunk_size=64).generate(ids()[:8], N))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_off(k: int) -> None:
    got, st = speculative_greedy(engine(), ids()[:8], N, k)
    assert got == off()
    assert st.drafted > 0 and st.verify_passes >= 1 and st.verified_tokens == st.drafted + st.verify_passes


def test_auto_equals_off_and_stops_drafting_what_is_rejected() -> None:
    """Random weights accept (almost) nothing: `auto` equals off and drafts less than one per token."""
    got, st = speculative_greedy(engine(), ids()[:8], N, 5, policy=AutoDrafts(5))
    assert got == off()
    assert st.drafted < N - 1


def sampled(k: int | None, seed: int) -> list[int]:
    """Temperature-1 ids with drafts (k; the 0731 drafter) or without (None), the same position uniforms."""
    eng = engine()
    u = PositionUniforms(seed)
    pick = make_pick(SamplingParams(temperature=1.0, top_k=8), eng.cfg.vocab_size, u)
    s = eng.session(chunk_size=64)
    if k is None:
        return list(s.generate(ids()[:8], N, lambda lg: (u.at(s.pos), pick(lg))[1]))
    return list(speculative_generate(s, ids()[:8], N, pick, DSparkDrafter(eng), FixedDrafts(k), uniforms=u))


@pytest.mark.parametrize("seed", [1, 2])
def test_sampled_same_ids_for_a_seed(seed: int) -> None:
    want = sampled(None, seed)
    assert sampled(1, seed) == want and sampled(3, seed) == want


class Recording:
    """A TensorSource that notes what is read."""

    def __init__(self, cat: Catalog) -> None:
        self.cat, self.config, self.read_names = cat, cat.config, set()

    def _note(self, name: str) -> None:
        self.read_names.update(n for n in self.cat.entries if n == name or n.startswith(name + "."))

    def f32(self, name: str):
        self._note(name)
        return self.cat.f32(name)

    def qweight(self, prefix: str):
        self._note(prefix)
        return self.cat.qweight(prefix)

    def read(self, name: str):
        self._note(name)
        return self.cat.read(name)


def test_every_drafter_tensor_is_read_at_its_shape() -> None:
    cat = Catalog.open(FIXTURE)
    src = Recording(cat)
    w = load_dspark_0731(src)
    want = {n for n in cat.entries if is_drafter(n) and ".ffn.experts." not in n}
    assert want - src.read_names == set()
    cfg = cat.config
    d, r, v = cfg.hidden_size, cfg.dspark.markov_rank, cfg.vocab_size
    assert len(w.stages) == 3 and [s.index for s in w.stages] == [3, 4, 5]
    assert (w.main_proj.rows, w.main_proj.cols) == (d, 3 * d)
    assert w.markov_embed.shape == (v, r) and (w.markov_head.rows, w.markov_head.cols) == (v, r)
    assert w.confidence.shape == (d + r,) and w.norm.shape == (d,) and w.hc_head.base.shape == (cfg.hc_mult,)


def test_one_token_block_is_v4s_block_over_the_window() -> None:
    eng = engine()
    cfg, m = eng.cfg, drafter_for(eng)
    p, w = replace(m.params, block_size=1), m.weights
    tokens = ids()[:10]
    hidden: dict[int, np.ndarray] = {}
    inputs: dict[int, np.ndarray] = {}

    def trace(what: str, layer: int, x: np.ndarray) -> None:
        if what in ("hidden", "input"):
            (hidden if what == "hidden" else inputs)[layer] = x.mean(axis=1, dtype=np.float32)

    eng.session(chunk_size=64, trace=trace).prefill(tokens)
    assert sorted(inputs) == [0, 1, 2]
    # taps from the embedding and the layers before, not the drafter's "input" trace
    independent = [eng.trunk.embed(tokens), hidden[0], hidden[1]]
    taps = np.concatenate([inputs[t] for t in p.targets], axis=1)
    np.testing.assert_allclose(taps, np.concatenate(independent, axis=1), rtol=0, atol=1e-6)

    pos = np.arange(tokens.size, dtype=np.int64)
    st = new_state(p, len(w.stages))
    observe(st, taps, pos, w, p, eng.stack.rope_main)
    nxt = int(ids()[10])
    got = draft(st, nxt, w, p, eng.trunk.embed, eng.stack.head_weights().head,
                lambda layer: expert_source(eng.experts, layer), eng.stack.rope_main)  # fmt: skip

    # V4's block code: the window filled by V4's attention run over main_x, then the token at p + 1
    mx = rms_norm(matmul(w.main_proj, np.concatenate(independent, axis=1)), w.main_norm, cfg.rms_norm_eps)
    x = np.repeat(eng.trunk.embed(np.array([nxt]))[:, None, :], cfg.hc_mult, axis=1)
    for k, stage in enumerate(w.stages):
        s = new_attn_state(cfg, stage.index)
        attention(mx, pos, stage.attn, s, cfg, eng.stack.rope_main)
        x = attention_half(x, np.array([tokens.size]), stage, s, cfg, eng.stack.rope_main)
        x = ffn_half(x, np.array([nxt]), stage, cfg, expert_source(eng.experts, cfg.n_layers + k))
    h = hc_head(x, w.hc_head, cfg.hc_eps, cfg.rms_norm_eps)
    logits = matmul(eng.stack.head_weights().head, rms_norm(h, w.norm, cfg.rms_norm_eps))
    scale = np.abs(logits).max()
    assert np.abs(got.hidden - h).max() <= 1e-5 * np.abs(h).max()
    assert np.abs(got.logits - logits).max() <= 1e-5 * scale


def test_draft_out_is_what_speculation_drafts(tmp_path) -> None:
    """`dsv4 logits --draft-out` on 0731: the arrays' shapes, step mode equal to prefill, and slot 0 at
    position p equal to what the speculative loop's drafter gives after the main model read ids[:p+1]."""
    from click.testing import CliRunner

    from dsv4stream.cli.logits import logits as logits_cmd

    tokens = ids()
    (tmp_path / "ids.txt").write_text(",".join(map(str, tokens)))
    got = {}
    for mode in ("prefill", "step"):
        args = [str(FIXTURE), "--tokens-file", str(tmp_path / "ids.txt"), "--out", str(tmp_path / f"{mode}.npy"),
                "--mode", mode, "--threads", "1", "--draft-out", str(tmp_path / f"{mode}.npz")]  # fmt: skip
        r = CliRunner().invoke(logits_cmd, args)
        assert r.exit_code == 0, r.output
        with np.load(tmp_path / f"{mode}.npz") as z:
            got[mode] = {k: z[k] for k in z.files}
    d = got["prefill"]
    assert d["positions"].tolist() == list(range(1, tokens.size - 5))
    assert d["logits"].shape == (tokens.size - 6, 5, 256) and d["confidence"].shape == (tokens.size - 6, 5)
    scale = np.abs(d["logits"]).max()
    assert np.abs(got["step"]["logits"] - d["logits"]).max() <= 1e-5 * scale

    eng, p = engine(), 4
    s = eng.session(chunk_size=64)
    drafter = DSparkDrafter(eng)
    taps: list[np.ndarray] = []
    s.trace = lambda what, layer, x: taps.append(x.copy()) if what == "input" else None
    s.prefill(tokens[: p + 1])
    drafter.observe(taps, np.arange(p + 1))  # per layer (T, hc, D): the streams as they are
    first = drafter.run(int(tokens[p + 1]), 1)
    row = first.logits[0] + matmul(drafter.weights.markov_head, drafter.weights.markov_embed[[int(tokens[p + 1])]])[0]
    assert np.abs(row - d["logits"][p - 1, 0]).max() <= 1e-5 * scale


def budgets() -> dict[str, int]:
    n = measure(FIXTURE, RunOptions(budget=1))
    ws = Catalog.open(FIXTURE).config.working_set_experts
    return {"resident": planner.budget_for(n, n.total_experts), "streaming": planner.budget_for(n, 2 * ws)}


@pytest.mark.parametrize("where", ["resident", "streaming"])
def test_runtime_ids_equal_off_with_the_drafter_planned(where: str) -> None:
    n_off = measure(FIXTURE, RunOptions(budget=1, speculate="off"))
    n_on = measure(FIXTURE, RunOptions(budget=1))
    assert n_off.drafter_bytes == 0 and n_on.drafter_bytes > 0
    assert n_on.total_experts - n_off.total_experts == 3 * 8  # the stages' experts share the slots
    with Runtime.open(FIXTURE, RunOptions(budget=budgets()[where], threads=1)) as rt:
        assert any("drafter: DSpark dense weights" in line for line in rt.plan.lines())
        want = list(rt.generate(rt.session(), ids()[:8].tolist(), N, speculate="off"))
        for setting in (1, 3, "auto"):
            assert list(rt.generate(rt.session(), ids()[:8].tolist(), N, speculate=setting)) == want, setting
        spec = rt.stats().phases.speculation
        assert spec is not None and spec.drafted > 0


def test_a_drafter_fed_by_batched_passes_drafts_as_one_fed_alone() -> None:
    """A batching server's request in the batch's one-token passes beside another sequence (V4's
    joined `attend_rows`): its drafter, fed by the session's `Observer` trace, proposes what a
    drafter given the taps of the session's own prefill proposes, at every position (equal up to
    the rounding between a prefill and steps)."""
    from dsv4stream.engine.batch import Feed, forward_many
    from dsv4stream.engine.speculate import Observer

    eng, t = engine(), ids()
    mine, other = eng.session(chunk_size=64), eng.session(chunk_size=64)
    fed = DSparkDrafter(eng)
    mine.trace = Observer(mine, fed)
    forward_many([Feed(mine, t[:3], "last")])
    for p in range(3, t.size - 1):
        forward_many([Feed(mine, t[p : p + 1]), Feed(other, t[p - 3 : p - 2])])
        want = DSparkDrafter(eng)
        s = eng.session(chunk_size=64)
        taps: dict[int, np.ndarray] = {}
        s.trace = lambda what, layer, x, taps=taps: taps.setdefault(layer, x.copy()) if what == "input" else None
        s.prefill(t[: p + 1])
        want.observe([taps[k] for k in want.targets], np.arange(p + 1))
        a, b = fed.propose(int(t[p + 1]), 3), want.propose(int(t[p + 1]), 3)
        assert a[0] == b[0], p
        assert np.allclose(a[1], b[1], rtol=1e-4, atol=1e-4), (p, a[1], b[1])
