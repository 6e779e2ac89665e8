"""Attention's numba kernels (kernels/attn.py): against float64 numpy, and the summation-order
invariants that make token ids independent of threads, chunking and budget.

numpy's BLAS (OpenBLAS 0.3.x on Zen 3) gives other bits with 1 and 2 threads and for another
split of the same product's rows; these tests are what fails when attention goes back to it.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4stream import kernels

attn = pytest.importorskip("dsv4stream.kernels.attn")
fast = pytest.importorskip("dsv4stream.kernels.fast")


def rand(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def attend64(q, keys, key_mask, comp, comp_mask, comp_idx, sink) -> np.ndarray:
    """The definition in float64, one query and head at a time (visible rows listed explicitly)."""
    t, h, hd = q.shape
    out = np.zeros((t, h, hd))
    for i in range(t):
        rows = [keys[j] for j in np.flatnonzero(key_mask[i])]
        if comp_mask is not None:
            rows += [comp[r] for r in np.flatnonzero(comp_mask[i])]
        elif comp_idx is not None:
            rows += [comp[r] for r in comp_idx[i] if r >= 0]
        kv = np.array(rows, np.float64).reshape(-1, hd)
        for j in range(h):
            s = kv @ q[i, j].astype(np.float64) / np.sqrt(hd)
            m = max(s.max(initial=-np.inf), float(sink[j]))
            e = np.exp(s - m)
            out[i, j] = e @ kv / (e.sum() + np.exp(float(sink[j]) - m))
    return out


def case(rng, t, h, hd, s, n, k, dense=False):
    q, keys, comp, sink = rand(rng, t, h, hd), rand(rng, s, hd), rand(rng, n, hd), rand(rng, h)
    mask = rng.random((t, s)) < 0.7
    mask[:, 0] = True
    if dense:
        return q, keys, mask, comp, rng.random((t, n)) < 0.5, None, sink
    idx = np.stack([rng.permutation(n)[:k] for _ in range(t)])
    idx[:, -1] = -1  # fewer rows than K for every query
    return q, keys, mask, comp, None, idx, sink


@pytest.mark.parametrize(
    ("t", "h", "hd", "s", "n", "k"),
    [(1, 64, 512, 128, 700, 512), (3, 5, 40, 7, 9, 4), (4, 17, 13, 6, 10, 3), (2, 16, 8, 1, 1, 1)],
)
@pytest.mark.parametrize("mode", ["indexed", "dense", "window"])
def test_attend_against_float64(t, h, hd, s, n, k, mode) -> None:
    """Heads and head_dim off the tiles (5, 17 heads; 13, 40 dims), masked keys, -1 indices."""
    rng = np.random.default_rng(t * 1000 + h * 10 + hd)
    q, keys, mask, comp, cmask, idx, sink = case(rng, t, h, hd, s, n, k, dense=mode == "dense")
    if mode == "window":
        comp = idx = None
    got = attn.attend(q, keys, mask, comp, cmask, idx, sink)
    want = attend64(q, keys, mask, comp, cmask, idx, sink)
    assert got.dtype == np.float32 and got.shape == (t, h, hd)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


def test_a_query_that_sees_nothing_but_the_sink_gets_zeros() -> None:
    rng = np.random.default_rng(3)
    q, keys, sink = rand(rng, 2, 4, 16), rand(rng, 3, 16), rand(rng, 4)
    mask = np.array([[False] * 3, [True] * 3])
    out = attn.attend(q, keys, mask, None, None, None, sink)
    assert not out[0].any() and out[1].any()


def test_a_nan_score_makes_its_head_nan() -> None:
    """A NaN in the keys must reach the output (the session then reports non-finite values)."""
    rng = np.random.default_rng(4)
    q, keys, sink = rand(rng, 1, 4, 16), rand(rng, 3, 16), rand(rng, 4)
    keys[1, 5] = np.nan
    out = attn.attend(q, keys, np.ones((1, 3), bool), None, None, None, sink)
    assert np.isnan(out).all()


@pytest.mark.parametrize("t", [1, 64])
@pytest.mark.parametrize("dense", [False, True])
def test_attention_has_the_same_bits_on_one_and_two_threads(t, dense, monkeypatch) -> None:
    """V4-Flash's 64 heads x 512, a window of 128 and 512 indexed rows (or dense rows): the
    parallel kernel on 1 and on 2 threads, and the serial kernel."""
    rng = np.random.default_rng(5)
    args = case(rng, t, 64, 512, 128 + t - 1, 600, 512, dense=dense)
    monkeypatch.setattr(attn, "PARALLEL_MIN_MACS", 0)
    keep = fast.get_threads()
    try:
        fast.set_threads(2)
        two = attn.attend(*args)
        fast.set_threads(1)  # the serial kernel: set_threads(1) skips the parallel region
        one = attn.attend(*args)
    finally:
        fast.set_threads(keep)
    monkeypatch.setattr(attn, "PARALLEL_MIN_MACS", 1 << 62)
    serial = attn.attend(*args)
    assert two.tobytes() == one.tobytes() == serial.tobytes()


@pytest.mark.parametrize("dense", [False, True])
def test_a_query_gets_the_same_bits_alone_or_among_others(dense) -> None:
    """How the queries are split into calls (sub-chunks, segments: the budget decides them) must
    not change any query's result."""
    rng = np.random.default_rng(6)
    q, keys, mask, comp, cmask, idx, sink = case(rng, 24, 64, 512, 150, 300, 128, dense=dense)
    whole = attn.attend(q, keys, mask, comp, cmask, idx, sink)
    for a, b in ((0, 1), (5, 6), (3, 20), (23, 24)):
        part = attn.attend(
            q[a:b],
            keys,
            mask[a:b],
            comp,
            None if cmask is None else cmask[a:b],
            None if idx is None else idx[a:b],
            sink,
        )
        assert part.tobytes() == whole[a:b].tobytes()


