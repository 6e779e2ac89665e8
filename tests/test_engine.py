"""Engine / Session API on the V4 fixture `mixed`: one forward pass per generated token, the hash
layers' experts asked for once, a store adapter, `dsv4 logits`. The invariants every family keeps
(calls continue the sequence, routing hooks, bad tokens, thread counts) are in
test_engine_invariants.py."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dsv4stream.checkpoint.tensors import expert_prefix
from dsv4stream.cli.logits import logits as logits_cmd
from dsv4stream.engine.session import Engine
from dsv4stream.errors import UsageError
from dsv4stream.streaming.experts import StreamedExperts

FIXTURES = Path(__file__).parent / "fixtures"
MIXED = FIXTURES / "mixed"
IDS = np.random.default_rng(7).integers(0, 256, 40)


@cache
def engine(path: Path = MIXED) -> Engine:
    return Engine.open(path)


@cache
def reference_logits() -> np.ndarray:
    return engine().session(chunk_size=64).prefill(IDS)


class Counted:
    """A provider that counts: every call is passed on; embed calls are forward passes and
    prefetch calls are recorded with their keys."""

    def __init__(self, inner, log: dict) -> None:
        self._inner, self._log = inner, log

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def embed(self, ids):
        self._log["passes"] += 1
        return self._inner.embed(ids)

    def prefetch(self, keys):
        self._log["prefetch"].append(list(keys))
        return self._inner.prefetch(keys)


def test_generate_runs_one_forward_pass_per_token_and_prefetches_hash_layers_once() -> None:
    """n tokens cost the prefill and n - 1 steps (the last token is yielded, never fed), and
    each forward pass asks for its hash layers' experts exactly once."""
    base = engine()
    cfg = base.cfg
    log = {"passes": 0, "prefetch": []}
    eng = Engine(cfg, Counted(base.trunk, log), Counted(base.experts, log), base.catalog)

    def hash_keys(ids) -> list:
        return [(i, int(e)) for i in range(cfg.num_hash_layers) for e in np.unique(base.trunk.tid2eid(i)[ids])]

    s = eng.session()
    toks = list(s.generate(IDS[:10], 5))
    assert log["passes"] == 5 and s.pos == 10 + 4 and s.stop_reason == "gen_limit"
    hashed = [k for k in log["prefetch"] if k[0][0] < cfg.num_hash_layers]
    assert hashed == [hash_keys(IDS[:10])] + [hash_keys([t]) for t in toks[:-1]]
    # the same ids as prefill + step by hand (test_engine_invariants.py::test_last_only_and_generate), and stops
    s = eng.session()
    assert list(s.generate(IDS[:10], 9, stop_ids={toks[2]})) == toks[:3]
    assert (s.stop_reason, s.pos) == ("eos", 12)
    s = eng.session()
    assert list(s.generate(IDS[:10], 9, max_pos=12)) == toks[:3]
    assert (s.stop_reason, s.pos) == ("context_full", 12)


class FakeStore:
    """Model-agnostic store: key -> (w1.weight, w1.scale, w2.weight, w2.scale, w3.weight, w3.scale)."""

    def __init__(self, cat, raw_scales: bool) -> None:
        self.cat, self.raw = cat, raw_scales
        self.prefetched: list = []

    def get(self, key):
        layer, expert = key
        p = expert_prefix(self.cat.config, layer, expert)
        out = []
        for w in ("w1", "w2", "w3"):
            out.append(self.cat.read(p + w + ".weight"))
            sc = self.cat.read(p + w + ".scale")
            out.append(sc.view(np.uint8).ravel() if self.raw else sc)
        return tuple(out)

    def prefetch(self, keys) -> None:
        self.prefetched.append(list(keys))

    def release(self, key) -> None:
        pass


@pytest.mark.parametrize("fixture,raw", [("mixed", False), ("f32scales", True)])
def test_store_adapter_gives_the_same_logits(fixture: str, raw: bool) -> None:
    path = FIXTURES / fixture
    cat = engine(path).catalog
    store = FakeStore(cat, raw)
    eng = Engine.open(path, experts=StreamedExperts(store, cat.config))
    ids = IDS[:12]
    np.testing.assert_array_equal(eng.session().prefill(ids), engine(path).session().prefill(ids))
    n_hash = min(cat.config.num_hash_layers, cat.config.n_layers)
    first = store.prefetched[0]
    assert {layer for layer, _ in first} == set(range(n_hash))  # hash-layer experts asked for up front


@pytest.mark.parametrize("mode", ["prefill", "step", "chunk:7"])
def test_logits_command(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "logits.bin"
    ids = ",".join(str(int(t)) for t in IDS)
    r = CliRunner().invoke(logits_cmd, [str(MIXED), "--tokens", ids, "--out", str(out), "--mode", mode])
    assert r.exit_code == 0, r.output
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (len(IDS), 256)
    np.testing.assert_allclose(got, reference_logits(), atol=1e-5 * np.abs(got).max())


def test_logits_command_tokens_file_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "ids.npy"
    np.save(f, IDS[:5])
    out = tmp_path / "o.npy"
    r = CliRunner().invoke(logits_cmd, [str(MIXED), "--tokens-file", str(f), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert np.load(out).shape == (5, 256)
    for args, msg in (
        (["--tokens", "1,2", "--mode", "chunk:0"], "chunk:N"),
        (["--tokens", "1,x"], "not an integer"),
        ([], "exactly one of"),
    ):
        r = CliRunner().invoke(logits_cmd, [str(MIXED), "--out", str(out), *args])
        assert isinstance(r.exception, UsageError) and msg in str(r.exception)
