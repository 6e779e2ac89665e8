"""The trunk's small per-token steps in numba, each with numpy's bits: RMS norms, the
hyper-connection mixes (split, collapse, fold back) and RoPE.

Owns `rms_norm`, `split_mixes` (with one `np.exp` call between two numba calls), `collapse`,
`hc_post` and `rope`, the fast backend of `model.ops.rms_norm`, `model.mhc` and
`model.rope.apply_rope`; the numpy definitions stay there, and are what runs under the
reference backend. At one token a layer runs about 40 numpy calls on vectors of 4-16 K
values for these steps (each norm 9 ufunc calls, a Sinkhorn split about 30), and numpy's
per-call cost outweighed the arithmetic: 1.3 ms a layer at V4-Flash's dimensions.

Same bits as the numpy code they replace, on every input (NaN, infinities and signed zeros
included), because each float32 operation is numpy's, in numpy's order:
- a sum along a row is numpy's pairwise summation (`_pairwise`: below 8 terms one by one from
  0; up to 128 in 8 interleaved accumulators added as ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)),
  then the rest one by one; above that split at half rounded down to a multiple of 8), started
  from the reduction's identity 0;
- the mean divides in float64 and rounds to float32 (numpy's true_divide of float32 by an intp);
- `np.exp` stays numpy's (its SIMD polynomial gives other bits than LLVM's `expf`): the
  numba code computes the arguments of a split's exps and finishes after one `np.exp` call,
  whose bits do not depend on an element's place in the array;
- `collapse` adds pre[j] * x[j] in j order from 0 without FMA (numpy's einsum), `hc_post`
  mixes the streams by an FMA chain from 0 in j order (numpy's matmul, which OpenBLAS's
  sgemm computes that way on this machine's AVX-512 kernels), then adds post * y;
- numba compiles without fast-math, so no product is contracted into an FMA but where
  `_fma` says so.
tests/test_trunkops.py compares every function with the numpy code it replaces, bit for bit.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import carray, njit

from .jit import _INLINE, _JIT, _fma, _stack_f32, _stack_f64

F32 = np.float32
MAX_HC = 8  # the Sinkhorn's numba passes (`sinkhorn`) sum hc < 8 terms one by one, as numpy does
PW_BLOCK = 128  # numpy's PW_BLOCKSIZE
STACK = 64  # levels of the pairwise split: 2^64 terms
FRAMES = 4 * STACK


@njit(**_INLINE)
def _leaf(a, lo, n, square):
    """numpy's pairwise float32 sum of a[lo : lo + n] for n <= PW_BLOCK (of the squares where
    `square`): below 8 terms one by one from 0, else 8 interleaved accumulators (held in one
    8-lane stack array, so LLVM keeps them in a vector), their tree, then the rest one by one."""
    res = F32(0.0)
    if n < 8:
        for i in range(lo, lo + n):
            v = a[i] * a[i] if square else a[i]
            res += v
        return res
    r = carray(_stack_f32(8), (8,))
    end = lo + n - n % 8
    if square:
        for k in range(8):
            r[k] = a[lo + k] * a[lo + k]
        for j in range(lo + 8, end, 8):
            for k in range(8):
                r[k] += a[j + k] * a[j + k]
    else:
        for k in range(8):
            r[k] = a[lo + k]
        for j in range(lo + 8, end, 8):
            for k in range(8):
                r[k] += a[j + k]
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    for i in range(end, lo + n):
        v = a[i] * a[i] if square else a[i]
        res += v
    return res


@njit(**_INLINE)
def _half(n):
    h = n // 2
    return h - h % 8


@njit(**_JIT)
def _pairwise_sq(a, lo, n, square):
    """numpy's pairwise float32 sum of a[lo : lo + n] (of its squares where `square`): leaves of at
    most PW_BLOCK terms, split at `_half`, added left + right. The recursion runs on an explicit
    stack (numba's cache does not reload a self-recursive function: it crashed): per level the
    range, whether its left half is done, and that half's sum."""
    if n <= PW_BLOCK:
        return _leaf(a, lo, n, square)
    fr = carray(_stack_f64(FRAMES), (4, STACK))  # lo, n, state (1: left pending, 2: right), left sum
    sp = 0
    fr[0, 0], fr[1, 0], fr[2, 0] = lo, n, 0
    while True:
        m = np.int64(fr[1, sp])
        if m > PW_BLOCK:
            fr[2, sp] = 1
            sp += 1
            fr[0, sp], fr[1, sp], fr[2, sp] = fr[0, sp - 1], _half(m), 0
            continue
        v = _leaf(a, np.int64(fr[0, sp]), m, square)
        sp -= 1
        while True:  # hand v to the frames above
            if fr[2, sp] == 1:
                fr[3, sp] = v
                fr[2, sp] = 2
                h = _half(np.int64(fr[1, sp]))
                fr[0, sp + 1], fr[1, sp + 1], fr[2, sp + 1] = fr[0, sp] + h, fr[1, sp] - h, 0
                sp += 1
                break
            v = np.float32(fr[3, sp]) + v
            if sp == 0:
                return v
            sp -= 1


@njit(**_INLINE)
def _row_sum(a, square):
    """numpy's add.reduce of a 1-D float32 row (of its squares): the identity 0 plus the pairwise sum."""
    return F32(0.0) + _pairwise_sq(a, 0, a.shape[0], square)


@njit(**_INLINE)
def _inv_rms(row, eps):
    """1 / sqrt(mean(row^2) + eps) in numpy's float32 steps (the mean divided in float64)."""
    ms = np.float32(np.float64(_row_sum(row, True)) / np.float64(row.shape[0]))
    return F32(1.0) / np.sqrt(ms + eps)


@njit(**_JIT)
def _rms_rows(x, weight, eps, out):
    """out[i] = x[i] * inv_rms(x[i]) (times weight where it has the row's width)."""
    n = x.shape[1]
    for i in range(x.shape[0]):
        inv = _inv_rms(x[i], eps)
        if weight.shape[0] == n:
            for j in range(n):
                out[i, j] = (x[i, j] * inv) * weight[j]
        else:
            for j in range(n):
                out[i, j] = x[i, j] * inv


@njit(**_JIT)
def _inv_rms_rows(x, eps, out):
    """out[i] = inv_rms(x[i]) (V4.1's mixes scale)."""
    for i in range(x.shape[0]):
        out[i] = _inv_rms(x[i], eps)


@njit(**_JIT)
def _mix_args(mixes, scale, base, hc, a, e):
    """The arguments of a split's exps: a[:, :2hc] the pre / post logits, e[:, :2hc] their -|a|,
    e[:, 2hc:] the comb logits minus their row's max."""
    for t in range(mixes.shape[0]):
        for k in range(2 * hc):
            v = mixes[t, k] * scale[k // hc] + base[k]
            a[t, k] = v
            e[t, k] = -abs(v)
        for i in range(hc):
            o = 2 * hc + i * hc
            m = mixes[t, o] * scale[2] + base[o]
            for j in range(1, hc):
                v = mixes[t, o + j] * scale[2] + base[o + j]
                if not np.isnan(m) and (v > m or np.isnan(v)):  # numpy's maximum: a NaN wins
                    m = v
            for j in range(hc):
                e[t, o + j] = (mixes[t, o + j] * scale[2] + base[o + j]) - m


@njit(**_JIT)
def _mix_finish(a, e, hc, hc_eps, pre, post, comb):
    """From the exps e: pre = sigmoid + hc_eps, post = 2 sigmoid, comb = row softmax + hc_eps."""
    for t in range(a.shape[0]):
        for k in range(2 * hc):
            num = F32(1.0) if a[t, k] >= 0 else e[t, k]
            s = num / (e[t, k] + F32(1.0))
            if k < hc:
                pre[t, k] = s + hc_eps
            else:
                post[t, k - hc] = F32(2.0) * s
        for i in range(hc):
            o = 2 * hc + i * hc
            total = _row_sum(e[t, o : o + hc], False)
            for j in range(hc):
                comb[t, i, j] = e[t, o + j] / total + hc_eps


@njit(**_JIT)
def _collapse(x, pre, weight, eps, out):
    """out[t] = sum_j pre[t, j] x[t, j] (j in order, from 0, no FMA), then normed by weight
    where weight has the row's width."""
    t, hc, d = x.shape
    for i in range(t):
        o = out[i]
        o[:] = 0
        for j in range(hc):
            p = pre[i, j]
            xj = x[i, j]
            for k in range(d):
                o[k] = o[k] + p * xj[k]
        if weight.shape[0] == d:
            inv = _inv_rms(o, eps)
            for k in range(d):
                o[k] = (o[k] * inv) * weight[k]


@njit(**_JIT)
def _hc_post(x, y, post, comb, out):
    """out[t, k] = post[t, k] y[t] + (FMA chain from 0 over j of comb[t, j, k] x[t, j]); out is
    not x. hc = 4 (every release) has its chain written out, so the channel loop vectorises."""
    t, hc, d = x.shape
    for i in range(t):
        yi = y[i]
        if hc == 4:
            x0, x1, x2, x3 = x[i, 0], x[i, 1], x[i, 2], x[i, 3]
            for c in range(4):
                c0, c1, c2, c3 = comb[i, 0, c], comb[i, 1, c], comb[i, 2, c], comb[i, 3, c]
                p = post[i, c]
                o = out[i, c]
                for k in range(d):
                    v = _fma(c3, x3[k], _fma(c2, x2[k], _fma(c1, x1[k], _fma(c0, x0[k], F32(0.0)))))
                    o[k] = p * yi[k] + v
            continue
        for c in range(hc):
            p = post[i, c]
            for k in range(d):
                v = F32(0.0)
                for j in range(hc):
                    v = _fma(comb[i, j, c], x[i, j, k], v)
                out[i, c, k] = p * yi[k] + v


@njit(**_JIT)
def _rope(x, cos, sin, inverse):
    """The trailing 2 * half channels of x (T, R, d) rotated in place, row t by cos/sin[t]."""
    t, r, d = x.shape
    half = cos.shape[1]
    base = d - 2 * half
    for i in range(t):
        for h in range(r):
            for p in range(half):
                c, s = cos[i, p], sin[i, p]
                even, odd = x[i, h, base + 2 * p], x[i, h, base + 2 * p + 1]
                if inverse:
                    x[i, h, base + 2 * p] = even * c + odd * s
                    x[i, h, base + 2 * p + 1] = odd * c - even * s
                else:
                    x[i, h, base + 2 * p] = even * c - odd * s
                    x[i, h, base + 2 * p + 1] = odd * c + even * s


# ---- public API (float32 arrays; the callers check what the numpy code would accept) -------------

_NONE = np.zeros(0, F32)
_held = threading.local()  # `rows_buffer`'s arrays, per thread and row width


def rows_buffer(rows: int, d: int) -> np.ndarray:
    """A (rows, d) float32 array of this thread's, reused by the next call for the same width (its
    contents then overwritten): `model.cache.WindowCache.ordered`'s keys, read before that call.
    Here because model/ starts no thread and keeps no per-thread state (tests/test_layout.py)."""
    bufs = getattr(_held, "bufs", None)
    if bufs is None:
        bufs = _held.bufs = {}
    buf = bufs.get(d)
    if buf is None or buf.shape[0] < rows:
        buf = bufs[d] = np.empty((rows, d), F32)
    return buf[:rows]


def _rows(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=F32).reshape(-1, x.shape[-1])


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """`model.ops.rms_norm`'s bits: x (..., N) float32, weight (N,) float32 or None."""
    out = np.empty(x.shape, F32)
    _rms_rows(_rows(x), _NONE if weight is None else weight, F32(eps), out.reshape(-1, x.shape[-1]))
    return out


def inv_rms(x: np.ndarray, eps: float) -> np.ndarray:
    """(T, N) -> (T, 1): 1 / sqrt(np.mean(x^2, axis=-1, dtype=float32) + eps), numpy's bits."""
    out = np.empty((x.shape[0], 1), F32)
    _inv_rms_rows(_rows(x), F32(eps), out.reshape(-1))
    return out


def split_mixes(
    mixes: np.ndarray, scale: np.ndarray, base: np.ndarray, hc: int, iters: int, hc_eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`model.mhc.split_mixes`' bits for hc < MAX_HC: mixes (T, (2 + hc) hc) -> pre, post, comb."""
    from .sinkhorn import _passes

    t = mixes.shape[0]
    a = np.empty((t, 2 * hc), F32)
    e = np.empty((t, (2 + hc) * hc), F32)
    _mix_args(np.ascontiguousarray(mixes, dtype=F32), scale, base, hc, a, e)
    np.exp(e, out=e)
    pre, post, comb = np.empty((t, hc), F32), np.empty((t, hc), F32), np.empty((t, hc, hc), F32)
    _mix_finish(a, e, hc, F32(hc_eps), pre, post, comb)
    _passes(comb, max(1, int(iters)), F32(hc_eps))
    return pre, post, comb


def collapse(x: np.ndarray, pre: np.ndarray, weight: np.ndarray | None = None, eps: float = 0.0) -> np.ndarray:
    """x (T, hc, D) weighted by pre (T, hc) -> (T, D) (`model.mhc.collapse`'s bits), then
    `rms_norm(., weight, eps)`'s where weight is given."""
    out = np.empty((x.shape[0], x.shape[2]), F32)
    _collapse(np.ascontiguousarray(x), np.ascontiguousarray(pre), _NONE if weight is None else weight, F32(eps), out)
    return out


def hc_post(x: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """`model.mhc.hc_post`'s bits: x (T, hc, D), y (T, D), post (T, hc), comb (T, hc, hc) -> new streams."""
    out = np.empty(x.shape, F32)
    c = np.ascontiguousarray
    _hc_post(c(x), c(y, dtype=F32), c(post), c(comb), out)
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool) -> np.ndarray:
    """`model.rope.apply_rope(x, cos, sin, inverse, in_place=True)`'s bits on a writable
    C-contiguous float32 x (T, ..., d): rotated where it is and returned."""
    t = x.shape[0]
    _rope(x.reshape(t, -1, x.shape[-1]), np.ascontiguousarray(cos), np.ascontiguousarray(sin), inverse)
    return x


def warmup() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, 16)).astype(F32)
    w = np.ones(16, F32)
    rms_norm(x, None, 1e-6)
    rms_norm(x[:, 0], w, 1e-6)
    inv_rms(x.reshape(1, -1), 1e-6)
    pre, post, comb = split_mixes(
        rng.standard_normal((1, 24)).astype(F32), np.ones(3, F32), np.zeros(24, F32), 4, 2, 1e-6
    )
    collapse(x, pre)
    collapse(x, pre, w, 1e-6)
    hc_post(x, x[:, 0], post, comb)
    cs = np.ones((1, 4), F32)
    rope(x.copy(), cs, cs, False)
