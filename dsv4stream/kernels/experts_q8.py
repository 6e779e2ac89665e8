"""A MoE layer's routed FP4 experts on int8 activations in two numba calls (`fast` numerics).

Owns the layer-wide form of `q8.py`'s product: every (token, expert) pair of a layer's routing
in one call for the gate and up projections of all chosen experts (`pair_products`) and one for
the down projections with each token's weighted sum over its experts (`down_sum`), each call
one parallel region. The SwiGLU between them (clip, silu, product) stays with the caller
(`model.moe`), in numpy as before, so its bits do not change. Does not own the row kernel,
the activation rounding nor their arithmetic (`q8.py`): this module only drives them.

Same bits as the per-expert path (`numerics.Router.matmul_pair` then `matmul`, three parallel
regions per expert): a pair's activations are its token's row quantised by `q8._quantize`
(the rounding is per row), each output row is one `q8` row kernel (every token runs the same
instruction sequence in token groups of 4, 2 or 1), and a token's sum runs over its experts in
ascending (expert id, slot) order from zero, in float32, each part first multiplied by its
routing weight, as `model.moe.routed_experts` sums. So rows are independent of the thread
count, of the other tokens in the call and of the order in which experts arrived.

Pairs are ordered by (expert, token, slot); expert j owns pairs lo[j] .. hi[j]. The experts'
weights are passed as addresses (an (E, 4) or (E, 2) int64 table) because numba takes no list
of arrays without building one per call; the caller keeps the arrays alive during the call.

`swiglu_sum`'s second call has two forms (`_per_expert`): where the experts split evenly over
the threads (a decode step), one parallel region over the experts, each work item an expert's
SwiGLU rows, their rounding and all its w2 rows, the sums after it; elsewhere a region over the
pairs for the SwiGLU, then one over w2's row blocks of every expert. The same row kernel runs
every output row and the sums run in the same order, so the two give the same bits.

`Layer` drives a layer whose experts come in groups (the expert store pins what fits its free
slots): a layer in one group is one `pair_products` and one `down_sum`; otherwise each group's
calls fill the pairs' unweighted rows and one last `down_sum` call with no expert sums them, in
the same order, so the bits do not depend on the grouping.
"""

from __future__ import annotations

import hashlib
import time
import types as pytypes
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from . import jit, q8, simd
from .numerics import alone_if_small  # the per-expert path's rule: small products stay serial
from .q8 import _JIT, ROWS, _quantize  # the drivers call them

# numba's cache keys an entry by the function's name, signature and CPU target; the row kernel's
# code lives in q8.py, so its hash is in the name (jit.cache_stamp also covers every kernel file)
_STAMP = simd.STAMP + hashlib.sha256(Path(q8.__file__).read_bytes()).hexdigest()[:8]
U8_LIKE = np.empty(0, np.uint8)  # element types of the address table's arrays (`_ptr`)
F32_LIKE = np.empty(0, np.float32)


@intrinsic
def _ptr(typingctx, addr, like):
    """An int64 address as a pointer to like's element type (for numba.carray)."""
    ret = types.CPointer(like.dtype)
    sig = ret(addr, like)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ret))

    return sig, codegen


_row_groups = None  # `q8.row_groups(variant)`, bound in each driver's globals (`_driver`)


