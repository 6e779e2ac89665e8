"""Attention's two products in numba, each sum in one fixed order: softmax attention with a sink,
and the lightning indexer's scores.

Owns the fast backend of `kernels.attend` and `kernels.index_scores` (the numpy definitions are
in `reference.py`). Does not own which rows a query sees (`model.v4.attention`, `model.v4.indexer`, `model.v41.*`).

Arithmetic, chosen so that a query's result depends on its own inputs only: not on the thread
count, not on how many queries share the call, not on the masked keys beside its visible ones
(BLAS sums in an order that changes with its thread count and with how it splits the rows, so
numpy's products were dropped from this path):
- a dot product q . k is one FMA chain over the head dimension in index order;
- attention: s = (q . k) * head_dim^-0.5 per visible row; m = max(sink, s); e = exp(s - m) by
  the polynomial in `_exp_neg` (the same float32 operations in vector and scalar code); the
  denominator adds the e of the window's visible rows in their order, then of the compressed
  rows in mask order or index order, then exp(sink - m); each output element is one FMA chain
  of e * row over those rows in that order, divided by the denominator;
- indexer: score[t, j] adds, over the heads in order, w[t, h] * (max(q[t, h] . k[j], 0) * c^-0.5).
Work items are (query, block of HB heads) for attention and (query, block of KEY_ITEM rows) for
the indexer; an item writes only its own outputs, and each item runs the same code in the
serial and the parallel kernel, so both give the same bits.

These kernels inline helpers from `jit.py` (`_fma`, `_f32_from_bits`); its cache folder, keyed
on every kernel source, recompiles them when those change.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic

from .jit import _INLINE, _JIT, _apply_threads, _f32_from_bits, _fma, _item_ptr, _stack_f32, _threads

F32 = np.float32
HB = 16  # heads per tile: two 8-lane vectors of q per head-dimension step
KB = 4  # rows per score tile: 4 x 16 accumulators, one broadcast of k per 16 FMAs
OB = 4  # heads whose output rows are summed together (each row of keys read once for them)
KEY_ITEM = 64  # indexer rows per work item
SCORE_TILE = KB * HB
_V8F = ir.VectorType(ir.FloatType(), 8)
_I32 = ir.IntType(32)
# Below this many multiply-adds a call runs serially: a parallel region costs more than a small
# product takes, most of all when the other core is busy.
PARALLEL_MIN_MACS = 1 << 22

# exp(x) for x <= 0: x = n ln2 + r with n = round(x log2 e) (by adding and subtracting 1.5 * 2^23)
# and |r| <= ln2 / 2 (ln2 split in two parts so n * C1 is exact), e^r by Cephes' degree-6
# polynomial (about 1 ulp), times 2^n built from its bits. Plain float32 operations, so the
# vectorised loop and its scalar tail give the same bits. Below -87 the result (< 2^-125) is 0:
# a sum that holds the max's e = 1 cannot see it.
_LOG2E = F32(1.44269504088896341)
_ROUND = F32(12582912.0)
_C1 = F32(0.693359375)
_C2 = F32(-2.12194440e-4)
_P0, _P1, _P2 = F32(1.9875691500e-4), F32(1.3981999507e-3), F32(8.3334519073e-3)
_P3, _P4, _P5 = F32(4.1665795894e-2), F32(1.6666665459e-1), F32(5.0000001201e-1)
MAX_HD = 1024  # head_dim the output accumulators hold (V4-Flash and V4-Pro: 512)
OUT_TILE = OB * MAX_HD


@njit(**_INLINE)
def _exp_neg(x):
    """exp(x) in float32 for x <= 0 (NaN stays NaN)."""
    lo = x < F32(-87.0)
    x = F32(-87.0) if lo else x
    n = (x * _LOG2E + _ROUND) - _ROUND
    r = x - n * _C1
    r = r - n * _C2
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    y = (p * (r * r) + r + F32(1.0)) * _f32_from_bits((np.int32(n) + 127) << 23)  # int32: vectorised
    return F32(0.0) if lo else y


def _vec8(builder, s):
    one = builder.insert_element(ir.Constant(_V8F, ir.Undefined), s, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, 8), [0] * 8))


def _fma8(builder, a, b, c):
    fn = builder.module.declare_intrinsic("llvm.fma.v8f32", (), ir.FunctionType(_V8F, [_V8F] * 3))
    return builder.call(fn, [a, b, c])


@intrinsic
def _axpy8(typingctx, acc, a, x, i, j, s):
    """acc[a : a + 8] = fma(x[i, j : j + 8], s, acc[a : a + 8]): eight lanes, each its own chain."""
    if not (_f32_array(acc, 1) and _f32_array(x, 2)):
        return None
    sig = types.void(acc, a, x, i, j, s)

    def codegen(context, builder, sig, args):
        tacc, ta, tx, ti, tj, _ = sig.args
        acc_, a_, x_, i_, j_, s_ = args
        at = _item_ptr(context, builder, tacc, acc_, [(a_, ta)], _V8F)
        xv = builder.load(_item_ptr(context, builder, tx, x_, [(i_, ti), (j_, tj)], _V8F), align=4)
        builder.store(_fma8(builder, xv, _vec8(builder, s_), builder.load(at, align=4)), at, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _axpy8x4(typingctx, acc, a, x, r0, r1, r2, r3, j, e0, e1, e2, e3):
    """acc[a : a + 8] += e0 x[r0, j : j + 8], then e1 x[r1, ...], e2 x[r2, ...], e3 x[r3, ...]:
    four FMAs per lane in that order, one load and one store of the lanes."""
    if not (_f32_array(acc, 1) and _f32_array(x, 2)):
        return None
    sig = types.void(acc, a, x, r0, r1, r2, r3, j, e0, e1, e2, e3)

    def codegen(context, builder, sig, args):
        tacc, ta, tx, tr0, tr1, tr2, tr3, tj = sig.args[:8]
        acc_, a_, x_ = args[:3]
        at = _item_ptr(context, builder, tacc, acc_, [(a_, ta)], _V8F)
        v = builder.load(at, align=4)
        for r_, tr, e_ in zip(args[3:7], (tr0, tr1, tr2, tr3), args[8:], strict=True):
            xv = builder.load(_item_ptr(context, builder, tx, x_, [(r_, tr), (args[7], tj)], _V8F), align=4)
            v = _fma8(builder, xv, _vec8(builder, e_), v)
        builder.store(v, at, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _f32_array(t, ndim: int) -> bool:
    return isinstance(t, types.Array) and t.ndim == ndim and t.dtype == types.float32 and t.layout in "CA"


@njit(**_INLINE)
def _dot_tile(qt, src, rows, j0, j1, acc):
    """acc[j * HB + h] = q[h] . src[rows[j0 + j]] for the HB heads of qt (hd, HB) and KB rows (rows
    past j1 - 1 repeat the last one; their results are not read)."""
    for k in range(SCORE_TILE):
        acc[k] = 0
    r0, r1 = rows[j0], rows[min(j0 + 1, j1 - 1)]
    r2, r3 = rows[min(j0 + 2, j1 - 1)], rows[min(j0 + 3, j1 - 1)]
    for d in range(qt.shape[0]):
        k0, k1, k2, k3 = src[r0, d], src[r1, d], src[r2, d], src[r3, d]
        for v in range(0, HB, 8):
            _axpy8(acc, v, qt, d, v, k0)
            _axpy8(acc, HB + v, qt, d, v, k1)
            _axpy8(acc, 2 * HB + v, qt, d, v, k2)
            _axpy8(acc, 3 * HB + v, qt, d, v, k3)


@njit(**_INLINE)
def _weighted_rows(e, nh, src, rows, a, b, wide, acc):
    """acc[h * MAX_HD + k] += e[h, j] * src[rows[j], k] for j = a .. b-1 in order, h < nh <= OB,
    k < wide (a multiple of 8): rows four at a time, each stretch of lanes loaded and stored once."""
    j = a
    while j + 4 <= b:
        r0, r1, r2, r3 = rows[j], rows[j + 1], rows[j + 2], rows[j + 3]
        for h in range(nh):
            e0, e1, e2, e3 = e[h, j], e[h, j + 1], e[h, j + 2], e[h, j + 3]
            for k in range(0, wide, 8):
                _axpy8x4(acc, h * MAX_HD + k, src, r0, r1, r2, r3, k, e0, e1, e2, e3)
        j += 4
    while j < b:
        for h in range(nh):
            for k in range(0, wide, 8):
                _axpy8(acc, h * MAX_HD + k, src, rows[j], k, e[h, j])
        j += 1


@njit(**_JIT)  # not inlined: the parallel and serial kernels share one compiled item
def _attend_item(t, h0, qt, keys, kmask, comp, cmask, cidx, sink, scale, out):
    """One query t and heads h0 .. h0 + HB (qt (hd, HB) their q, transposed): out[t, h] for the
    heads that exist."""
    nk = keys.shape[0]
    rows = np.empty(nk + max(cmask.shape[1], cidx.shape[1]) + 1, np.int64)
    nw = 0
    for j in range(nk):
        if kmask[t, j]:
            rows[nw] = j
            nw += 1
    n = nw
    if cmask.shape[1]:
        for r in range(cmask.shape[1]):
            if cmask[t, r]:
                rows[n] = r
                n += 1
    else:
        for i in range(cidx.shape[1]):
            if cidx[t, i] >= 0:
                rows[n] = cidx[t, i]
                n += 1
    e = np.empty((HB, n + 1), np.float32)
    acc = carray(_stack_f32(SCORE_TILE), (SCORE_TILE,))
    for part in range(2):  # the window's rows, then the compressed rows
        src, a, b = (keys, 0, nw) if part == 0 else (comp, nw, n)
        for j0 in range(a, b, KB):
            _dot_tile(qt, src, rows, j0, b, acc)
            for j in range(min(KB, b - j0)):
                for h in range(HB):
                    e[h, j0 + j] = acc[j * HB + h] * scale
    den = np.empty(HB, np.float32)
    for h in range(HB):
        eh = e[h]
        m = sink[h0 + h]
        for j in range(n):
            m = max(m, eh[j])
        for j in range(n):
            eh[j] = _exp_neg(eh[j] - m)
        total = F32(0.0)
        for j in range(n):
            total += eh[j]
        den[h] = total + _exp_neg(sink[h0 + h] - m)
    heads = min(HB, out.shape[1] - h0)
    hd = out.shape[2]
    wide = hd - hd % 8
    oacc = carray(_stack_f32(OUT_TILE), (OUT_TILE,))
    for ho in range(0, heads, OB):
        nh = min(OB, heads - ho)
        eh = e[ho : ho + OB]
        oacc[:] = 0
        for part in range(2):
            src, a, b = (keys, 0, nw) if part == 0 else (comp, nw, n)
            _weighted_rows(eh, nh, src, rows, a, b, wide, oacc)
        for h in range(nh):
            for k in range(wide):
                out[t, h0 + ho + h, k] = oacc[h * MAX_HD + k] / den[ho + h]
            for k in range(wide, hd):  # the same chain, one element at a time
                v = F32(0.0)
                for part in range(2):
                    src, a, b = (keys, 0, nw) if part == 0 else (comp, nw, n)
                    for j in range(a, b):
                        v = _fma(eh[h, j], src[rows[j], k], v)
                out[t, h0 + ho + h, k] = v / den[ho + h]


@njit(parallel=True, **_JIT)
def _attend_par(qt, keys, kmask, comp, cmask, cidx, sink, scale, out):
    nb = qt.shape[1]
    for item in prange(qt.shape[0] * nb):
        t, b = item // nb, item % nb
        _attend_item(t, b * HB, qt[t, b], keys, kmask, comp, cmask, cidx, sink, scale, out)


@njit(**_JIT)
def _attend_serial(qt, keys, kmask, comp, cmask, cidx, sink, scale, out):
    nb = qt.shape[1]
    for item in range(qt.shape[0] * nb):
        t, b = item // nb, item % nb
        _attend_item(t, b * HB, qt[t, b], keys, kmask, comp, cmask, cidx, sink, scale, out)


@njit(**_JIT)
def _index_item(t, j0, qt, heads, w, keys, scale, out):
    """Rows j0 .. j0 + KEY_ITEM of query t's indexer scores; qt (nb, c, HB) its heads, transposed."""
    j1 = min(j0 + KEY_ITEM, keys.shape[0])
    acc = carray(_stack_f32(SCORE_TILE), (SCORE_TILE,))
    dots = np.empty((qt.shape[0] * HB, KB), np.float32)
    rows = np.arange(j0, j1)
    for j in range(j0, j1, KB):
        for b in range(qt.shape[0]):
            _dot_tile(qt[b], keys, rows, j - j0, j1 - j0, acc)
            for i in range(KB):
                for h in range(HB):
                    dots[b * HB + h, i] = acc[i * HB + h]
        for i in range(min(KB, j1 - j)):
            total = F32(0.0)
            for h in range(heads):
                total += w[t, h] * (max(dots[h, i], F32(0.0)) * scale)
            out[t, j + i] = total


