"""FP4 (E2M1, one E8M0 scale per 32) weights times int8 activations: the `fast` expert product.

Activations are quantised per 32 columns (`quantize`): d = fl32(absmax / 127), q = rint(x / d)
(IEEE float32 division, round half to even), clipped to [-127, 127]. An all-zero group has
d = 0 and q = 0; a group holding a NaN or an infinity gets d = NaN, so every output it meets is
NaN (as the float32 product would be NaN or infinite). The int8 values are stored permuted per
span of S columns (S = 128 for AVX-512, 64 for AVX2): the span's even columns, then its odd
ones, so they line up with the packed nibbles (low nibble = even column). Each group's
-12 * sum(q) is stored as the 4 int32 lanes the kernel starts from, and every array the kernel
reads per token starts on a 64-byte boundary (`scratch`).

Weights are decoded by a byte shuffle to 2 * e2m1 + 12 in [0, 24] (an unsigned byte), then
- AVX-512 VNNI: `vpdpbusd` adds u8 x s8 products of 4 bytes into int32 lanes;
- AVX2: `vpmaddubsw` (pairs into int16: |24 * 127 * 2| < 32767, no saturation) then
  `vpmaddwd` by ones into int32 lanes.
Each group of 32 lands in 4 int32 lanes, started at -12 * sum(q) in its first lane: exact.
Float order (fixed, so a row's bits depend only on that row and its token's activations): per
lane, float(int32) * (weight scale * d / 2) is FMA-added into one of two float32 accumulators
(alternating spans), and the lanes are summed in a fixed tree at the end. Every token runs the
same instruction sequence, whichever other tokens share the call, in token groups of 4, 2, 1.
Where the time went (issue 44): weights stream from memory at one 64-byte step per vector loop
turn, so what a step costs besides its two dot products decides the rate. The weight scale times
d / 2 is one multiply per token per 4 steps (not per step), the E8M0 bytes become float32 by a
shift inside the loop (not a table per row beforehand), and the starting lanes are loaded, not
built: 512x4096 in L2, one thread, one token, 14.6 -> about 20 GB of weight per CPU-second.
Each step also prefetches its row 4 KB ahead (`PREFETCH`: from DRAM it measured 1.45x).
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
_E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12)
_TABLE = [12 + (_E2M1_X2[c & 7] if c < 8 else -_E2M1_X2[c & 7]) for c in range(16)]  # 2*e2m1 + 12
# E8M0 byte -> float32 2^(b - 127) (0 -> 2^-127, a float32 subnormal; 0xFF -> NaN)
E8M0 = np.exp2(np.arange(256) - 127.0)
E8M0[255] = np.nan
E8M0 = E8M0.astype(np.float32)
TOKENS = (4, 2, 1)  # token groups per kernel call: every token runs the same code
ROWS = 16  # rows per work item (weights re-read from L1 across token groups)
_JIT = {"cache": True, "fastmath": False, "error_model": "numpy", "boundscheck": False}


def span(variant: str) -> int:
    """Columns one vector step covers: the activation permutation's period."""
    return 128 if variant == "avx512" else 64


def supports(cols: int) -> bool:
    """Whether the fast kernel takes this width (two spans per loop step)."""
    return cols % 256 == 0


# ---------------------------------------------------------------- activations ----------------