def _up_item(addr, e, r0, r1, C, sdt, qa, bias, da, lo, hi, gate, up):
    """Rows r0 .. r1 of expert e's w1 and w3 (addr columns 0-3) for its pairs lo .. hi, into
    gate and up: one work item of the gate/up drivers' parallel region."""
    R = gate.shape[1]
    for m in range(2):
        w = numba.carray(_ptr(addr[e, 2 * m], U8_LIKE), (R, C // 2))
        s = numba.carray(_ptr(addr[e, 2 * m + 1], sdt), (R, C // 32))
        _row_groups(w, s, r0, r1, qa, bias, da, lo[e], hi[e], gate if m == 0 else up)


def _down_item(addr, col, r0, r1, C, sdt, qa, bias, da, lo, hi, wp, tp, y, out):
    """Rows r0 .. r1 of every expert's w2 (data and scale in addr columns col, col + 1) for its
    pairs, into y, then those rows of each token's sum over j of y[tp[t, j]] * wp[tp[t, j]], from
    zero in the order of tp's row: one work item of the down drivers' parallel region."""
    D = y.shape[1]
    for e in range(addr.shape[0]):
        w = numba.carray(_ptr(addr[e, col], U8_LIKE), (D, C // 2))
        s = numba.carray(_ptr(addr[e, col + 1], sdt), (D, C // 32))
        _row_groups(w, s, r0, r1, qa, bias, da, lo[e], hi[e], y)
    _sum_rows(wp, tp, y, out, r0, r1)


def _drive_pair(addr, lo, hi, sdt, xg, S, gate, up, qa, bias, da):
    """gate/up (P, I) = pairs' rows xg (P, C) times w1/w3 of their expert; addr (E, 4): w1 data,
    w1 scale, w3 data, w3 scale. qa, bias, da: scratch of `q8._quantize`'s shapes for xg."""
    _quantize(xg, S, qa, bias, da)
    R = gate.shape[1]
    C = xg.shape[1]
    nb = (R + ROWS - 1) // ROWS
    for it in prange(addr.shape[0] * nb):
        r0 = (it % nb) * ROWS
        _up_item(addr, it // nb, r0, min(R, r0 + ROWS), C, sdt, qa, bias, da, lo, hi, gate, up)


def _drive_down(addr, lo, hi, sdt, h, S, wp, tp, y, out, qa, bias, da):
    """y (P, D) = pairs' rows h (P, I) times w2 of their expert (addr (E, 2): w2 data, w2 scale),
    then out (T, D): token t's sum over j of y[tp[t, j]] * wp[tp[t, j]], from zero in the order of
    tp's row. Either part may be empty: E = 0 only sums (y filled by earlier calls), T = 0 only
    fills y (a layer whose experts came in several groups)."""
    _quantize(h, S, qa, bias, da)
    D = y.shape[1]
    C = h.shape[1]
    for ib in prange((D + ROWS - 1) // ROWS):
        r0 = ib * ROWS
        _down_item(addr, 0, r0, min(D, r0 + ROWS), C, sdt, qa, bias, da, lo, hi, wp, tp, y, out)


def _gate_clamped(gate, en, lim, lo, hi, r0, r1):
    """gate[p, r] = min(gate, lim) and en[p, r] = -gate for pairs lo .. hi, rows r0 .. r1: the
    SwiGLU's first steps (`model.moe._glu`: np.minimum keeps a NaN, np.negative), the same bits."""
    for p in range(lo, hi):
        for r in range(r0, r1):
            g = gate[p, r]
            if g > lim:  # noqa: PLR1730 (not min(): a NaN stays, as np.minimum keeps it)
                g = lim
            gate[p, r] = g
            en[p, r] = -g


def _copy_rows(qx, bx, dx, tok, qa, bias, da):
    """Row p of qa, bias, da = row tok[p] of qx, bx, dx: scalar loops in a function of its own (an
    array assignment in a parallel driver becomes a parallel region of its own, one per row)."""
    for p in range(tok.size):
        for c in range(qa.shape[1]):
            qa[p, c] = qx[tok[p], c]
        for c in range(bias.shape[1]):
            bias[p, c] = bx[tok[p], c]
        for c in range(da.shape[1]):
            da[p, c] = dx[tok[p], c]


def _drive_gate_up(addr, lo, hi, sdt, x, tok, S, lim, gate, up, en, qx, bx, dx, qa, bias, da):
    """`_drive_pair` for x (T, C), the layer's token rows (each quantised once, then copied to its
    pairs' rows of qa, bias, da), addr (E, 6) (w1, w3, w2 data and scale: columns 0-3 here), and
    each work item's gate rows clamped at lim with their negation in en (`_gate_clamped`)."""
    _quantize(x, S, qx, bx, dx)
    _copy_rows(qx, bx, dx, tok, qa, bias, da)
    R = gate.shape[1]
    C = x.shape[1]
    nb = (R + ROWS - 1) // ROWS
    for it in prange(addr.shape[0] * nb):
        e = it // nb
        r0 = (it % nb) * ROWS
        r1 = min(R, r0 + ROWS)
        _up_item(addr, e, r0, r1, C, sdt, qa, bias, da, lo, hi, gate, up)
        _gate_clamped(gate, en, lim, lo[e], hi[e], r0, r1)


def _glu_row(gate, up, ex, lim, wpre, pre, h, p):
    """h[p] = gate[p] / (ex[p] + 1) * clip(up[p], -lim, lim) (times wpre[p] where pre): `model.moe.
    _glu` after numpy's exp (ex = e^-gate), op for op in float32 (np.maximum and np.minimum keep a
    NaN, as the comparisons below do; h *= w for V4.1's weight before w2), so the same bits."""
    one = np.float32(1.0)
    for c in range(h.shape[1]):
        u = up[p, c]
        if u < -lim:  # noqa: PLR1730 (not max() / min(): a NaN stays, as np.clip keeps it)
            u = -lim
        if u > lim:  # noqa: PLR1730
            u = lim
        v = np.float32(gate[p, c] / np.float32(ex[p, c] + one)) * u
        if pre:
            v = v * wpre[p]
        h[p, c] = v


def _glu_pairs(gate, up, ex, lim, wpre, pre, S, h, qa, bias, da, a, b):
    """The SwiGLU of pairs a .. b (`_glu_row`) and their rounding, row by row."""
    for p in range(a, b):
        _glu_row(gate, up, ex, lim, wpre, pre, h, p)
        _quantize(h[p : p + 1], S, qa[p : p + 1], bias[p : p + 1], da[p : p + 1])


def _expert_down(addr, e, C, sdt, qa, bias, da, lo, hi, y):
    """Every row of expert e's w2 (addr columns 4, 5) for its pairs, into y, 16 rows at a time
    (each block's weights stay in L1 across the token groups)."""
    D = y.shape[1]
    w = numba.carray(_ptr(addr[e, 4], U8_LIKE), (D, C // 2))
    s = numba.carray(_ptr(addr[e, 5], sdt), (D, C // 32))
    for r0 in range(0, D, ROWS):
        _row_groups(w, s, r0, min(D, r0 + ROWS), qa, bias, da, lo[e], hi[e], y)


def _sum_rows(wp, tp, y, out, r0, r1):
    """Rows r0 .. r1 of each token's sum over j of y[tp[t, j]] * wp[tp[t, j]], from zero in the
    order of tp's row (`_down_item`'s sum)."""
    T, K = tp.shape
    for t in range(T):
        for r in range(r0, r1):
            acc = np.float32(0.0)
            for j in range(K):
                p = tp[t, j]
                acc = acc + np.float32(y[p, r] * wp[p])
            out[t, r] = acc


# Tokens up to which `_drive_glu_down`'s per-expert form sums on the calling thread (a decode
# step's 6 x 4096 products: far less than a parallel region's start and end).
SERIAL_SUM_TOKENS = 4


def _drive_glu_down(addr, lo, hi, sdt, gate, up, ex, lim, wpre, pre, S, wp, tp, h, y, out, qa, bias, da, per_expert):
    """The SwiGLU of every pair (`_glu_row`) and its rounding, then `_drive_down`'s products and
    sums for addr (E, 6) (w2 data and scale: columns 4-5).

    per_expert (the caller's choice, `_per_expert`): one parallel region over the experts, each
    work item an expert's SwiGLU rows and then all its w2 rows, the sums after it; else a region
    over the pairs for the SwiGLU, then `_drive_down`'s over row blocks of every expert."""
    D = y.shape[1]
    C = h.shape[1]
    if per_expert:
        for e in prange(addr.shape[0]):
            _glu_pairs(gate, up, ex, lim, wpre, pre, S, h, qa, bias, da, lo[e], hi[e])
            _expert_down(addr, e, C, sdt, qa, bias, da, lo, hi, y)
        if tp.shape[0] <= SERIAL_SUM_TOKENS:
            _sum_rows(wp, tp, y, out, 0, D)
        else:
            for ib in prange((D + ROWS - 1) // ROWS):
                _sum_rows(wp, tp, y, out, ib * ROWS, min(D, ib * ROWS + ROWS))
        return
    for p in prange(h.shape[0]):
        _glu_pairs(gate, up, ex, lim, wpre, pre, S, h, qa, bias, da, p, p + 1)
    for ib in prange((D + ROWS - 1) // ROWS):
        r0 = ib * ROWS
        _down_item(addr, 4, r0, min(D, r0 + ROWS), C, sdt, qa, bias, da, lo, hi, wp, tp, y, out)


def _compiled(fn, variant: str, g: dict, **options):
    """fn compiled with the globals g: a function object of its own (numba's cache cannot key a
    closure over intrinsics), named after the variant and the kernels' sources."""
    f = pytypes.FunctionType(fn.__code__, g, f"{fn.__name__[1:]}_{variant}_{_STAMP}")
    f.__qualname__ = f.__name__
    return njit(**options, **_JIT)(f)


def _driver(fn, variant: str):
    """fn compiled with `variant`'s row kernels (through `q8.row_groups`, the loop q8's own
    driver runs)."""
    g = dict(globals())
    g["_row_groups"] = q8.row_groups(variant)
    g["_gate_clamped"] = _compiled(_gate_clamped, variant, g)
    g["_copy_rows"] = _compiled(_copy_rows, variant, g)
    g["_glu_row"] = _compiled(_glu_row, variant, g)
    g["_glu_pairs"] = _compiled(_glu_pairs, variant, g)
    g["_expert_down"] = _compiled(_expert_down, variant, g)
    g["_sum_rows"] = _compiled(_sum_rows, variant, g)
    g["_up_item"] = _compiled(_up_item, variant, g)
    g["_down_item"] = _compiled(_down_item, variant, g)
    return _compiled(fn, variant, g, parallel=True)


_DRIVERS: dict[tuple[str, str], object] = {}
_FUNCTIONS = {"pair": _drive_pair, "down": _drive_down, "gate_up": _drive_gate_up, "glu_down": _drive_glu_down}


def driver_for(name: str, variant: str):
    """The compiled driver "pair", "down", "gate_up" or "glu_down" of `variant` (compiled, or
    loaded, at first use)."""
    key = (name, variant)
    if key not in _DRIVERS:
        _DRIVERS[key] = _driver(_FUNCTIONS[name], variant)
    return _DRIVERS[key]


# ---------------------------------------------------------------- the Python side ------------


class Routing:
    """A layer's routing as pairs: experts (T, k) int64 and weights (T, k) float32 ->
    ids (E,) distinct experts ascending, lo/hi (E,) each one's pair range, tok (P,) each pair's
    token, wp (P,) its weight, tp (T, k) each token's pairs in ascending (expert, slot) order."""

    ids: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    tok: np.ndarray
    wp: np.ndarray
    tp: np.ndarray

    def __init__(self, experts: np.ndarray, weights: np.ndarray):
        t, k = experts.shape
        flat = experts.reshape(-1)
        order = np.argsort(flat, kind="stable")  # by expert, then token, then slot
        sorted_e = flat[order]
        if t == 1 and not (sorted_e[1:] == sorted_e[:-1]).any():  # a decode step: k distinct experts
            self.ids, self.tok = sorted_e, np.zeros(k, np.int64)
            self.lo = np.arange(k, dtype=np.int64)
            self.hi = self.lo + 1
            self.wp = np.ascontiguousarray(weights[0, order], dtype=np.float32)
            self.tp = self.lo.reshape(1, k)
            return
        self.ids, self.lo = np.unique(sorted_e, return_index=True)
        self.hi = np.append(self.lo[1:], sorted_e.size).astype(np.int64)
        self.lo = self.lo.astype(np.int64)
        self.tok = (order // k).astype(np.int64)
        self.wp = np.ascontiguousarray(weights.reshape(-1)[order], dtype=np.float32)
        where = np.empty(order.size, np.int64)
        where[order] = np.arange(order.size)
        self.tp = np.sort(where.reshape(t, k), axis=1)


@njit(**_JIT)
def _put2(table, j, k, a, b):
    """table[j, k], table[j, k + 1] = the addresses of a and b (numba reads them in ~0.4 us a call
    where Python's `a.ctypes.data` takes 1.5-3 us each: 36 a decode layer)."""
    table[j, k] = a.ctypes.data
    table[j, k + 1] = b.ctypes.data


@njit(**_JIT)
def _put6(table, j, a, b, c, d, e, f):
    """`_put2` for a row of three (data, scale) pairs: one call per expert."""
    _put2(table, j, 0, a, b)
    _put2(table, j, 2, c, d)
    _put2(table, j, 4, e, f)


def _address_table(mats: list[list[np.ndarray]]) -> np.ndarray:
    """(E, n) int64: the addresses of mats[e][0 .. n-1] (n even: (data, scale) pairs). Every
    array goes in as uint8 bytes, so `_put2` and `_put6` have one signature whatever the scales'
    type (the warm-up's units compile in parallel children: two adding different signatures
    to one function's cache index would lose one)."""
    table = np.empty((len(mats), len(mats[0]) if mats else 0), np.int64)
    for j, row in enumerate(mats):
        row = [_u8(a) for a in row]
        if len(row) == 6:
            _put6(table, j, *row)
        else:
            for k in range(0, len(row), 2):
                _put2(table, j, k, row[k], row[k + 1])
    return table


def scale_like(scales: list[np.ndarray]) -> np.ndarray | None:
    """The `like` array of the experts' scale type (E8M0 bytes or float32), None if mixed."""
    kinds = {s.dtype.itemsize for s in scales}
    if kinds == {1}:
        return U8_LIKE
    if kinds == {4} and all(s.dtype == np.float32 for s in scales):
        return F32_LIKE
    return None


def pair_products(variant: str, x: np.ndarray, rt: Routing, w1s, w3s) -> tuple[np.ndarray, np.ndarray]:
    """Gate and up of every pair: x (T, C) float32; w1s / w3s: per expert of rt.ids, (data
    (I, C/2) uint8, scale (I, C/32)) C-contiguous -> (gate, up), each (P, I) float32."""
    xg = np.ascontiguousarray(x[rt.tok], dtype=np.float32)
    p, c = xg.shape
    rows = w1s[0][0].shape[0]
    sdt = scale_like([s for _, s in w1s] + [s for _, s in w3s])
    table = _address_table([[a, b, d, e] for (a, b), (d, e) in zip(w1s, w3s, strict=True)])
    gate = np.empty((p, rows), np.float32)
    up = np.empty((p, rows), np.float32)
    qa, bias, da = _scratch(p, c)
    driver_for("pair", variant)(table, rt.lo, rt.hi, sdt, xg, q8.span(variant), gate, up, qa, bias, da)
    return gate, up


def down_sum(variant: str, h: np.ndarray, rt: Routing, w2s, wp: np.ndarray | None = None) -> np.ndarray:
    """Each token's weighted sum of its experts' down projections: h (P, I) float32 (the SwiGLU
    of each pair); w2s: per expert of rt.ids, (data (D, I/2) uint8, scale (D, I/32)) -> (T, D).
    wp (P,): the weights of the sum (default rt.wp; ones where h was weighted already)."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    p, c = h.shape
    d = w2s[0][0].shape[0]
    sdt = scale_like([s for _, s in w2s])
    table = _address_table([[a, b] for a, b in w2s])
    y = np.empty((p, d), np.float32)
    out = np.empty((rt.tp.shape[0], d), np.float32)
    qa, bias, da = _scratch(p, c)
    wp = rt.wp if wp is None else wp
    driver_for("down", variant)(table, rt.lo, rt.hi, sdt, h, q8.span(variant), wp, rt.tp, y, out, qa, bias, da)
    return out


_empty = np.empty  # swiglu_sum's buffers (a test fills them with NaN: every element must be written)


def swiglu_sum(variant: str, x: np.ndarray, rt: Routing, w1s, w3s, w2s, limit: float, pre_weight=False) -> np.ndarray:
    """`down_sum(glu(*pair_products(...)))` with `model.moe._glu`'s SwiGLU at `limit` (times each
    pair's weight before w2 where `pre_weight`, V4.1's order): the same bits in two driver calls
    with only numpy's exp between them, x's rows quantised once per token, the SwiGLU and the
    rounding of h in the second call's first parallel region. -> (T, D)."""
    t, c = x.shape
    p = rt.tok.size
    i = w1s[0][0].shape[0]
    sdt = scale_like([s for _, s in w1s] + [s for _, s in w3s] + [s for _, s in w2s])
    table = _address_table([[a, b, d, e, f, g] for (a, b), (d, e), (f, g) in zip(w1s, w3s, w2s, strict=True)])
    gate, up, ex, h = _empty((4, p, i), np.float32)
    y = _empty((p, w2s[0][0].shape[0]), np.float32)
    out = _empty((t, y.shape[1]), np.float32)
    lim, s = np.float32(limit), q8.span(variant)
    driver_for("gate_up", variant)(
        table, rt.lo, rt.hi, sdt, x, rt.tok, s, lim, gate, up, ex, *_scratch(t, c), *_scratch(p, c)
    )
    with np.errstate(over="ignore"):  # e^-gate above float32's range: inf, then h = -0 (`ops.silu`)
        np.exp(ex, out=ex)
    wp = np.ones_like(rt.wp) if pre_weight else rt.wp
    drive = driver_for("glu_down", variant)
    each = _per_expert(rt, numba.get_num_threads())
    drive(
        table, rt.lo, rt.hi, sdt, gate, up, ex, lim, rt.wp, pre_weight, s, wp, rt.tp, h, y, out, *_scratch(p, i), each
    )
    return out


def _per_expert(rt: Routing, threads: int) -> bool:
    """Whether `_drive_glu_down` runs expert by expert: when the experts split evenly over the
    threads (as many of each expert's pairs, as many experts on each thread: a decode step's
    6 experts at 1, 2, 3 or 6 threads). The SwiGLU of an expert's pairs then runs on the thread
    that multiplies them by its w2, with no parallel region between: at 2 threads each such
    region waits for both threads, which under load (other processes on the cores) is often
    the longest part (V4 one token, 2 threads, against the three regions, one process
    alternating, load 9: 1.34-1.36x per wall second; one thread the same). Elsewhere the pairs' SwiGLU is spread over the threads, then w2's row blocks,
    so unequal experts (a prompt's) do not leave a thread idle."""
    n = rt.hi - rt.lo
    return rt.ids.size % threads == 0 and (rt.tp.shape[0] == 1 or bool((n == n[0]).all()))


def _scratch(p: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return q8.scratch(p, c)


# ---------------------------------------------------------------- a layer, group by group ---

# Pairs per driver call: bounds the gathered rows (PAIR_ROWS, D) and the gate, up and SwiGLU
# temporaries ((PAIR_ROWS, I) float32 each) exactly as `model.moe.EXPERT_ROWS` bounds one
# expert's on the per-expert path (the same value), so a prefill segment holds no more than it
# did; a decode step's layer (k pairs a row) and a short prompt's fit in one call.
PAIR_ROWS = 256
_NO_PAIRS = np.zeros((0, 1), np.int64)  # tp of a down call that only fills y rows
_NO_EXPERTS = np.zeros((0, 2), np.int64)  # addr of a down call that only sums
_NONE = np.zeros(0, np.int64)
_NO_WEIGHTS = np.zeros(0, np.float32)


class Layer:
    """A layer's routed FP4 experts under `fast`: experts (T, k) int64 chosen with weights (T, k)
    float32 for rows x (T, C). The caller hands the experts in groups, each group's weights valid
    only while `group` runs (the expert store's pins); `total` then sums every token's pairs.

    A layer whose experts all come in the first group with at most PAIR_ROWS pairs takes two
    driver calls (`pair_products`, `down_sum`: `whole`; `swiglu_sum` where the layer knows glu's
    `limit`, with numpy's exp alone between the calls). Otherwise each group runs as calls over
    at most PAIR_ROWS pairs that fill rows of y (P, D), unweighted, and `total` sums them in one
    more call. Every row's bits are the same in any grouping (a pair's row depends only on its
    token row and its expert), and the sum runs per token in ascending (expert id, slot) order
    from zero, so the output is `down_sum`'s whatever the groups were. `put` takes an expert the
    drivers do not run (already weighted rows from the per-expert path, summed with weight 1:
    the same float32 value).

    `pre_weight` (V4.1, DeepSeek's reference order): each pair's SwiGLU row is multiplied by its
    routing weight before w2 (h *= w, float32, as V4.1's per-expert path does) and the sum adds the
    down rows unweighted (times 1.0: the same values), from zero in the same order."""

    def __init__(
        self,
        variant: str,
        x: np.ndarray,
        experts: np.ndarray,
        weights: np.ndarray,
        glu,
        count=None,
        pre_weight=False,
        limit: float | None = None,
    ) -> None:
        self.variant = variant
        self.pre_weight = pre_weight
        self.limit = limit  # glu is `model.moe._glu` at this limit: `whole` runs `swiglu_sum`
        self._count = count  # count(t0): called after each driver call with its perf_counter start
        self.x = np.ascontiguousarray(x, dtype=np.float32)
        self.rt = Routing(experts, weights)
        self.glu = glu
        self._j = {int(e): j for j, e in enumerate(self.rt.ids.tolist())}
        self._pos = np.full(self.rt.tok.size, -1, np.int64)  # y row of each pair (-1: not yet)
        self._wy = np.empty(self.rt.tok.size, np.float32)  # the weight of each y row
        self._y: np.ndarray | None = None
        self._filled = 0
        self._sdt: np.ndarray | None = None
        self.calls = 0  # driver calls so far (tests count them)

    @property
    def pairs(self) -> int:
        return self.rt.tok.size

    def whole(self, group) -> np.ndarray | None:
        """The layer's output (T, D) in two driver calls when `group` [(expert id, ExpertWeights)]
        is every chosen expert and the pairs fit one call; else None (run `group`, then `total`)."""
        rt = self.rt
        if self._filled or len(group) != rt.ids.size or rt.tok.size > PAIR_ROWS:
            return None
        es = [e for _, e in sorted(group, key=lambda g: g[0])]
        w1s, w2s, w3s = ([_parts(getattr(e, m)) for e in es] for m in ("w1", "w2", "w3"))
        fused = self.limit is not None and scale_like([s for _, s in w1s + w2s + w3s]) is not None

        def product() -> np.ndarray:
            if fused:
                return swiglu_sum(self.variant, self.x, rt, w1s, w3s, w2s, self.limit, self.pre_weight)
            gate, up = pair_products(self.variant, self.x, rt, w1s, w3s)
            h = self._weighted(self.glu(gate, up), rt.wp)
            return down_sum(self.variant, h, rt, w2s, np.ones_like(rt.wp) if self.pre_weight else None)

        self._filled = rt.tok.size
        return self._timed(2, sum(e.w1.nbytes for e in es), int((rt.hi - rt.lo).max()), product)

    def group(self, group) -> None:
        """Fill the y rows of the pairs of `group` [(expert id, ExpertWeights)], at most PAIR_ROWS
        pairs a call (an expert with more is split by its tokens)."""
        js = sorted(self._j[int(e)] for e, _ in group)
        by_j = {self._j[int(e)]: w for e, w in group}
        for chunk in _chunks(self.rt, js, PAIR_ROWS):
            self._rows(chunk, [by_j[j] for j, _, _ in chunk])

    def put(self, expert: int, rows: np.ndarray) -> None:
        """The rows (n, D) of `expert`'s pairs, already weighted (n = its pair count, pair order)."""
        j = self._j[int(expert)]
        a, b = int(self.rt.lo[j]), int(self.rt.hi[j])
        y = self._rows_for(b - a, rows.shape[1])
        y[:] = rows
        self._place(a, b, 1.0)

    def total(self) -> np.ndarray:
        """Each token's sum over its pairs (T, D), in ascending (expert id, slot) order."""
        missing = [int(e) for j, e in enumerate(self.rt.ids.tolist()) if self._pos[self.rt.lo[j]] < 0]
        if missing:
            raise ValueError(f"experts {missing} were never handed to the layer")
        tp = self._pos[self.rt.tp]
        out = np.empty((tp.shape[0], self._y.shape[1]), np.float32)
        sdt = U8_LIKE if self._sdt is None else self._sdt  # the signature the layer's calls compiled
        h = np.empty((0, q8.GROUP), np.float32)
        qa, bias, da = _scratch(0, q8.GROUP)
        drive = driver_for("down", self.variant)

        def product() -> None:
            drive(_NO_EXPERTS, _NONE, _NONE, sdt, h, q8.span(self.variant), self._wy, tp, self._y, out, qa, bias, da)

        self._timed(1, self._y.nbytes, 1, product)
        return out

    def _weighted(self, h: np.ndarray, wp: np.ndarray) -> np.ndarray:
        """h (n, I) times each row's routing weight wp (n,) where the layer weights before w2."""
        if self.pre_weight:
            h *= wp[:, None]
        return h

    def _timed(self, calls: int, nbytes: int, tokens: int, product):
        t0 = time.perf_counter()
        y = _run(nbytes, tokens, product)
        self.calls += calls
        if self._count is not None:
            self._count(t0)
        return y

    def _rows_for(self, n: int, d: int) -> np.ndarray:
        if self._y is None:
            self._y = np.empty((self.rt.tok.size, d), np.float32)
        return self._y[self._filled : self._filled + n]

    def _place(self, a: int, b: int, w: float | np.ndarray) -> None:
        n = b - a
        self._pos[a:b] = np.arange(self._filled, self._filled + n)
        self._wy[self._filled : self._filled + n] = w
        self._filled += n

    def _rows(self, chunk: list[tuple[int, int, int]], es) -> None:
        """One pair_products and one down call over chunk [(j, a, b)]: pairs a .. b of expert j."""
        rt = self.rt
        n = np.array([b - a for _, a, b in chunk], np.int64)
        sub = Routing.__new__(Routing)
        sub.hi = np.cumsum(n)
        sub.lo = sub.hi - n
        sub.ids = rt.ids[[j for j, _, _ in chunk]]
        sub.tok = np.concatenate([rt.tok[a:b] for _, a, b in chunk])
        w1s, w2s, w3s = ([_parts(getattr(e, m)) for e in es] for m in ("w1", "w2", "w3"))
        self._sdt = scale_like([s for _, s in w2s])
        y = self._rows_for(int(sub.hi[-1]), w2s[0][0].shape[0])

        wp = np.concatenate([rt.wp[a:b] for _, a, b in chunk])

        def product() -> None:
            gate, up = pair_products(self.variant, self.x, sub, w1s, w3s)
            down_rows(self.variant, self._weighted(self.glu(gate, up), wp), sub, w2s, y)

        self._timed(2, sum(e.w1.nbytes for e in es), int(n.max()), product)
        for _, a, b in chunk:
            self._place(a, b, 1.0 if self.pre_weight else rt.wp[a:b])


def _chunks(rt: Routing, js: list[int], cap: int) -> list[list[tuple[int, int, int]]]:
    """Experts js' pair ranges cut into calls of at most cap pairs: [[(j, a, b), ...], ...]."""
    out: list[list[tuple[int, int, int]]] = [[]]
    room = cap
    for j in js:
        a, hi = int(rt.lo[j]), int(rt.hi[j])
        while a < hi:
            if room == 0:
                out.append([])
                room = cap
            b = min(hi, a + room)
            out[-1].append((j, a, b))
            room -= b - a
            a = b
    return [c for c in out if c]


def down_rows(variant: str, h: np.ndarray, rt: Routing, w2s, y: np.ndarray) -> None:
    """y (P, D) = the pairs' rows h (P, I) times w2 of their expert, unweighted and unsummed
    (`down_sum`'s first half: `Layer.total` sums them)."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    p, c = h.shape
    sdt = scale_like([s for _, s in w2s])
    table = _address_table([[a, b] for a, b in w2s])
    qa, bias, da = _scratch(p, c)
    out = np.empty((0, y.shape[1]), np.float32)
    drive = driver_for("down", variant)
    drive(table, rt.lo, rt.hi, sdt, h, q8.span(variant), _NO_WEIGHTS, _NO_PAIRS, y, out, qa, bias, da)


# ---------------------------------------------------------------- one expert, for model.moe --

_variants: dict[tuple, str | None] = {}


def variant_of(e, backend: str, fast_variant) -> str | None:
    """The variant an expert's three FP4 matrices (e.w1, e.w2, e.w3: QWeights) run on here under
    `fast` numerics beside the exact backend named `backend`, or None (they go through
    `kernels.matmul` as before); fast_variant(w) is `kernels.fast_variant` (handed in: this
    module does not import the package above it)."""
    ws = (e.w1, e.w2, e.w3)
    if any(w.kind != "fp4" or w.on_device for w in ws):
        return None
    # the exact backend is in the key: under the numpy reference `fast_variant` is None
    key = (backend, *((w.cols, w.data.flags.c_contiguous, w.scale.dtype.str) for w in ws))
    v = _variants.get(key, False)
    if v is False:
        vs = {fast_variant(w) for w in ws}
        one_scale = scale_like([w.scale for w in ws]) is not None
        v = _variants[key] = vs.pop() if len(vs) == 1 and one_scale else None
    return v


def _u8(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8) if a.dtype != np.uint8 else a


def _parts(w) -> tuple[np.ndarray, np.ndarray]:
    s = w.scale if w.scale.dtype.itemsize == 4 else _u8(w.scale)
    return _u8(w.data), np.ascontiguousarray(s)


def _run(nbytes: int, tokens: int, product):
    """product() with the kernel threads `kernels.set_threads` asked for, or alone on this
    thread for a small weight at a few tokens (results do not depend on the thread count)."""
    jit._apply_threads()
    return alone_if_small(nbytes, tokens, product)