def test_masked_keys_do_not_change_the_bits() -> None:
    """A step sees only the window; a chunk's query also sees later keys, masked. The visible rows
    in the same order must give the same bits either way."""
    rng = np.random.default_rng(7)
    q, keys, comp, sink = rand(rng, 1, 16, 64), rand(rng, 9, 64), rand(rng, 5, 64), rand(rng, 16)
    idx = np.array([[4, 0, 2]])
    few = attn.attend(q, keys[:6], np.ones((1, 6), bool), comp, None, idx, sink)
    mask = np.ones((1, 9), bool)
    mask[0, 6:] = False
    more = attn.attend(q, keys, mask, comp, None, idx, sink)
    assert few.tobytes() == more.tobytes()


def index64(q, w, keys) -> np.ndarray:
    s = np.einsum("thc,nc->thn", q.astype(np.float64), keys.astype(np.float64))
    return np.einsum("thn,th->tn", np.maximum(s, 0) / np.sqrt(q.shape[2]), w.astype(np.float64))


@pytest.mark.parametrize(("t", "h", "c", "n"), [(1, 64, 128, 1000), (5, 3, 20, 7), (3, 17, 128, 65)])
def test_index_scores_against_float64(t, h, c, n) -> None:
    rng = np.random.default_rng(t + h + c + n)
    q, w, keys = rand(rng, t, h, c), rand(rng, t, h), rand(rng, n, c)
    got, want = attn.index_scores(q, w, keys), index64(q, w, keys)
    assert got.shape == (t, n)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


def test_index_scores_do_not_depend_on_threads_queries_or_rows(monkeypatch) -> None:
    """V4-Flash's indexer (64 heads x 128) over 1,000 rows: 1 and 2 threads, serial, one query
    alone, a slice of the rows alone."""
    rng = np.random.default_rng(8)
    q, w, keys = rand(rng, 16, 64, 128), rand(rng, 16, 64), rand(rng, 1000, 128)
    monkeypatch.setattr(attn, "PARALLEL_MIN_MACS", 0)
    keep = fast.get_threads()
    try:
        fast.set_threads(2)
        two = attn.index_scores(q, w, keys)
        fast.set_threads(1)
        one = attn.index_scores(q, w, keys)
    finally:
        fast.set_threads(keep)
    monkeypatch.setattr(attn, "PARALLEL_MIN_MACS", 1 << 62)
    assert two.tobytes() == one.tobytes() == attn.index_scores(q, w, keys).tobytes()
    assert attn.index_scores(q[3:4], w[3:4], keys).tobytes() == two[3:4].tobytes()
    assert attn.index_scores(q, w, keys[70:333]).tobytes() == two[:, 70:333].tobytes()


def test_the_dispatch_uses_the_numba_kernels_with_the_fast_backend(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(attn, "attend", lambda *a: calls.append("attend"))
    monkeypatch.setattr(attn, "index_scores", lambda *a: calls.append("index"))
    kernels.set_backend("fast")
    kernels.attend(None, None, None, None, None, None, None)
    kernels.index_scores(None, None, None)
    assert calls == ["attend", "index"]


def test_head_dims_past_the_accumulators_are_refused() -> None:
    q = np.zeros((1, 1, attn.MAX_HD + 8), np.float32)
    with pytest.raises(ValueError, match="head_dim"):
        attn.attend(q, q[0], np.ones((1, 1), bool), None, None, None, np.zeros(1, np.float32))
