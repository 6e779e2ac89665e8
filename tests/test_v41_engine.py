"""DeepSeek-V4.1 through the Engine / Session API on generated checkpoints.

In the official numerics, prefill in segments and sub-chunks stays close to decode one token at a
time (index keys "owner"); the numerics differ and stay close; "as-shipped" keys change decode at
the ratio-2 sources only; the Engram rows are asked for before layer 0 with the hash's ids;
`dsv4 logits` takes the V4.1 options and refuses them on V4. What every family keeps (fp32 prefill
equals steps, snapshot and state files, ...) is in test_engine_invariants.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dsv4stream.cli.logits import logits as logits_cmd
from dsv4stream.engine.session import Engine
from dsv4stream.engine.stack_v41 import V41Options
from dsv4stream.errors import UsageError
from dsv4stream.weights.providers import CatalogEngramRows

T = 48  # past the window (4), index_topk (3) and the candidate pool (3 blocks of 2) of tiny-v41-long


@pytest.fixture(scope="module")
def engine(tiny_v41_long):
    """`engine(numerics, index_keys)`: the checkpoint's engine in those modes, opened once."""
    engines: dict[tuple[str, str], Engine] = {}

    def get(numerics: str = "official", index_keys: str = "owner") -> Engine:
        if (numerics, index_keys) not in engines:
            engines[numerics, index_keys] = Engine.open(tiny_v41_long, v41=V41Options(numerics, index_keys))
        return engines[numerics, index_keys]

    return get


@pytest.fixture(scope="module")
def ids(engine):
    def make(n: int = T, seed: int = 1) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, engine().cfg.vocab_size, n)

    return make


def close(a: np.ndarray, b: np.ndarray, rel: float) -> bool:
    return bool(np.abs(a - b).max() <= rel * np.abs(b).max())


def test_prefill_in_segments_and_chunks_equals_decoding_one_token_at_a_time(engine, ids):
    """The official numerics; in fp32 (float rounding only) this is test_engine_invariants.py's
    test_same_logits_and_ids_at_every_segment_size and test_prefill_equals_decoding_one_token_at_a_time."""
    e, x = engine("official"), ids()
    whole = e.session(chunk_size=64).prefill(x)
    parts = e.session(chunk_size=3, segment=7).prefill(x)
    s = e.session(segment=1)
    steps = np.stack([s.step(int(t)) for t in x])
    # a float rounding that differs with the row count of a product can move an FP8 activation
    # by one grid step, which undamped random weights amplify downstream (DeepSeek's reference
    # differs from itself the same way between its prefill and decode): most positions agree
    for got in (parts, steps):
        err = np.abs(got - whole).max(axis=1) / np.abs(whole).max(axis=1)
        assert np.median(err) <= 2e-2
        assert (np.argmax(got, 1) == np.argmax(whole, 1)).mean() > 0.9


def test_the_numerics_differ_and_stay_close(engine, ids):
    x = ids()
    off = engine("official").session().prefill(x)
    f32 = engine("fp32").session().prefill(x)
    assert not np.array_equal(off, f32)
    # undamped random weights amplify the FP8 activation rounding (tens of percent); how close the
    # official numerics are to DeepSeek's is checked against its own logits in test_v41_oracle.py
    assert np.median(np.abs(off - f32).max(axis=1) / np.abs(f32).max()) < 0.5


def test_as_shipped_keys_change_decode_but_not_prefill(engine, ids):
    x = ids()
    owner, shipped = engine("official", "owner"), engine("official", "as-shipped")
    assert np.array_equal(owner.session().prefill(x), shipped.session().prefill(x))
    so, ss = owner.session(segment=1), shipped.session(segment=1)
    a = np.stack([so.step(int(t)) for t in x])
    b = np.stack([ss.step(int(t)) for t in x])
    differ = np.flatnonzero(np.abs(a - b).max(axis=1) > 0)
    assert differ.size, "as-shipped keys changed nothing"
    # a ratio-2 source emits at odd positions; before the first stale read (position 2) all agree
    assert differ.min() >= 2


class SpyRows(CatalogEngramRows):
    def __init__(self, cat) -> None:
        super().__init__(cat)
        self.calls: list[tuple[str, int, np.ndarray]] = []

    def prefetch(self, layer, row_ids):
        self.calls.append(("prefetch", layer, np.array(row_ids)))

    def rows(self, layer, row_ids):
        self.calls.append(("rows", layer, np.array(row_ids)))
        return super().rows(layer, row_ids)


def test_engram_rows_are_asked_for_before_layer_zero_with_the_hash_ids(engine, ids):
    base = engine()
    spy = SpyRows(base.catalog)
    e = Engine(
        base.cfg, base.trunk, base.experts, base.catalog,
        engram_rows=spy, engram_ids=base.stack.engram_ids, v41=V41Options(),
    )  # fmt: skip
    x = ids(12)
    want = e.stack.engram_ids.rows((), x)[0]
    logits = e.session().prefill(x)
    layers = base.cfg.engram.layer_ids
    kinds = [c[0] for c in spy.calls]
    assert kinds == ["prefetch"] * len(layers) + ["rows"] * len(layers)
    for k, layer in enumerate(layers):
        assert spy.calls[k][1] == layer and np.array_equal(spy.calls[k][2], want[:, k])
    assert np.array_equal(logits, base.session().prefill(x))
    # generate: each picked token's rows are asked for once, before its pass
    spy.calls.clear()
    toks = list(e.session().generate(x[:6], 3))
    assert len(toks) == 3
    assert [c[0] for c in spy.calls].count("prefetch") == len(layers) * 3  # prompt + 2 fed tokens


def test_engram_changes_the_logits(engine, ids):
    """The rows matter: zeroed rows give other logits (the gate and the value are really applied)."""

    class Zero(CatalogEngramRows):
        def rows(self, layer, row_ids):
            return np.zeros_like(super().rows(layer, row_ids))

    base, x = engine(), ids(12)
    e = Engine(
        base.cfg, base.trunk, base.experts, base.catalog,
        engram_rows=Zero(base.catalog), engram_ids=base.stack.engram_ids, v41=V41Options(),
    )  # fmt: skip
    assert not np.allclose(e.session().prefill(x), base.session().prefill(x))


def test_logits_command_takes_the_v41_options_and_refuses_them_on_v4(engine, ids, tiny_v41_long, tmp_path):
    x = ids(10)
    f = tmp_path / "ids.txt"
    f.write_text(",".join(str(int(t)) for t in x))
    run = CliRunner().invoke
    for mode in ("prefill", "step"):
        out = tmp_path / f"{mode}.npy"
        r = run(logits_cmd, [str(tiny_v41_long), "--tokens-file", str(f), "--out", str(out), "--mode", mode,
                             "--numerics", "fp32", "--index-keys", "as-shipped"])  # fmt: skip
        assert r.exit_code == 0, r.output
    a, b = np.load(tmp_path / "prefill.npy"), np.load(tmp_path / "step.npy")
    assert a.shape == (10, engine().cfg.vocab_size) and close(b, a, 1e-2)
    v4 = Path(__file__).parent / "fixtures" / "mixed"
    r = run(logits_cmd, [str(v4), "--tokens", "1,2", "--out", str(tmp_path / "v4.npy"), "--numerics", "official"])
    assert r.exit_code != 0 and isinstance(r.exception, UsageError)
    r = run(logits_cmd, [str(v4), "--tokens", "1,2", "--out", str(tmp_path / "v4.npy"), "--numerics", "fp32"])
    assert r.exit_code == 0, r.output