@njit(**_JIT)
def _quantize(x, S, qa, bias, da):
    """x (T, C) float32 -> qa int8 (T, C) permuted, bias int32 (T, C/8), da float32 (T, C/32).
    Per group: the 32 quotients rounded and clipped into a small buffer first (a loop LLVM
    vectorises: 4096 columns 21.6 -> 15.3 us, same bits), then 16 even columns to one
    contiguous run of qa and 16 odd ones to another. bias holds 4 int32 lanes per group,
    -12 * sum(q) in the first and 0 in the others: the row kernel's starting lanes, loaded as
    they are (`_row_intrinsic`)."""
    T, C = x.shape
    half = S // 2
    tmp = np.empty(GROUP, np.float32)
    big = np.float32(3.4028234663852886e38)
    for t in range(T):
        for g in range(C // GROUP):
            c0 = g * GROUP
            amax = np.float32(0.0)
            finite = True
            for k in range(GROUP):
                a = abs(x[t, c0 + k])
                finite &= a <= big  # False for inf and NaN
                amax = a if a > amax else amax  # noqa: FURB136 (a NaN is caught by finite)
            d = np.float32(amax / np.float32(127.0))
            base = c0 - c0 % S + (c0 % S) // 2
            total = 0
            if finite and d > 0:
                for k in range(GROUP):
                    tmp[k] = min(max(np.rint(np.float32(x[t, c0 + k] / d)), np.float32(-127.0)), np.float32(127.0))
                for k in range(GROUP // 2):
                    qa[t, base + k] = np.int8(tmp[2 * k])
                    qa[t, base + half + k] = np.int8(tmp[2 * k + 1])
                    total += np.int32(tmp[2 * k]) + np.int32(tmp[2 * k + 1])
            else:
                for k in range(GROUP // 2):
                    qa[t, base + k] = 0
                    qa[t, base + half + k] = 0
            bias[t, 4 * g] = -12 * total
            bias[t, 4 * g + 1] = 0
            bias[t, 4 * g + 2] = 0
            bias[t, 4 * g + 3] = 0
            da[t, g] = np.float32(d * np.float32(0.5)) if finite else np.float32(np.nan)


def scratch(t: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_quantize`'s outputs for t rows of c columns: (qa, bias, da), each C-contiguous from a
    64-byte boundary, cut from one buffer (one address lookup, ~1.5 us, not three: a decode step
    makes ~100 of these). A 64-byte vector load that spans two cache lines costs two
    (activations at a 16-byte offset: 512x4096 in L2, one thread, 4 tokens 9.0 against 5.4 GB
    of weight per CPU-second)."""
    nq, nb, nd = t * c, t * (c // 8) * 4, t * (c // GROUP) * 4
    sb = -(-nq // 64) * 64  # each part starts on the next 64-byte boundary
    sd = sb + -(-nb // 64) * 64
    raw = np.empty(sd + nd + 64, np.uint8)
    a = -raw.__array_interface__["data"][0] % 64
    return (
        raw[a : a + nq].view(np.int8).reshape(t, c),
        raw[a + sb : a + sb + nb].view(np.int32).reshape(t, c // 8),
        raw[a + sd : a + sd + nd].view(np.float32).reshape(t, c // GROUP),
    )


def quantize(x: np.ndarray, variant: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """X (T, C) -> (permuted int8 values, the kernel's starting lanes (-12 * group sums), scale / 2
    per group) for `variant`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    t, c = x.shape
    qa, bias, da = scratch(t, c)
    _quantize(x, span(variant), qa, bias, da)
    return qa, bias, da


def quantize_values(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The unpermuted (q int8 (T, C), d float32 (T, C/32)) of `quantize`: for tests and errors."""
    qa, _, da = quantize(x, "avx2")
    c = qa.shape[1]
    p = np.arange(c) % 64
    src = np.arange(c) - p + (p & 1) * 32 + p // 2
    return qa[:, src], da * np.float32(2.0)


# ---------------------------------------------------------------- the row kernel -------------

# Bytes ahead of its step that each step prefetches in the weight (and its scales: a 16th as
# far). Keep it: without the prefetches the experts from DRAM ran at 7.5 against 10.9 GB per
# CPU-second (one thread, one token; 6.4 against 9.4 at 7 tokens; one process, load 3). Their
# distance measured no difference from 1 byte to 32 KB (any locality): what they buy is not
# yet understood (measured, not explained). Issue 44, later (512 MB of 4096-wide rows from
# DRAM, one thread, one token, variants alternating in one process, load 1.8-2.7): no prefetch
# 7.9, 64 bytes ahead 8.2, 1 KB 9.9, 4 KB 12.0 GB per CPU-s, a plain read of the same bytes
# 15.2; into L2 (`LOCALITY` 2, prefetcht1) rather than L1 (3, prefetcht0) 5-10 % more in each
# of four runs (4 KB: 12.1 -> 13.1, 10.8 -> 11.1, 7.9 -> 8.4; 6 KB 11.3 against 4 KB's 10.8).
PREFETCH = 4096
LOCALITY = 2


def _row_intrinsic(variant: str, T: int):
    """Row r of w times tokens t0 .. t0+T: out[t, r] for each. s: the weight's scales, E8M0
    bytes or float32; row sr of s is row r's.

    A block of 4 steps (2 * VB * 4 columns: 16 groups for AVX-512, 8 for AVX2) loads its weight
    scales and each token's d / 2 once and multiplies them (one vector multiply per token); each
    step spreads its groups' products over their 4 lanes (`vpermps`), starts its int32 lanes from
    the token's `bias` lanes, and adds float(lanes) * product into one of two accumulators (steps
    alternate). A 2-step tail covers a width that is an odd multiple of 256 (AVX-512)."""
    VB = 64 if variant == "avx512" else 32  # weight bytes per vector step (2 * VB columns)
    NB = VB // 16  # groups of 32 per step
    L = VB // 4  # int32 / float lanes
    BG = 4 * NB  # groups per block of 4 steps

    def typer(typingctx, w, r, s, sr, qa, bias, da, t0, out):
        if s.dtype not in (types.uint8, types.float32):
            return None
        sig = types.void(w, r, s, sr, qa, bias, da, t0, out)
        e8m0 = s.dtype == types.uint8

        def codegen(context, builder, sig, args):
            w_, r_, s_, sr_, qa_, bias_, da_, t0_, out_ = args
            tw, tr, ts, tsr, tqa, tbias, tda, tt0, tout = sig.args
            half = simd.shape(context, builder, tw, w_, 1)
            C = builder.mul(half, c64(2))
            ng = builder.udiv(C, c64(GROUP))
            R = simd.shape(context, builder, tout, out_, 1)
            r = simd.index(context, builder, r_, tr)
            t0 = simd.index(context, builder, t0_, tt0)
            wrow = builder.gep(simd.base(context, builder, tw, w_, I8), [builder.mul(r, half)])
            i8p = I8.as_pointer()
            selem = I8 if e8m0 else F32
            srow = builder.gep(
                simd.base(context, builder, ts, s_, selem), [builder.mul(simd.index(context, builder, sr_, tsr), ng)]
            )
            qab = simd.base(context, builder, tqa, qa_, I8)
            bb = simd.base(context, builder, tbias, bias_, I32)
            dab = simd.base(context, builder, tda, da_, F32)
            outb = simd.base(context, builder, tout, out_, F32)
            tokens = [builder.add(t0, c64(t)) for t in range(T)]
            qrow = [builder.gep(qab, [builder.mul(tk, C)]) for tk in tokens]
            brow = [builder.gep(bb, [builder.mul(tk, builder.mul(ng, c64(4)))]) for tk in tokens]
            drow = [builder.gep(dab, [builder.mul(tk, ng)]) for tk in tokens]
            vb = vec(I8, VB)
            if variant == "avx512":
                shuf = simd.declare(builder, "llvm.x86.avx512.pshuf.b.512", vb, [vb, vb])
                dot = simd.declare(builder, "llvm.x86.avx512.vpdpbusd.512", vec(I32, 16), [vec(I32, 16), vb, vb])
            else:
                shuf = simd.declare(builder, "llvm.x86.avx2.pshuf.b", vb, [vb, vb])
                maddubs = simd.declare(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [vb, vb])
                maddwd = simd.declare(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [vec(I16, 16), vec(I16, 16)])
                ones = simd.splat(I16, 16, 1)
            pf = simd.declare(builder, "llvm.prefetch.p0", ir.VoidType(), [i8p, I32, I32, I32])
            table = ir.Constant(vb, _TABLE * (VB // 16))
            low4 = simd.splat(I8, VB, 15)
            four = simd.splat(I8, VB, 4)
            acc = [[cgutils.alloca_once_value(builder, simd.splat(F32, L, 0.0)) for _ in range(2)] for _ in range(T)]

            def prefetch(ptr, off):  # llvm.prefetch(ptr + off bytes, read, LOCALITY, data cache)
                p = builder.gep(builder.bitcast(ptr, i8p), [off])
                builder.call(pf, [p, ir.Constant(I32, 0), ir.Constant(I32, LOCALITY), ir.Constant(I32, 1)])

            def weight_scales(g, n):
                """n weight scales from group g as <n x float>: E8M0 byte b is 2^(b - 127), whose
                float32 bits are b << 23 for b in 1 .. 254; b = 0 (2^-127, a subnormal) and
                b = 0xFF (NaN) are the two where b - 1 wraps past 253, and get bit 22 too
                (0x00400000 and 0x7FC00000, `E8M0`'s float32 bits)."""
                if not e8m0:
                    return simd.load(builder, srow, g, vec(F32, n), align=4)
                b = builder.zext(simd.load(builder, srow, g, vec(I8, n)), vec(I32, n))
                bits = builder.shl(b, simd.splat(I32, n, 23))
                edge = builder.icmp_unsigned(">", builder.sub(b, simd.splat(I32, n, 1)), simd.splat(I32, n, 253))
                bits = builder.select(edge, builder.or_(bits, simd.splat(I32, n, 1 << 22)), bits)
                return builder.bitcast(bits, vec(F32, n))

            def block(blk, steps):
                """Steps 0 .. steps of block blk (steps = 4, or 2 for the tail)."""
                n = NB * steps
                g0 = builder.mul(blk, c64(BG))
                sw = weight_scales(g0, n)
                sc = [builder.fmul(sw, simd.load(builder, drow[t], g0, vec(F32, n), align=4)) for t in range(T)]
                prefetch(srow, builder.mul(builder.add(g0, c64(PREFETCH // 16)), c64(1 if e8m0 else 4)))
                for j in range(steps):
                    col = builder.add(builder.mul(blk, c64(8 * VB)), c64(2 * VB * j))
                    woff = builder.udiv(col, c64(2))
                    if VB == 64 or j % 2 == 0:  # one prefetch per 64-byte line
                        prefetch(wrow, builder.add(woff, c64(PREFETCH)))
                    raw = simd.load(builder, wrow, woff, vb)
                    lo = builder.call(shuf, [table, builder.and_(raw, low4)])
                    hi = builder.call(shuf, [table, builder.and_(builder.lshr(raw, four), low4)])
                    spread = ir.Constant(vec(I32, L), [NB * j + lane // 4 for lane in range(L)])
                    lane0 = builder.udiv(col, c64(GROUP // 4))
                    for t in range(T):
                        scl = builder.shuffle_vector(sc[t], sc[t], spread)
                        iv = simd.load(builder, brow[t], lane0, vec(I32, L), align=4)
                        ae = simd.load(builder, qrow[t], col, vb)
                        ao = simd.load(builder, qrow[t], builder.add(col, c64(VB)), vb)
                        if variant == "avx512":
                            iv = builder.call(dot, [iv, lo, ae])
                            iv = builder.call(dot, [iv, hi, ao])
                        else:
                            p = builder.add(builder.call(maddubs, [lo, ae]), builder.call(maddubs, [hi, ao]))
                            iv = builder.add(builder.call(maddwd, [p, ones]), iv)
                        a = acc[t][j % 2]
                        builder.store(simd.fma(builder, builder.sitofp(iv, vec(F32, L)), scl, builder.load(a), L), a)

            blocks = builder.udiv(C, c64(8 * VB))
            with cgutils.for_range(builder, blocks) as loop:
                block(loop.index, 4)
            if variant == "avx512":  # C = 512 k + 256: two more steps
                rest = builder.icmp_unsigned("!=", builder.urem(C, c64(8 * VB)), c64(0))
                with builder.if_then(rest, likely=False):
                    block(blocks, 2)
            for t in range(T):
                total = simd.hsum(builder, builder.fadd(builder.load(acc[t][0]), builder.load(acc[t][1])), L)
                builder.store(total, builder.gep(outb, [builder.add(builder.mul(tokens[t], R), r)]))
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = typer.__qualname__ = f"_fp4q8_{variant}_t{T}"
    return intrinsic(typer)


_row4 = _row2 = _row1 = None  # the row kernels `row_groups` binds in each variant's globals
_row_groups = None  # `_each_token_group` compiled with them, bound in `_drive`'s globals


def _each_token_group(w, s, r0, r1, qa, bias, da, lo, hi, out):
    """out[t, r] for rows r0 .. r1 of w (row r's scales: row r of s, E8M0 bytes or float32) and
    the activation rows lo .. hi: the tokens in groups of 4, then 2, then 1 (each row runs the
    same instruction sequence in any group, so a token's bits do not depend on the others of
    the call). Shared by `_drive` and `experts_q8`'s drivers (their pairs are the activation
    rows). The kernels read E8M0 bytes where they are, 0 and 0xFF included: no pass over the
    scales first (a check of each 16-row block for those two bytes cost 10 % of the kernel's
    time with the weights in L2)."""
    t0 = lo
    while t0 < hi:
        if hi - t0 >= 4:
            for r in range(r0, r1):
                _row4(w, r, s, r, qa, bias, da, t0, out)
            t0 += 4
        elif hi - t0 >= 2:
            for r in range(r0, r1):
                _row2(w, r, s, r, qa, bias, da, t0, out)
            t0 += 2
        else:
            for r in range(r0, r1):
                _row1(w, r, s, r, qa, bias, da, t0, out)
            t0 += 1


def _drive(w, s, qa, bias, da, out):
    """Rows in work items of ROWS (prange), tokens in groups of 4, 2, 1 within each."""
    R = w.shape[0]
    T = qa.shape[0]
    for ib in prange((R + ROWS - 1) // ROWS):
        r0 = ib * ROWS
        _row_groups(w, s, r0, min(R, r0 + ROWS), qa, bias, da, 0, T, out)


def _variant_function(fn, variant: str, g: dict, **options):
    """fn compiled with the globals g: a function object of its own (same code, no closure:
    numba's cache cannot key a closure over intrinsics) named after the variant and simd.py's
    hash: numba's cache keys an entry by that name, the signature and the CPU target, and
    watches only this file for changes."""
    f = pytypes.FunctionType(fn.__code__, g, f"{fn.__name__.lstrip('_')}_{variant}_{simd.STAMP}")
    f.__qualname__ = f.__name__
    return njit(**options, **_JIT)(f)


_GROUPS: dict[str, object] = {}


def row_groups(variant: str):
    """`_each_token_group` compiled with `variant`'s row kernels (once per variant)."""
    if variant not in _GROUPS:
        g = dict(globals())
        g["_row4"], g["_row2"], g["_row1"] = (_row_intrinsic(variant, t) for t in TOKENS)
        _GROUPS[variant] = _variant_function(_each_token_group, variant, g)
    return _GROUPS[variant]


def _driver(variant: str):
    """`_drive` compiled with `variant`'s row kernels (through `row_groups`)."""
    g = dict(globals())
    g["_row_groups"] = row_groups(variant)
    return _variant_function(_drive, variant, g, parallel=True)


_DRIVERS: dict[str, object] = {}


def _driver_for(variant: str):
    if variant not in _DRIVERS:
        _DRIVERS[variant] = _driver(variant)
    return _DRIVERS[variant]


# ---------------------------------------------------------------- public products ------------


def prepare(x: np.ndarray, variant: str | None = None):
    """The activations of X (T, C) in the form `multiply` takes (quantise once, use for several
    weights: the pair form)."""
    variant = variant or cpu.variant("fp4")
    return variant, quantize(x, variant)


def multiply(data: np.ndarray, scale: np.ndarray, prepared, threads: int | None = None) -> np.ndarray:
    """FP4 weight (R, C/2) packed, scales (R, C/32) E8M0 bytes or float32, times prepared
    activations -> (T, R) float32."""
    variant, (qa, bias, da) = prepared
    if variant is None:
        raise RuntimeError("no fast FP4 x int8 kernel for this CPU target (kernels.cpu.variant('fp4') is None)")
    if threads is not None:
        numba.set_num_threads(threads)
    out = np.empty((qa.shape[0], data.shape[0]), np.float32)
    _driver_for(variant)(data, scale, qa, bias, da, out)
    return out


def matmul(data: np.ndarray, scale: np.ndarray, x: np.ndarray, variant: str | None = None) -> np.ndarray:
    """X (T, C) float32 times FP4 weight -> (T, R) float32 (C a multiple of 256)."""
    return multiply(data, scale, prepare(np.atleast_2d(x), variant))
