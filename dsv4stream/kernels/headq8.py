"""The int8 head: int8 weight rows (one float32 scale per row) times int8 activations.

The `fast` numerics' logits when the packed trunk holds an int8 copy of the head
(`trunkpack.headcopy` writes it): the head is the largest read of a token (vocab x dim BF16,
1.06 GB on V4-Flash), and int8 halves it.

Weights (`trunkpack.headcopy.quantize_rows` writes them): per row, s = fl32(absmax / 127) and
q = rint(w / s) in [-127, 127] (never -128: |q| fits the unsigned operand below).
Activations (`quantize`): per 32 columns, d = fl32(absmax / 127), q = rint(x / d) clipped to
[-127, 127]; a zero group has d = 0, a group holding a NaN or an infinity d = NaN (so every
logit it meets is NaN, as the float product would be NaN or infinite).

A group of 32 is summed exactly in int32 on unsigned x signed byte products:
- AVX-512 VNNI: `vpdpbusd` (4 products into an int32 lane, no saturation), 64 columns a step, on
  w + 128 (w xor 0x80, an unsigned byte) times a, the lane starting at -128 * (its 4 a's sum),
  which `prepare` computes once per token: the lane ends at sum(w * a) exactly;
- AVX2: `vpmaddubsw` (pairs into int16) then `vpmaddwd` by ones, 32 columns a step, on the sign
  trick (what llama.cpp's Q8_0 does: |w| times a carrying w's sign; 2 * 127 * 127 < 32767, where
  (w + 128) * a pairs would saturate);
- anything else: the same integer sums in plain numba loops (for tests: a fast run on such a CPU
  reads the BF16 head through the exact kernels, `head.copy_runs`).
Rows are read NR_OF[T] at a time (several streams), the next rows prefetched (`_rows_intrinsic`);
each thread of the prange takes one contiguous share of the rows.
Float order (fixed, so a row's bits depend only on that row and its token's activations, not on
the thread count, the rows or the other tokens of the call): each step's int32 lanes are
converted and FMA-added times their group's d into one of two float32 accumulators
(alternating steps), the lanes summed in a fixed tree, the sum multiplied by the row's s.
The variants agree to float32 rounding (their lane splits differ), not bit for bit.
"""

from __future__ import annotations

import types as pytypes

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# jit: imported for its side effect, numba's cache locator for the kernels below (`jit.cache_dir`)
from . import cpu, jit, simd  # noqa: F401
from .simd import F32, I8, I16, I32, c64, vec

GROUP = 32
TOKENS = (4, 3, 2, 1)  # token groups per row call: every token runs the same code
ROWS = 16  # rows per work item (re-read from L2 by each token group)
NR_OF = {4: 4, 3: 4, 2: 4, 1: 4}  # rows per kernel call by token group (4 x 4 x 2 accumulators: a few spill to L1)
NR4, NR3, NR2, NR1 = (NR_OF[t] for t in TOKENS)
# One token, rows of at most this many columns: one row a call, read straight through. NR1 rows
# of 1 KB side by side (V4's wq_b, 32768 x 1024) read at 9.8-10.5 GB per CPU-second from DRAM
# on a Zen 3 core, one at a time 14.0-14.4 (2048 columns 12.2-13.2 -> 13.8; 8192 unchanged).
NARROW = 2048
_JIT = {"cache": True, "fastmath": False, "error_model": "numpy", "boundscheck": False}


def variant() -> str:
    """'avx512', 'avx2' or 'plain' for the CPU target numba compiles for: the features the FP4 x
    int8 kernels need are these kernels' too (VNNI; AVX2 + FMA), so `cpu.variant("fp4")` decides."""
    return cpu.variant("fp4") or "plain"


def supports(cols: int) -> bool:
    """Whether the kernels take this width (whole 64-column AVX-512 steps)."""
    return cols % 64 == 0


# ---------------------------------------------------------------- weights and activations ----