@njit(parallel=True, **_JIT)
def _index_par(qt, heads, w, keys, scale, out):
    nb = -(-keys.shape[0] // KEY_ITEM)
    for item in prange(qt.shape[0] * nb):
        t = item // nb
        _index_item(t, (item - t * nb) * KEY_ITEM, qt[t], heads, w, keys, scale, out)


@njit(**_JIT)
def _index_serial(qt, heads, w, keys, scale, out):
    nb = -(-keys.shape[0] // KEY_ITEM)
    for item in range(qt.shape[0] * nb):
        t = item // nb
        _index_item(t, (item - t * nb) * KEY_ITEM, qt[t], heads, w, keys, scale, out)


# ---- public API ----------------------------------------------------------------------------------


def _transposed(q: np.ndarray) -> np.ndarray:
    """q (T, H, c) -> (T, nb, c, HB) float32: blocks of HB heads, each transposed and contiguous
    (one work item's q in consecutive cache lines), heads padded with zeros."""
    t, h, c = q.shape
    nb = -(-h // HB)
    qt = np.zeros((t, nb * HB, c), np.float32)
    qt[:, :h] = q
    return np.ascontiguousarray(qt.reshape(t, nb, HB, c).transpose(0, 1, 3, 2))


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _parallel(macs: int) -> bool:
    return _threads[0] != 1 and macs >= PARALLEL_MIN_MACS


def attend(
    q: np.ndarray,
    keys: np.ndarray,
    key_mask: np.ndarray,
    comp: np.ndarray | None,
    comp_mask: np.ndarray | None,
    comp_idx: np.ndarray | None,
    sink: np.ndarray,
) -> np.ndarray:
    """Softmax attention with a sink, one KV vector as key and value (see `kernels.attend`)."""
    t, h, hd = q.shape
    _apply_threads()
    qt = _transposed(q)
    keys = _f32(keys)
    comp = np.zeros((0, hd), np.float32) if comp is None else _f32(comp)
    none = np.zeros((t, 0), np.bool_)
    cmask = none if comp_mask is None else np.ascontiguousarray(comp_mask, dtype=np.bool_)
    cidx = np.zeros((t, 0), np.int64) if comp_idx is None else np.ascontiguousarray(comp_idx, dtype=np.int64)
    if hd > MAX_HD:
        raise ValueError(f"attention kernels hold head_dim <= {MAX_HD}, found {hd}")
    sink_p = np.zeros(qt.shape[1] * HB, np.float32)
    sink_p[:h] = sink
    out = np.empty((t, h, hd), np.float32)
    rows = keys.shape[0] + (cmask.shape[1] if comp_mask is not None else cidx.shape[1])
    kernel = _attend_par if _parallel(2 * t * qt.shape[1] * HB * rows * hd) else _attend_serial
    kernel(qt, keys, np.ascontiguousarray(key_mask, dtype=np.bool_), comp, cmask, cidx, sink_p, F32(hd**-0.5), out)
    return out


def index_scores(q: np.ndarray, w: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The indexer's scores (see `kernels.index_scores`): q (T, h, c), w (T, h), keys (n, c) -> (T, n)."""
    t, h, c = q.shape
    _apply_threads()
    keys = _f32(keys)
    out = np.empty((t, keys.shape[0]), np.float32)
    if keys.shape[0] == 0 or t == 0:
        return out
    qt = _transposed(q)
    kernel = _index_par if _parallel(t * qt.shape[1] * HB * keys.shape[0] * c) else _index_serial
    kernel(qt, h, _f32(w), keys, F32(c**-0.5), out)
    return out


def warmup() -> None:
    """Compile (or load) both kernels of each product."""
    global PARALLEL_MIN_MACS
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 8)).astype(np.float32)
    keys = rng.standard_normal((5, 8)).astype(np.float32)
    mask = np.ones((2, 5), bool)
    sink = np.zeros(3, np.float32)
    keep = PARALLEL_MIN_MACS
    try:
        for floor in (0, 1 << 62):
            PARALLEL_MIN_MACS = floor
            attend(q, keys, mask, keys, None, np.zeros((2, 2), np.int64), sink)
            index_scores(q, sink[None, :].repeat(2, 0), keys)
    finally:
        PARALLEL_MIN_MACS = keep
