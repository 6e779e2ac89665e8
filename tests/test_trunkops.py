"""`kernels.trunkops`, the trunk's small steps in numba, against the numpy code they replace: the same
bits on every input (NaN positions equal, every other value bit for bit), signed zeros, infinities,
NaN and overflowing exps included; the model's calls going through them under the fast backend
only; and whole passes of both families equal with them on and off."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4stream import kernels
from dsv4stream.kernels import trunkops
from dsv4stream.model import mhc, ops, rope
from dsv4stream.model.mhc import HcWeights
from dsv4stream.model.v41 import block as v41_block

F32 = np.float32
RNG = np.random.default_rng(44)


def same(got: np.ndarray, want: np.ndarray) -> None:
    """Equal shapes, NaN where want has NaN, every other element bit for bit (signed zeros too)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype == F32 and got.shape == want.shape
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), "NaN in other places"
    g, w = got[~nan].view(np.int32), want[~nan].view(np.int32)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, f"{bad.size} of {g.size} differ, first {got[~nan][bad[0]]!r} vs {want[~nan][bad[0]]!r}"


def edgy(shape, scale: float = 1.0, specials: bool = True) -> np.ndarray:
    """Random float32 of `shape` with a sprinkle of 0, -0, subnormals, huge values, inf and NaN."""
    x = (RNG.standard_normal(shape) * scale).astype(F32)
    if specials and x.size > 8:
        flat = x.reshape(-1)
        picks = RNG.choice(flat.size, size=8, replace=False)
        flat[picks] = np.array([0.0, -0.0, 1e-40, -3e-39, 3e38, -np.inf, np.inf, np.nan], F32)
    return x


WIDTHS = [1, 2, 7, 8, 9, 15, 16, 17, 127, 128, 129, 136, 255, 256, 257, 384, 512, 1000, 1024, 4096, 7168, 16384, 20001]


@pytest.mark.parametrize("n", WIDTHS)
def test_rms_norm_has_numpys_bits(n) -> None:
    for t in (1, 3):
        x = edgy((t, n), scale=RNG.uniform(1e-3, 1e3), specials=False)
        w = edgy((n,), specials=False)
        for eps in (1e-6, 0.5):  # a large eps: a dropped eps shows on every row
            same(trunkops.rms_norm(x, None, eps), ops.rms_norm_numpy(x, None, eps))
            same(trunkops.rms_norm(x, w, eps), ops.rms_norm_numpy(x, w, eps))
            same(trunkops.inv_rms(x, eps), v41_block.inv_rms_numpy(x, eps))


def test_rms_norm_edges_heads_and_overflow() -> None:
    x = edgy((4, 64, 512))
    x[1] = 0.0  # an all-zero row: 0 * (1 / sqrt(eps))
    x[2, 3] = -0.0
    x[3, 5] = 3e20  # its square overflows to inf: the row becomes 0 and NaN
    for w in (None, edgy((512,), specials=False)):
        same(trunkops.rms_norm(x, w, 1e-6), ops.rms_norm_numpy(x, w, 1e-6))
    same(trunkops.inv_rms(x.reshape(4, -1), 1e-6), v41_block.inv_rms_numpy(x.reshape(4, -1), 1e-6))


def _hc_weights(hc: int, scale: float = 1.0) -> HcWeights:
    mix = (2 + hc) * hc
    return HcWeights(
        fn=None, base=edgy((mix,), 2.0, specials=False), scale=RNG.uniform(0.1, 2.0, 3).astype(F32) * F32(scale)
    )