@njit(**_JIT)
def _quantize(x, qa, da, xc):
    """qa, da as `quantize` says; per lane of 4 columns j: xc[t, j] = -128 * the sum of its 4
    int8 values (the AVX-512 rows' starting accumulator)."""
    T, C = x.shape
    for t in range(T):
        for g in range(C // GROUP):
            c0 = g * GROUP
            amax = np.float32(0.0)
            finite = True
            for k in range(GROUP):
                v = x[t, c0 + k]
                amax = max(amax, abs(v))
                finite = finite and not np.isnan(v)  # max() may drop a NaN
            finite = finite and amax <= np.float32(3.4028234663852886e38)
            d = np.float32(amax / np.float32(127.0))
            for k in range(GROUP):
                if finite and d > 0:
                    v = min(max(np.rint(np.float32(x[t, c0 + k] / d)), np.float32(-127.0)), np.float32(127.0))
                    qa[t, c0 + k] = np.int8(v)
                else:
                    qa[t, c0 + k] = 0
            da[t, g] = d if finite else np.float32(np.nan)
            for j in range(c0 // 4, (c0 + GROUP) // 4):
                xc[t, j] = -128 * (np.int32(qa[t, 4 * j]) + qa[t, 4 * j + 1] + qa[t, 4 * j + 2] + qa[t, 4 * j + 3])


def prepare(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """X (T, C) float32 -> (int8 (T, C), float32 scale (T, C/32), int32 (T, C/4)):
    the activations as `_quantize` lays them out for the row kernels."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    t, c = x.shape
    qa = np.empty((t, c), np.int8)
    da = np.empty((t, c // GROUP), np.float32)
    xc = np.empty((t, c // 4), np.int32)
    _quantize(x, qa, da, xc)
    return qa, da, xc


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """X (T, C) float32 -> (int8 (T, C), float32 scale (T, C/32))."""
    return prepare(x)[:2]


# ---------------------------------------------------------------- the row kernels ------------


def _rows_intrinsic(variant: str, T: int, NR: int):
    """Rows r .. r+NR of w (scales sw) times tokens t0 .. t0+T: out[t, r + i] for each.

    The NR rows are read side by side (NR streams: one row of 4 KB is one page, and the hardware
    prefetcher restarts at every page), each step also prefetching the same columns of the next
    NR rows (the next call's, contiguous after these). Each row keeps its own accumulators and
    order, so a row's bits do not depend on NR or on the prefetch.

    AVX-512 multiplies w + 128 (w xor 0x80, an unsigned byte) by the signed activations, the
    accumulator starting at the token's -128 * (sum of the lane's 4 activations) (`prepare`):
    the same exact int32 as |w| times a carrying w's sign, in two instructions a row instead of
    five. AVX2's `vpmaddubsw` would saturate (w + 128) * a in int16, so it keeps the sign trick."""
    VB = 64 if variant == "avx512" else 32  # columns (bytes) per step
    L = VB // 4  # int32 / float lanes: lane j of a step sums its columns 4j .. 4j+3

    def typer(typingctx, w, sw, r0, xq, xc, da, t0, out):
        sig = types.void(w, sw, r0, xq, xc, da, t0, out)

        def codegen(context, builder, sig, args):
            w_, sw_, r0_, xq_, xc_, da_, t0_, out_ = args
            tw, tsw, tr, txq, txc, tda, tt0, tout = sig.args
            C = simd.shape(context, builder, tw, w_, 1)
            R = simd.shape(context, builder, tw, w_, 0)
            C4 = builder.udiv(C, c64(4))
            r0 = simd.index(context, builder, r0_, tr)
            t0 = simd.index(context, builder, t0_, tt0)
            wb = simd.base(context, builder, tw, w_, I8)
            rows = [builder.add(r0, c64(i)) for i in range(NR)]
            wrow = [builder.gep(wb, [builder.mul(r, C)]) for r in rows]
            last = builder.sub(R, c64(1))
            ahead = []  # the next call's rows (the last row where they run past it)
            for i in range(NR):
                r = builder.add(r0, c64(NR + i))
                r = builder.select(builder.icmp_unsigned("<", r, R), r, last)
                ahead.append(builder.gep(wb, [builder.mul(r, C)]))
            swb = simd.base(context, builder, tsw, sw_, F32)
            outb = simd.base(context, builder, tout, out_, F32)
            tokens = [builder.add(t0, c64(t)) for t in range(T)]
            qrow = [builder.gep(simd.base(context, builder, txq, xq_, I8), [builder.mul(tk, C)]) for tk in tokens]
            crow = [builder.gep(simd.base(context, builder, txc, xc_, I32), [builder.mul(tk, C4)]) for tk in tokens]
            G = builder.udiv(C, c64(GROUP))
            drow = [builder.gep(simd.base(context, builder, tda, da_, F32), [builder.mul(tk, G)]) for tk in tokens]
            vb = vec(I8, VB)
            pf = builder.module.declare_intrinsic(
                "llvm.prefetch.p0", (), ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
            )
            if variant == "avx512":
                dot = simd.declare(builder, "llvm.x86.avx512.vpdpbusd.512", vec(I32, 16), [vec(I32, 16), vb, vb])
                flip = simd.splat(I8, VB, -128)
            else:
                maddubs = simd.declare(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [vb, vb])
                maddwd = simd.declare(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [vec(I16, 16), vec(I16, 16)])
                ones = simd.splat(I16, 16, 1)
                zero8 = simd.splat(I8, VB, 0)
            acc = [
                [[cgutils.alloca_once_value(builder, simd.splat(F32, L, 0.0)) for _ in range(2)] for _ in range(T)]
                for _ in range(NR)
            ]

            def _scales(dptr, g):
                # the step's groups' d (lanes 0..7 group g, 8..15 group g + 1 on AVX-512), broadcast
                # from the token's (C/32) scales: a few hundred bytes a token stay in L1
                n = VB // GROUP
                d = simd.load(builder, dptr, g, vec(F32, n), align=4)
                mask = ir.Constant(ir.VectorType(I32, L), [j // 8 for j in range(L)])
                return builder.shuffle_vector(d, d, mask)

            def step(col, k):
                lane = builder.udiv(col, c64(4))
                for i in range(NR):
                    ptr = builder.gep(ahead[i], [col])
                    builder.call(pf, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
                wv = [simd.load(builder, wrow[i], col, vb) for i in range(NR)]
                if variant == "avx512":
                    wu = [builder.xor(v, flip) for v in wv]  # w + 128 as an unsigned byte
                else:
                    neg = [builder.icmp_signed("<", v, zero8) for v in wv]
                    wabs = [builder.select(n, builder.sub(zero8, v), v) for n, v in zip(neg, wv, strict=True)]
                for t in range(T):
                    a = simd.load(builder, qrow[t], col, vb)
                    scl = _scales(drow[t], builder.udiv(col, c64(GROUP)))
                    if variant == "avx512":
                        c = simd.load(builder, crow[t], lane, vec(I32, L), align=4)
                    for i in range(NR):
                        if variant == "avx512":
                            iv = builder.call(dot, [c, wu[i], a])
                        else:
                            sa = builder.select(neg[i], builder.sub(zero8, a), a)  # |w| * sa = w * a
                            iv = builder.call(maddwd, [builder.call(maddubs, [wabs[i], sa]), ones])
                        a_ = acc[i][t][k]
                        builder.store(simd.fma(builder, builder.sitofp(iv, vec(F32, L)), scl, builder.load(a_), L), a_)

            with cgutils.for_range(builder, builder.udiv(C, c64(2 * VB))) as loop:
                for k in range(2):
                    step(builder.add(builder.mul(loop.index, c64(2 * VB)), c64(VB * k)), k)
            tail = builder.urem(C, c64(2 * VB))  # one step left (a width of 64 mod 128 on AVX-512)
            with builder.if_then(builder.icmp_unsigned("!=", tail, c64(0))):
                step(builder.sub(C, c64(VB)), 0)
            for i in range(NR):
                srow = builder.load(builder.gep(swb, [rows[i]]))
                for t in range(T):
                    total = simd.hsum(builder, builder.fadd(builder.load(acc[i][t][0]), builder.load(acc[i][t][1])), L)
                    at = builder.add(builder.mul(tokens[t], R), rows[i])
                    builder.store(builder.fmul(total, srow), builder.gep(outb, [at]))
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = typer.__qualname__ = f"_headq8_{variant}_t{T}_r{NR}"
    return intrinsic(typer)


# the row kernels `bind_rows` binds in each variant's globals: _rowsT (NR_OF[T] rows), _oneT (one row)
_rows4 = _rows3 = _rows2 = _rows1 = _one4 = _one3 = _one2 = _one1 = None


def _item(w, sw, r0, r1, xq, xc, da, out):
    """Rows r0 .. r1 (one work item) times every token, in groups of 4, 3, 2, 1, a group's rows
    NR_OF[T] at a time (the rest of a short item one by one). da: the tokens' scales per 32
    columns (`trunkq8` passes them times its weight's column block factors)."""
    T = xq.shape[0]
    t0 = 0
    while t0 < T:
        r = r0
        if T - t0 >= 4:
            while r + NR4 <= r1:
                _rows4(w, sw, r, xq, xc, da, t0, out)
                r += NR4
            for ri in range(r, r1):
                _one4(w, sw, ri, xq, xc, da, t0, out)
            t0 += 4
        elif T - t0 == 3:
            while r + NR3 <= r1:
                _rows3(w, sw, r, xq, xc, da, t0, out)
                r += NR3
            for ri in range(r, r1):
                _one3(w, sw, ri, xq, xc, da, t0, out)
            t0 += 3
        elif T - t0 >= 2:
            while r + NR2 <= r1:
                _rows2(w, sw, r, xq, xc, da, t0, out)
                r += NR2
            for ri in range(r, r1):
                _one2(w, sw, ri, xq, xc, da, t0, out)
            t0 += 2
        else:
            while r + NR1 <= r1 and w.shape[1] > NARROW:
                _rows1(w, sw, r, xq, xc, da, t0, out)
                r += NR1
            for ri in range(r, r1):
                _one1(w, sw, ri, xq, xc, da, t0, out)
            t0 += 1


def _drive(w, sw, xq, xc, da, out):
    """Rows in work items of ROWS (prange: each thread one contiguous share), `_item` each."""
    R = w.shape[0]
    for ib in prange((R + ROWS - 1) // ROWS):
        _item(w, sw, ib * ROWS, min(R, ib * ROWS + ROWS), xq, xc, da, out)


def bind_rows(variant: str, g: dict) -> None:
    """`_item` over `variant`'s row kernels (`_rowsT`: NR_OF[T] rows, `_oneT`: one row) into the
    globals g of a driver (this module's `_drive`, `trunkq8`'s)."""
    gi = dict(globals())
    for t in TOKENS:
        gi[f"_rows{t}"] = _rows_intrinsic(variant, t, NR_OF[t])
        gi[f"_one{t}"] = _rows_intrinsic(variant, t, 1)
    g["_item"] = njit(inline="always", **_JIT)(pytypes.FunctionType(_item.__code__, gi, "_item"))


def _driver(variant: str):
    """`_drive` compiled with `variant`'s row kernels, as a function object of its own named after
    the variant and simd.py's hash (numba's cache keys an entry by name, signature and CPU;
    `q8._driver` says why it cannot be a closure)."""
    g = dict(globals())
    bind_rows(variant, g)
    f = pytypes.FunctionType(_drive.__code__, g, f"headq8_{variant}_{simd.STAMP}")
    f.__qualname__ = f.__name__
    return njit(parallel=True, **_JIT)(f)


@njit(parallel=True, **_JIT)
def _plain(w, sw, qa, da, out):
    """The same integer group sums as the SIMD rows, on any CPU, each times its d and added in
    column order into two float32 sums (a 64-column step's two groups alternate, as AVX-512's
    steps do); it rounds as the SIMD rows do up to the order of the float32 sums."""
    R, C = w.shape
    T = qa.shape[0]
    for r in prange(R):
        for t in range(T):
            acc0 = np.float32(0.0)
            acc1 = np.float32(0.0)
            for g in range(C // GROUP):
                s = 0
                for k in range(g * GROUP, (g + 1) * GROUP):
                    s += np.int32(w[r, k]) * np.int32(qa[t, k])
                p = np.float32(np.float32(s) * da[t, g])
                if (g // 2) % 2 == 0:
                    acc0 = np.float32(acc0 + p)
                else:
                    acc1 = np.float32(acc1 + p)
            out[t, r] = np.float32(np.float32(acc0 + acc1) * sw[r])


_DRIVERS: dict[str, object] = {}


def _driver_for(v: str):
    if v == "plain":
        return _plain
    if v not in _DRIVERS:
        _DRIVERS[v] = _driver(v)
    return _DRIVERS[v]


# ---------------------------------------------------------------- the product ----------------


def matmul(q: np.ndarray, s: np.ndarray, x: np.ndarray, threads: int | None = None, v: str | None = None) -> np.ndarray:
    """X (T, C) float32 times the int8 head (q (R, C) int8, s (R,) float32) -> (T, R) float32."""
    x = np.atleast_2d(x)
    if not supports(q.shape[1]) or x.shape[1] != q.shape[1]:
        raise ValueError(f"int8 head of {q.shape[1]} columns (a multiple of 64) against input of {x.shape[1]}")
    if threads is not None:
        numba.set_num_threads(threads)
    qa, da, xc = prepare(x)
    out = np.empty((qa.shape[0], q.shape[0]), np.float32)
    v = v or variant()
    if v == "plain":
        _plain(q, s, qa, da, out)
    else:
        _driver_for(v)(q, s, qa, xc, da, out)
    return out


def reference(q: np.ndarray, s: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The float64 value of what `matmul` computes (same roundings of x, exact sums): for tests."""
    qa, da = quantize(np.atleast_2d(x))
    t, c = qa.shape
    xa = (qa.astype(np.float64).reshape(t, -1, GROUP) * da.astype(np.float64)[:, :, None]).reshape(t, c)
    return (xa @ q.astype(np.float64).T) * s.astype(np.float64)[None, :]
