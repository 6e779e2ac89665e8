"""Engine / Session API: state carried across calls, providers, routing hooks, determinism, `dsv4 logits`."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_calls_continue_the_sequence() -> None:
    s = engine().session(chunk_size=6)
    a = s.prefill(IDS[:17])
    b = np.stack([s.step(int(t)) for t in IDS[17:25]])
    c = s.prefill(IDS[25:])
    assert s.pos == len(IDS)
    np.testing.assert_allclose(np.concatenate([a, b, c]), reference_logits(), rtol=0, atol=1e-5 * np.abs(a).max())


def test_last_only_and_generate() -> None:
    s = engine().session()
    last = s.prefill(IDS, last_only=True)
    np.testing.assert_allclose(last, reference_logits()[-1], atol=1e-6)
    g = engine().session()
    toks = list(g.generate(IDS[:10], 4))
    s = engine().session()
    logits = s.prefill(IDS[:10])[-1]
    for t in toks:
        assert t == int(np.argmax(logits))
        logits = s.step(t)


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
    # the same ids as prefill + step by hand (test_last_only_and_generate), and stops
    s = eng.session()
    assert list(s.generate(IDS[:10], 9, stop_ids={toks[2]})) == toks[:3]
    assert (s.stop_reason, s.pos) == ("eos", 12)
    s = eng.session()
    assert list(s.generate(IDS[:10], 9, max_pos=12)) == toks[:3]
    assert (s.stop_reason, s.pos) == ("context_full", 12)


def test_bad_tokens_are_refused() -> None:
    s = engine().session()
    with pytest.raises(UsageError, match="outside the vocabulary"):
        s.prefill([1, 2, 256])
    with pytest.raises(UsageError):
        s.prefill([])
    assert s.pos == 0


def test_routing_hooks_and_request_log() -> None:
    seen = []
    s = engine().session(
        chunk_size=4, segment=8, record_requests=True, on_route=lambda l, p, e: seen.append((l, p.copy(), e.copy()))
    )
    s.prefill(IDS[:16])
    cfg = engine().cfg
    assert [l for l, _, _ in seen] == [i for _ in range(2) for i in range(cfg.n_layers)]
    want = []
    for layer, pos, experts in seen:
        assert experts.shape == (len(pos), cfg.num_experts_per_tok)
        want += [(layer, int(e)) for e in np.unique(experts)]
    assert s.requests == want  # each expert once per layer per segment, ascending


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


def test_same_logits_whatever_the_thread_count() -> None:
    code = (
        "import sys, hashlib, numpy as np; from dsv4stream.engine.session import Engine; "
        f"e = Engine.open({str(MIXED)!r}, threads=int(sys.argv[1])); "
        f"print(hashlib.sha256(e.session(chunk_size=16).prefill(np.arange(0, 200, 7)).tobytes()).hexdigest())"
    )
    out = []
    for n in ("1", "2"):
        env = dict(os.environ, OPENBLAS_NUM_THREADS=n, OMP_NUM_THREADS=n, NUMBA_NUM_THREADS=n)
        r = subprocess.run([sys.executable, "-c", code, n], env=env, capture_output=True, text=True, check=True)
        out.append(r.stdout.strip())
    assert out[0] == out[1]


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