@pytest.mark.parametrize("hc", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_split_mixes_has_numpys_bits(hc, iters) -> None:
    for t in (1, 2, 5):
        w = _hc_weights(hc)
        mixes = edgy((t, (2 + hc) * hc), 4.0, specials=False)
        for hc_eps in (1e-6, 0.25):
            got = trunkops.split_mixes(mixes, w.scale, w.base, hc, iters, hc_eps)
            want = mhc.split_mixes_numpy(mixes, w, iters, hc_eps)
            for g, wt in zip(got, want, strict=True):
                same(g, wt)


def test_split_mixes_with_nan_overflow_and_saturated_gates() -> None:
    hc = 4
    w = _hc_weights(hc, scale=60.0)  # logits of hundreds: exps under- and overflow, sigmoids saturate
    mixes = edgy((6, (2 + hc) * hc), 3.0, specials=False)
    mixes[1, 0] = np.nan  # a pre gate
    mixes[2, hc + 1] = np.inf  # a post gate
    mixes[3, 2 * hc + 5] = np.nan  # a comb logit: its row and the Sinkhorn spread NaN
    mixes[4, 2 * hc :] = -np.inf
    mixes[5, :] = -0.0
    got = trunkops.split_mixes(mixes, w.scale, w.base, hc, 20, 1e-6)
    with np.errstate(all="ignore"):
        want = mhc.split_mixes_numpy(mixes, w, 20, 1e-6)
    for g, wt in zip(got, want, strict=True):
        same(g, wt)


@pytest.mark.parametrize("hc", [2, 4, 5])
def test_collapse_and_hc_post_have_numpys_bits(hc) -> None:
    for t, d in ((1, 4096), (3, 136), (2, 7)):
        x = edgy((t, hc, d))
        pre = RNG.uniform(-1, 1, (t, hc)).astype(F32)
        pre[0, 0] = -0.0
        norm = edgy((d,), specials=False)
        same(trunkops.collapse(x, pre), mhc.collapse_numpy(x, pre))
        with np.errstate(all="ignore"):
            same(trunkops.collapse(x, pre, norm, 0.5), ops.rms_norm_numpy(mhc.collapse_numpy(x, pre), norm, 0.5))
        y = edgy((t, d))
        post = RNG.uniform(0, 2, (t, hc)).astype(F32)
        comb = RNG.uniform(0, 1, (t, hc, hc)).astype(F32)
        comb[0, 1, 0] = 0.0
        with np.errstate(all="ignore"):
            same(trunkops.hc_post(x, y, post, comb), mhc.hc_post_numpy(x, y, post, comb))


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_has_numpys_bits(inverse) -> None:
    for shape, half in (((3, 64, 512), 32), ((2, 128), 32), ((1, 8, 16), 8), ((2, 4, 64), 32)):
        x = edgy(shape)
        ang = RNG.uniform(0, 100, (shape[0], half))
        cos, sin = np.cos(ang).astype(F32), np.sin(ang).astype(F32)
        want = rope.apply_rope_numpy(x.copy(), cos, sin, inverse=inverse, in_place=True)
        got = x.copy()
        assert trunkops.rope(got, cos, sin, inverse) is got  # in place
        same(got, want)


def test_the_model_calls_them_under_the_fast_backend_only(monkeypatch) -> None:
    """ops.rms_norm, mhc's split / collapse / hc_post and rope go through trunkops under the fast
    backend (a trunkops function that raises is reached), and never under the reference backend or
    with `set_fused(False)`."""
    x = edgy((1, 4, 64), specials=False)
    pre = RNG.uniform(0, 1, (1, 4)).astype(F32)
    comb = RNG.uniform(0, 1, (1, 4, 4)).astype(F32)
    w = _hc_weights(4)
    cos = sin = np.ones((1, 8), F32)
    calls = [
        ("rms_norm", lambda: ops.rms_norm(x, None, 1e-6)),
        ("collapse", lambda: mhc.collapse(x, pre)),
        ("hc_post", lambda: mhc.hc_post(x, x[:, 0], pre, comb)),
        ("split_mixes", lambda: mhc.split_mixes(edgy((1, 24), specials=False), w, 3, 1e-6)),
        ("rope", lambda: rope.apply_rope(x.copy(), cos, sin, in_place=True)),
        ("inv_rms", lambda: v41_block.inv_rms(x.reshape(1, -1), 1e-6)),
    ]

    def boom(*a, **k):
        raise RuntimeError("trunkops reached")

    assert kernels.backend_name() == "fast"
    for name, call in calls:
        monkeypatch.setattr(trunkops, name, boom)
        with pytest.raises(RuntimeError, match="trunkops reached"):
            call()
        try:
            ops.set_fused(False)
            call()
        finally:
            ops.set_fused(True)
        kernels.set_backend("reference")
        try:
            call()
        finally:
            kernels.set_backend("fast")


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_passes_are_the_same_with_the_numba_steps_on_and_off(family, numerics) -> None:
    """A prefill in two segments and decode steps, every logit bit equal with trunkops and with the
    numpy steps (both families; the attention's sub-chunks and the mHC on several rows too)."""
    engine = family.engine(numerics)
    prompt = [int(t) for t in family.ids(13, seed=5)]

    def run() -> list[np.ndarray]:
        s = engine.session(chunk_size=4, segment=7)
        out = [s.prefill(prompt)]
        for _ in range(4):
            out.append(s.step(int(np.argmax(out[-1][-1] if out[-1].ndim == 2 else out[-1]))))
        return out

    on = run()
    ops.set_fused(False)
    try:
        off = run()
    finally:
        ops.set_fused(True)
    for a, b in zip(on, off, strict=True):
        same(a, b)


def test_window_ordered_is_with_new() -> None:
    """`WindowCache.ordered` (keys into a reused buffer) gives `with_new`'s keys and positions, as
    the ring fills, wraps and takes chunks longer than itself; float64 rows take `with_new`."""
    from dsv4stream.model.cache import WindowCache

    for size in (1, 4, 7, 128):
        wc = WindowCache(size, 16)
        pos = 0
        for k in range(200):
            t = 300 if k % 50 == 49 else int(RNG.integers(1, 4))
            kv, positions = edgy((t, 16)), np.arange(pos, pos + t)
            want = wc.with_new(kv, positions)
            got = wc.ordered(kv, positions)
            same(got[0], want[0])
            assert np.array_equal(got[1], want[1])
            wc.push(kv, positions)
            pos += t
    keys, _ = wc.ordered(np.zeros((1, 16)), np.array([pos]))
    assert keys.dtype == np.float64
