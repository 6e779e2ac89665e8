"""The int8 head: int8 weight rows (one float32 scale per row) times int8 activations.

The `fast` numerics' logits when the packed trunk holds an int8 copy of the head
(`trunkpack.headcopy` writes it): the head is the largest read of a token (vocab x dim BF16,
1.06 GB on V4-Flash), and int8 halves it.

Weights (`trunkpack.headcopy.quantize_rows` writes them): per row, s = fl32(absmax / 127) and
q = rint(w / s) in [-127, 127] (never -128: |q| fits the unsigned operand below).
Activations (`quantize`): per 32 columns, d = fl32(absmax / 127), q = rint(x / d) clipped to
[-127, 127]; a zero group has d = 0, a group holding a NaN or an infinity d = NaN (so every
logit it meets is NaN, as the float product would be NaN or infinite).

A group of 32 is summed exactly in int32 on the sign trick (what llama.cpp's Q8_0 does):
|w| as an unsigned byte times a carrying w's sign, so the operands fit the unsigned x signed
byte products:
- AVX-512 VNNI: `vpdpbusd` (4 products into an int32 lane, no saturation), 64 columns a step;
- AVX2: `vpmaddubsw` (pairs into int16: 2 * 127 * 127 < 32767, no saturation) then `vpmaddwd`
  by ones, 32 columns a step;
- anything else: the same integer sums in plain numba loops (for tests: a fast run on such a CPU
  reads the BF16 head through the exact kernels, `head.copy_runs`).
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
TOKENS = (4, 2, 1)  # token groups per row call: every token runs the same code
ROWS = 16  # rows per work item (a row is re-read from L1 by each token group)
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
def _quantize(x, qa, da):
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


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """X (T, C) float32 -> (int8 (T, C), float32 scale (T, C/32))."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    t, c = x.shape
    qa = np.empty((t, c), np.int8)
    da = np.empty((t, c // GROUP), np.float32)
    _quantize(x, qa, da)
    return qa, da


# ---------------------------------------------------------------- the row kernels ------------


def _row_intrinsic(variant: str, T: int):
    """Row r of w (scale sw) times tokens t0 .. t0+T: out[t, r] for each."""
    VB = 64 if variant == "avx512" else 32  # columns (bytes) per step
    L = VB // 4  # int32 / float lanes
    G = VB // GROUP  # groups per step

    def typer(typingctx, w, sw, r, qa, da, t0, out):
        sig = types.void(w, sw, r, qa, da, t0, out)

        def codegen(context, builder, sig, args):
            w_, sw_, r_, qa_, da_, t0_, out_ = args
            tw, tsw, tr, tqa, tda, tt0, tout = sig.args
            C = simd.shape(context, builder, tw, w_, 1)
            ng = builder.udiv(C, c64(GROUP))
            R = simd.shape(context, builder, tout, out_, 1)
            r = simd.index(context, builder, r_, tr)
            t0 = simd.index(context, builder, t0_, tt0)
            wrow = builder.gep(simd.base(context, builder, tw, w_, I8), [builder.mul(r, C)])
            swb = simd.base(context, builder, tsw, sw_, F32)
            qab = simd.base(context, builder, tqa, qa_, I8)
            dab = simd.base(context, builder, tda, da_, F32)
            outb = simd.base(context, builder, tout, out_, F32)
            tokens = [builder.add(t0, c64(t)) for t in range(T)]
            qrow = [builder.gep(qab, [builder.mul(tk, C)]) for tk in tokens]
            drow = [builder.gep(dab, [builder.mul(tk, ng)]) for tk in tokens]
            vb = vec(I8, VB)
            if variant == "avx512":
                dot = simd.declare(builder, "llvm.x86.avx512.vpdpbusd.512", vec(I32, 16), [vec(I32, 16), vb, vb])
            else:
                maddubs = simd.declare(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [vb, vb])
                maddwd = simd.declare(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [vec(I16, 16), vec(I16, 16)])
                ones = simd.splat(I16, 16, 1)
            zero8 = simd.splat(I8, VB, 0)
            spread = ir.Constant(vec(I32, L), [lane // 8 for lane in range(L)])  # 8 lanes per group
            acc = [[cgutils.alloca_once_value(builder, simd.splat(F32, L, 0.0)) for _ in range(2)] for _ in range(T)]

            def step(col, k):
                grp = builder.udiv(col, c64(GROUP))
                wv = simd.load(builder, wrow, col, vb)
                neg = builder.icmp_signed("<", wv, zero8)
                wabs = builder.select(neg, builder.sub(zero8, wv), wv)  # |w| <= 127: an unsigned byte
                for t in range(T):
                    a = simd.load(builder, qrow[t], col, vb)
                    sa = builder.select(neg, builder.sub(zero8, a), a)  # a with w's sign: |w| * sa = w * a
                    if variant == "avx512":
                        iv = builder.call(dot, [ir.Constant(vec(I32, L), [0] * L), wabs, sa])
                    else:
                        iv = builder.call(maddwd, [builder.call(maddubs, [wabs, sa]), ones])
                    dv = simd.load(builder, drow[t], grp, vec(F32, G), align=4)
                    scl = builder.shuffle_vector(dv, dv, spread)
                    a_ = acc[t][k]
                    builder.store(simd.fma(builder, builder.sitofp(iv, vec(F32, L)), scl, builder.load(a_), L), a_)

            with cgutils.for_range(builder, builder.udiv(C, c64(2 * VB))) as loop:
                for k in range(2):
                    step(builder.add(builder.mul(loop.index, c64(2 * VB)), c64(VB * k)), k)
            tail = builder.urem(C, c64(2 * VB))  # one step left (a width of 64 mod 128 on AVX-512)
            with builder.if_then(builder.icmp_unsigned("!=", tail, c64(0))):
                step(builder.sub(C, c64(VB)), 0)
            srow = builder.load(builder.gep(swb, [r]))
            for t in range(T):
                total = simd.hsum(builder, builder.fadd(builder.load(acc[t][0]), builder.load(acc[t][1])), L)
                builder.store(builder.fmul(total, srow), builder.gep(outb, [builder.add(builder.mul(tokens[t], R), r)]))
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = typer.__qualname__ = f"_headq8_{variant}_t{T}"
    return intrinsic(typer)


_row4 = _row2 = _row1 = None  # the row kernels `_driver` binds in each variant's globals


def _drive(w, sw, qa, da, out):
    """Rows in work items of ROWS (prange), tokens in groups of 4, 2, 1 within each."""
    R = w.shape[0]
    T = qa.shape[0]
    for ib in prange((R + ROWS - 1) // ROWS):
        r0 = ib * ROWS
        r1 = min(R, r0 + ROWS)
        t0 = 0
        while t0 < T:
            if T - t0 >= 4:
                for r in range(r0, r1):
                    _row4(w, sw, r, qa, da, t0, out)
                t0 += 4
            elif T - t0 >= 2:
                for r in range(r0, r1):
                    _row2(w, sw, r, qa, da, t0, out)
                t0 += 2
            else:
                for r in range(r0, r1):
                    _row1(w, sw, r, qa, da, t0, out)
                t0 += 1


def _driver(variant: str):
    """`_drive` compiled with `variant`'s row kernels, as a function object of its own named after
    the variant and simd.py's hash (numba's cache keys an entry by name, signature and CPU;
    `q8._driver` says why it cannot be a closure)."""
    g = dict(globals())
    g["_row4"], g["_row2"], g["_row1"] = (_row_intrinsic(variant, t) for t in TOKENS)
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
    qa, da = quantize(x)
    out = np.empty((qa.shape[0], q.shape[0]), np.float32)
    _driver_for(v or variant())(q, s, qa, da, out)
    return out


def reference(q: np.ndarray, s: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The float64 value of what `matmul` computes (same roundings of x, exact sums): for tests."""
    qa, da = quantize(np.atleast_2d(x))
    t, c = qa.shape
    xa = (qa.astype(np.float64).reshape(t, -1, GROUP) * da.astype(np.float64)[:, :, None]).reshape(t, c)
    return (xa @ q.astype(np.float64).T) * s.astype(np.float64)[None, :]
