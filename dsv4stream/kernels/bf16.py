"""FP8 (E4M3, block scales) and BF16 weights times BF16 activations: the `fast` trunk and head.

Activations are rounded to BF16 (round to nearest even from float32; NaN stays NaN, overflow
goes to infinity) in numba, once per call (BF16 weights) or once per block of rows (FP8, in
vector IR, 64 columns per step: the
block's column scales are folded in first, y = bf16(x * s): for a power-of-two scale, V4's and
V4.1's, that is bf16(x) * s exactly unless x * s leaves the float32 normal range).
Every E4M3 value is a BF16 value, so weights are not rounded at all.

Variants (`cpu.variant`):
- "avx512": E4M3 -> BF16 bits through two 128-entry byte tables (`vpermi2b`, VBMI) and the
  in-lane byte unpacks (`vpunpcklbw` / `vpunpckhbw`), which leave a 64-column step's words in
  `_XPERM` order: the FP8 activations are stored in that order, so each word meets its own
  column (a cross-lane interleave into column order is two `vpermt2b`, three uops each on
  Intel). `vdpbf16ps` multiplies pairs of BF16 into float32 lanes. `vdpbf16ps` treats
  subnormal inputs and results as zero: a product below 2^-126 in magnitude is dropped, at most
  C * 2^-126 per output (activations are scaled into BF16's normal range by the block scale,
  and E4M3 weights are normal in BF16).
- "avx2": weights decoded to float32 (E4M3: the byte sign-extended, shifted by 20 and masked
  onto float32's sign, exponent and mantissa, then times 2^120, exact for subnormals too; BF16
  by a 16-bit shift), activations BF16 widened to float32, FMA. The decode leaves out the
  NaN select: a pass tracks its largest magnitude byte and only a pass that met a NaN code
  (0x7F / 0xFF) runs again with it. The 2^120 moves to the activations (each
  BF16 value times 2^120, in float32, where all of a row block's are below 2^8 in magnitude,
  else the form above): the same products, so the same bits, and 4 instructions per 8
  weights where the first decode took 10 (this kernel is compute-bound: from DRAM and from L2
  at the same rate on a Zen 3 core).
Float order is fixed per row and token: lanes accumulate along the row in two accumulators
(alternating halves of a 64-column step), then a fixed tree sums the lanes; every token runs
the same sequence in token groups of up to `MAX_GROUP` (8 on AVX-512, 4 on AVX2; one token: 4
rows a pass, two tokens: 2, each row with its own lanes, the next pass's rows prefetched: 4096 x
4096 from DRAM, one thread, two tokens' FP8 8.4 -> 10.6 and BF16 12.8 -> 19.0 GB per CPU-s
against one row a pass), so a row's bits do not depend on the token count, the
threads, or the other tokens of the call. The shared expert's w1 / w3 pair and the grouped output projection's groups run in
one parallel region each (`fp8_matmul_pair`, `fp8_matmul_grouped`), the same bits as alone.
"""

from __future__ import annotations

import math
import types as pytypes

import ml_dtypes
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

# jit: imported for its side effect, numba's cache locator for the kernels below (`jit.cache_dir`)
from . import cpu, jit, simd  # noqa: F401
from .q8 import E8M0
from .simd import BF, F32, I8, I16, I32, I64, c64, vec

STEP = 64  # columns per loop step: C must be a multiple
ROWS = 16  # rows per inner block (weights re-read from L1/L2 across token groups)
HEAD_BLOCK = 64  # rows per work item for BF16 weights (no scale blocks)
_JIT = {"cache": True, "fastmath": False, "error_model": "numpy", "boundscheck": False}


def supports(cols: int) -> bool:
    return cols % STEP == 0


# ---------------------------------------------------------------- activations ----------------


@njit(inline="always")
def _bf16_bits(v):
    """float32 -> BF16 bits, round to nearest even (NaN -> quiet NaN of the same sign).
    uint32 arithmetic and a select: the loops that call it vectorise."""
    b = np.float32(v).view(np.uint32)
    rne = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (b >> np.uint32(16)) | np.uint32(0x40)
    return np.uint16(nan if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rne)


@njit(cache=True, fastmath=False)
def _round_rows(x, xs):
    T, C = x.shape
    for t in range(T):
        for c in range(C):
            xs[t, c] = _bf16_bits(x[t, c])


def to_bf16(x: np.ndarray) -> np.ndarray:
    """X float32 -> BF16 bits (uint16), round to nearest even (what the kernels multiply)."""
    x = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)
    xs = np.empty(x.shape, np.uint16)
    _round_rows(x, xs)
    return xs


def _scale_f32(s, i, j):
    """Scale s[i, j] as float32 (E8M0 byte or float32)."""


@overload(_scale_f32, jit_options=_JIT)
def _ol_scale_f32(s, i, j):
    if s.dtype == types.uint8:

        def impl(s, i, j):
            return E8M0[s[i, j]]

        return impl
    return lambda s, i, j: np.float32(s[i, j])


# ---------------------------------------------------------------- E4M3 -> BF16 tables --------


def _tables() -> tuple[list[int], list[int]]:
    """High and low bytes of the BF16 bits of E4M3 codes 0..127 (exact; 0x7F is NaN)."""
    vals = np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    bits = vals.astype(ml_dtypes.bfloat16).view(np.uint16)
    back = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(back[:127], vals[:127]) and np.isnan(back[127])
    signed = [int(v) - 256 if v > 127 else int(v) for v in (bits >> 8).astype(np.uint8)]
    return signed, [int(v) - 256 if v > 127 else int(v) for v in (bits & 0xFF).astype(np.uint8)]


_HI, _LO = _tables()


def _unpack_mask(h: int) -> list[int]:
    """Shuffle mask of `vpunpcklbw` (h = 0) / `vpunpckhbw` (h = 1) of (lo, hi): in each 16-byte
    lane L, words (lo[16 L + 8 h + k], hi[16 L + 8 h + k]) for k < 8."""
    return [j for lane in range(4) for k in range(8) for j in (16 * lane + 8 * h + k, 64 + 16 * lane + 8 * h + k)]


# Column of a 64-column step that word p of the AVX-512 FP8 kernel's decoded weights holds
# (`_unpack_mask`): the activations of that kernel are stored in this order, so word p meets its
# own column. p = 32 h + 8 L + k holds column 16 L + 8 h + k.
_XPERM = np.array([16 * lane + 8 * h + k for h in range(2) for lane in range(4) for k in range(8)], np.int64)


# ---------------------------------------------------------------- row kernels ----------------


def _row_intrinsic(
    kind: str,
    variant: str,
    T: int,
    NR: int = 1,
    prefetch: int = 0,
    locality: int = 3,
    nan_branch: bool = True,
    prescaled: bool = False,
):
    """Rows r .. r+NR of w (fp8 bytes or bf16 bits, (R, C)) times BF16 tokens t0 .. t0+T of xs
    (T, C) -> out[t, r .. r+NR]. Each row keeps its own accumulators and order, so a row's bits
    do not depend on NR: NR > 1 only loads each activation vector once for NR rows and reads NR
    weight rows side by side (NR streams from memory where one row of a wide weight is one
    stream: the one-token kernel lost to the exact one on wo_b from DRAM without it).

    `prefetch`: each step also prefetches the same columns NR rows further on, the rows of the
    next pass (contiguous after these). Rows of 1-2 KB (wq_b, the shared w2, the indexer's wq_b)
    are 4 streams of 16-32 lines inside one 4 KB page, too short for the hardware prefetcher,
    which does not cross pages: one thread, one token, from DRAM, GB per CPU-second, load 14:
    32768x1024 4.0 -> 8.7, 4096x2048 4.2 -> 9.4, 4096x8192 8.4 -> 9.7 (`bench/row_prefetch.py`).
    A prefetch never faults (past the last row it is dropped) and changes no arithmetic."""
    lanes = 16 if variant == "avx512" else 8

    def typer(typingctx, w, r, xs, t0, out):
        sig = types.void(w, r, xs, t0, out)

        def codegen(context, builder, sig, args):
            w_, r_, xs_, t0_, out_ = args
            tw, tr, txs, tt0, tout = sig.args
            C = simd.shape(context, builder, tw, w_, 1)
            R = simd.shape(context, builder, tout, out_, 1)
            r = simd.index(context, builder, r_, tr)
            t0 = simd.index(context, builder, t0_, tt0)
            welem = I8 if kind == "fp8" else I16
            wbase = simd.base(context, builder, tw, w_, welem)
            wrows = [builder.gep(wbase, [builder.mul(builder.add(r, c64(i)), C)]) for i in range(NR)]
            xb = simd.base(context, builder, txs, xs_, F32 if prescaled else I16)
            outb = simd.base(context, builder, tout, out_, F32)
            tokens = [builder.add(t0, c64(t)) for t in range(T)]
            xrow = [builder.gep(xb, [builder.mul(tk, C)]) for tk in tokens]
            acc = [
                [[cgutils.alloca_once_value(builder, simd.splat(F32, lanes, 0.0)) for _ in range(2)] for _ in range(T)]
                for _ in range(NR)
            ]
            steps = builder.udiv(C, c64(STEP))
            if prefetch:  # llvm.prefetch(ptr, read, locality 3, data cache)
                pf = builder.module.globals.get("llvm.prefetch.p0") or ir.Function(
                    builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0"
                )
            if variant == "avx512":
                dot = simd.dpbf16(builder)
                if kind == "fp8":
                    v64 = vec(I8, 64)
                    perm = simd.declare(builder, "llvm.x86.avx512.vpermi2var.qi.512", v64, [v64, v64, v64])
                    h0, h1 = ir.Constant(v64, _HI[:64]), ir.Constant(v64, _HI[64:])
                    l0, l1 = ir.Constant(v64, _LO[:64]), ir.Constant(v64, _LO[64:])
                    sign = simd.splat(I8, 64, -128)
                    # words (lo[c], hi[c]) by the in-lane byte unpacks (`vpunpcklbw` / `vpunpckhbw`,
                    # one uop each): a cross-lane interleave into column order is a `vpermt2b`,
                    # three uops on Intel, and cost more than the two table lookups. The words then
                    # hold the step's columns in `_XPERM` order, which the activations are stored in.
                    first, second = (ir.Constant(vec(I32, 64), _unpack_mask(h)) for h in range(2))
            else:
                wide = vec(I32, lanes)
                sixteen = ir.Constant(wide, [16] * lanes)
                if kind == "fp8":
                    mag = ir.Constant(wide, [0x7F] * lanes)
                    twenty = ir.Constant(wide, [20] * lanes)
                    # sext(b) << 20 holds the sign in bits 31..27 and b's low 7 bits in 26..20
                    keep = ir.Constant(wide, [-0x78100000] * lanes)  # 0x87F00000: bit 31, bits 26..20
                    pow120 = ir.Constant(vec(F32, lanes), [2.0**120] * lanes)
                    nan = ir.Constant(vec(F32, lanes), [math.nan] * lanes)

            def avx2_step(col, nan_select: bool):
                """One 64-column step on AVX2: weights decoded to float32, FMA per token. E4M3: the
                byte sign-extended and shifted so that sign and magnitude land on float32's sign,
                exponent and mantissa (exponent biased 120 too low, `pow120` restores it, exact
                for subnormals); `nan_select` maps the NaN codes to NaN (a step without them
                skips the compare and select)."""
                for j in range(STEP // lanes):
                    cj = builder.add(col, c64(lanes * j))
                    xf = []
                    for t in range(T):
                        if prescaled:  # BF16 values times 2^120 in float32 (`_actf64`)
                            xf.append(simd.load(builder, xrow[t], cj, vec(F32, lanes), align=4))
                            continue
                        xi = builder.zext(simd.load(builder, xrow[t], cj, vec(I16, lanes), align=2), wide)
                        xf.append(builder.bitcast(builder.shl(xi, sixteen), vec(F32, lanes)))
                    for i, wrow in enumerate(wrows):
                        if kind == "fp8":
                            b = builder.sext(simd.load(builder, wrow, cj, vec(I8, lanes)), wide)
                            bits = builder.and_(builder.shl(b, twenty), keep)
                            wf = builder.bitcast(bits, vec(F32, lanes))
                            if not prescaled:  # else 2^120 is in the activations
                                wf = builder.fmul(wf, pow120)
                            if nan_select:
                                m = builder.and_(b, mag)
                                wf = builder.select(builder.icmp_unsigned("==", m, mag), nan, wf)
                        else:
                            b = builder.zext(simd.load(builder, wrow, cj, vec(I16, lanes), align=2), wide)
                            wf = builder.bitcast(builder.shl(b, sixteen), vec(F32, lanes))
                        for t in range(T):
                            a = acc[i][t][j % 2]
                            builder.store(simd.fma(builder, wf, xf[t], builder.load(a), lanes), a)

            def avx512_step(col):
                """One 64-column step on AVX-512: E4M3 -> BF16 by the byte tables (or BF16 loaded),
                `vdpbf16ps` per token."""
                xv = [
                    [simd.load(builder, xrow[t], builder.add(col, c64(32 * h)), vec(BF, 32), align=2) for h in range(2)]
                    for t in range(T)
                ]
                for i, wrow in enumerate(wrows):
                    if kind == "fp8":
                        raw = simd.load(builder, wrow, col, vec(I8, 64))
                        hi = builder.or_(builder.call(perm, [h0, raw, h1]), builder.and_(raw, sign))
                        lo = builder.call(perm, [l0, raw, l1])
                        ws = [builder.bitcast(builder.shuffle_vector(lo, hi, m), vec(BF, 32)) for m in (first, second)]
                    else:
                        ws = [
                            simd.load(builder, wrow, builder.add(col, c64(32 * h)), vec(BF, 32), align=2)
                            for h in range(2)
                        ]
                    for t in range(T):
                        for h in range(2):
                            a = acc[i][t][h]
                            builder.store(builder.call(dot, [builder.load(a), ws[h], xv[t][h]]), a)

            def columns(mode: str):
                """The row pass over every step. mode (AVX2 FP8 only): "plain" decodes without the
                NaN select and keeps in `seen` the largest magnitude byte of the pass, "select"
                decodes with it; "" for every other kernel."""
                with cgutils.for_range(builder, steps) as loop:
                    col = builder.mul(loop.index, c64(STEP))
                    if prefetch:  # the next pass's rows, these columns: NR * C weights on
                        wb = STEP * (1 if kind == "fp8" else 2)  # bytes of a row per step
                        ahead = builder.add(
                            builder.mul(C, c64(prefetch * NR * wb // STEP)), builder.mul(col, c64(wb // STEP))
                        )
                        for wrow in wrows:
                            for k in range(wb // 64):
                                ptr = builder.gep(
                                    builder.bitcast(wrow, I8.as_pointer()), [builder.add(ahead, c64(64 * k))]
                                )
                                builder.call(
                                    pf, [ptr, ir.Constant(I32, 0), ir.Constant(I32, locality), ir.Constant(I32, 1)]
                                )
                    if variant == "avx512":
                        avx512_step(col)
                    elif mode == "plain":
                        top = builder.load(seen)
                        for wrow in wrows:
                            for q in range(2):
                                v = simd.load(builder, wrow, builder.add(col, c64(32 * q)), vec(I8, 32))
                                top = builder.call(umax, [top, builder.and_(v, low7)])
                        builder.store(top, seen)
                        avx2_step(col, False)
                    else:
                        avx2_step(col, kind == "fp8")

            if variant != "avx512" and kind == "fp8" and nan_branch:
                # E4M3 NaN (magnitude 0x7F) is all but absent from real weights: the pass runs
                # without the NaN select, tracking the largest magnitude byte, and only a pass
                # that met one runs again, from zeroed lanes, with the select: the same bits.
                umax = simd.declare(builder, "llvm.umax.v32i8", vec(I8, 32), [vec(I8, 32)] * 2)
                low7 = simd.splat(I8, 32, 0x7F)
                seen = cgutils.alloca_once_value(builder, simd.splat(I8, 32, 0))
                columns("plain")
                hit = builder.icmp_unsigned("==", builder.load(seen), low7)
                anynan = builder.icmp_unsigned("!=", builder.bitcast(hit, I32), ir.Constant(I32, 0))
                with builder.if_then(anynan, likely=False):
                    for row in acc:
                        for tok in row:
                            for a in tok:
                                builder.store(simd.splat(F32, lanes, 0.0), a)
                    columns("select")
            else:
                columns("")
            for i in range(NR):
                ri = builder.add(r, c64(i))
                for t in range(T):
                    pair = builder.fadd(builder.load(acc[i][t][0]), builder.load(acc[i][t][1]))
                    total = simd.hsum(builder, pair, lanes)
                    builder.store(total, builder.gep(outb, [builder.add(builder.mul(tokens[t], R), ri)]))
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = typer.__qualname__ = f"_{kind}bf16_{variant}_t{T}_r{NR}{'_f' if prescaled else ''}"
    return intrinsic(typer)


_row8 = _row7 = _row6 = _row5 = _row4 = _row3 = _row2 = _row1 = _row1x = _row2x = None  # bound by `_driver`
# Rows per pass of the one-token kernel (`_row_intrinsic`'s NR; divides ROWS)
ONE_TOKEN_ROWS = 4
# Rows per pass of the two-token kernel: two row streams, each row's 2 x 2 accumulators (8 of
# AVX2's 16 registers beside the two tokens' activations and a decoded step), and the next
# pass's rows prefetched as the one-token kernel does
TWO_TOKEN_ROWS = 2
PREFETCH_PASSES = 1
PREFETCH_LOCALITY = 3
# Tokens per row kernel call, by variant: AVX-512's 32 registers hold 8 tokens' accumulators (16)
# beside a step's decoded weights, AVX2's 16 hold 4 tokens' (8). A call of T tokens runs groups of
# the largest, then one group of the rest (`_tokens`).
MAX_GROUP = {"avx512": 8, "avx2": 4}
_GROUP = 4  # MAX_GROUP of the variant, bound by `_driver`


def _tokens(w, r0, r1, xs, out):
    """Rows r0 .. r1 times every token of xs, in token groups of _GROUP, then the rest in one
    group: each 64-column step of a row is decoded once per group, so a 7-token prefill decodes
    its weights once (AVX-512), not three times (4 + 2 + 1)."""
    T = xs.shape[0]
    t0 = 0
    while t0 < T:
        n = min(_GROUP, T - t0)
        if n == 1:
            r = r0
            while r + ONE_TOKEN_ROWS <= r1:
                _row1x(w, r, xs, t0, out)
                r += ONE_TOKEN_ROWS
            while r < r1:
                _row1(w, r, xs, t0, out)
                r += 1
        elif n == 2:
            r = r0
            while r + TWO_TOKEN_ROWS <= r1:
                _row2x(w, r, xs, t0, out)
                r += TWO_TOKEN_ROWS
            while r < r1:
                _row2(w, r, xs, t0, out)
                r += 1
        elif n == 3:
            for r in range(r0, r1):
                _row3(w, r, xs, t0, out)
        elif n == 4:
            for r in range(r0, r1):
                _row4(w, r, xs, t0, out)
        elif n == 5:
            for r in range(r0, r1):
                _row5(w, r, xs, t0, out)
        elif n == 6:
            for r in range(r0, r1):
                _row6(w, r, xs, t0, out)
        elif n == 7:
            for r in range(r0, r1):
                _row7(w, r, xs, t0, out)
        else:
            for r in range(r0, r1):
                _row8(w, r, xs, t0, out)
        t0 += n


_PERMUTED = False  # set per variant by `_driver`: activations stored in `_XPERM` order


def _act_intrinsic(permuted: bool, prescaled: bool = False):
    """xs[t, c0 : c0+64] = `_bf16_bits`(x[t, c] * s) for the 64 columns from c0, s0 for the first
    32 and s1 for the next (a 32-column group lies in one scale block), in `_XPERM` order where
    `permuted`. Vector IR with `_bf16_bits`' uint32 arithmetic, the same bits: numba left the
    scalar loop unvectorised, and it ran once per row block (its 8192 columns took about as
    long as 16 of wo_b's rows).

    `prescaled` (AVX2's FP8 kernels, any token count): xs is float32 and gets each BF16 value times 2^120,
    which the kernel's E4M3 decode then leaves out (`_row_intrinsic(prescaled=True)`): the
    product of the two is the same number, so every FMA gives the same bits, as long as the
    value times 2^120 is finite. Returns whether it is for all 64 (every |value| < 2^8, no NaN);
    where it is not, the caller runs the BF16 form."""

    def typer(typingctx, x, t, c0, s0, s1, xs):
        sig = (types.boolean if prescaled else types.void)(x, t, c0, s0, s1, xs)

        def codegen(context, builder, sig, args):
            x_, t_, c0_, s0_, s1_, xs_ = args
            tx, tt, tc0, ts0, ts1, txs = sig.args
            C = simd.shape(context, builder, tx, x_, 1)
            off = builder.add(
                builder.mul(simd.index(context, builder, t_, tt), C), simd.index(context, builder, c0_, tc0)
            )
            v = simd.load(builder, simd.base(context, builder, tx, x_, F32), off, vec(F32, 64), align=4)
            sv = [context.cast(builder, a, ty, types.float32) for a, ty in ((s0_, ts0), (s1_, ts1))]
            halves = [
                builder.insert_element(ir.Constant(vec(F32, 64), ir.Undefined), a, ir.Constant(I32, 0)) for a in sv
            ]
            scale = builder.shuffle_vector(halves[0], halves[1], ir.Constant(vec(I32, 64), [0] * 32 + [64] * 32))
            b = builder.bitcast(builder.fmul(v, scale), vec(I32, 64))

            def k(n):
                return ir.Constant(vec(I32, 64), [n] * 64)

            sh = builder.lshr(b, k(16))
            rne = builder.lshr(builder.add(builder.add(b, k(0x7FFF)), builder.and_(sh, k(1))), k(16))
            nan = builder.or_(sh, k(0x40))
            is_nan = builder.icmp_unsigned(">", builder.and_(b, k(0x7FFFFFFF)), k(0x7F800000))
            if prescaled:
                # |bf16| < 2^8 <=> its magnitude bits are below 0x4380 (256.0); NaN and inf are not
                fits = builder.icmp_unsigned("<", builder.and_(rne, k(0x7FFF)), k(0x4380))
                ok = builder.icmp_unsigned("==", builder.bitcast(builder.not_(fits), I64), ir.Constant(I64, 0))
                f = builder.fmul(builder.bitcast(builder.shl(rne, k(16)), vec(F32, 64)), simd.splat(F32, 64, 2.0**120))
                dst = builder.gep(simd.base(context, builder, txs, xs_, F32), [off])
                builder.store(f, builder.bitcast(dst, vec(F32, 64).as_pointer()), align=4)
                return ok
            bits = builder.trunc(builder.select(is_nan, nan, rne), vec(I16, 64))
            if permuted:
                bits = builder.shuffle_vector(bits, bits, ir.Constant(vec(I32, 64), [int(c) for c in _XPERM]))
            dst = builder.gep(simd.base(context, builder, txs, xs_, I16), [off])
            builder.store(bits, builder.bitcast(dst, vec(I16, 64).as_pointer()), align=2)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = typer.__qualname__ = f"_act64_{'perm' if permuted else 'nat'}{'_f' if prescaled else ''}"
    return intrinsic(typer)


_act64 = None  # `_act_intrinsic` of the variant's layout, bound by `_driver`
# AVX2: activations times 2^120 in float32 and row kernels without the decode's
# multiply (`_act_intrinsic(prescaled=True)`); bound by `_driver`
_PRESCALE = False
_actf64 = _tokensf = None


def _prescaled_block(w, s, bc, x, rb, r0, end, out):
    """Rows r0 .. end of row block rb times every token of x, by the prescaled AVX2 kernels
    (`_tokensf`: `_tokens` over them, the same token groups); False (nothing written) where an
    activation times its scale is too large for them (|bf16| >= 2^8, NaN). With several tokens
    the saving is larger than with one: the BF16 form widens each token's activations again for
    every row it meets (two instructions per 8 columns and token, beside one FMA)."""
    T, C = x.shape
    xf = np.empty((T, C), np.float32)
    ok = True
    for t in range(T):
        for c0 in range(0, C, STEP):
            ok &= _actf64(x, t, c0, _scale_f32(s, rb, c0 // bc), _scale_f32(s, rb, (c0 + 32) // bc), xf)
    if not ok:
        return False
    for r in range(r0, end, ROWS):
        _tokensf(w, r, min(end, r + ROWS), xf, out)
    return True


def _no_prescaled_block(w, s, bc, x, rb, r0, end, out):
    return False


def _fp8_block(w, s, br, bc, x, rb, out):
    """Row block rb of the scale grid times x (T, C) into out: rounds x * its scales to BF16
    once, then its rows."""
    R, C = w.shape
    T = x.shape[0]
    end = min(R, rb * br + br)
    if _PRESCALE and bc % 32 == 0 and _prescaled_block(w, s, bc, x, rb, rb * br, end, out):
        return
    xs = np.empty((T, C), np.uint16)
    if bc % 32 == 0:  # V4's 128 and V4.1's 32: 64 columns per vector op
        for t in range(T):
            for c0 in range(0, C, STEP):
                _act64(x, t, c0, _scale_f32(s, rb, c0 // bc), _scale_f32(s, rb, (c0 + 32) // bc), xs)
    elif _PERMUTED:
        # 8 consecutive columns land on 8 consecutive words
        for t in range(T):
            for c0 in range(0, C, STEP):
                for q in range(STEP // 8):
                    src = c0 + _XPERM[8 * q]
                    for k in range(8):
                        sk = _scale_f32(s, rb, (src + k) // bc)
                        xs[t, c0 + 8 * q + k] = _bf16_bits(np.float32(x[t, src + k] * sk))
    else:
        for cb in range((C + bc - 1) // bc):
            sc = _scale_f32(s, rb, cb)
            c1 = min(C, cb * bc + bc)
            for t in range(T):
                for c in range(cb * bc, c1):
                    xs[t, c] = _bf16_bits(np.float32(x[t, c] * sc))
    for r0 in range(rb * br, end, ROWS):
        _tokens(w, r0, min(end, r0 + ROWS), xs, out)


def _fp8_drive(w, s, br, bc, x, rpg, out):
    """Row blocks of the scale grid in prange; x (G, T, C): row r meets x[r // rpg] (G = 1 for
    one weight; the grouped output projection's groups, rpg a multiple of br, in one region)."""
    for rb in prange((w.shape[0] + br - 1) // br):
        _fp8_block(w, s, br, bc, x[rb * br // rpg], rb, out)


def _fp8_pair_drive(w1, s1, w3, s3, br, bc, x, out1, out3):
    """Two weights of one shape (a shared expert's w1 and w3) times x (T, C): one parallel
    region, their row blocks alternating."""
    nb = (w1.shape[0] + br - 1) // br
    for i in prange(2 * nb):
        if i % 2 == 0:
            _fp8_block(w1, s1, br, bc, x, i // 2, out1)
        else:
            _fp8_block(w3, s3, br, bc, x, i // 2, out3)


def _bf16_drive(w, xs, out):
    R = w.shape[0]
    for ib in prange((R + HEAD_BLOCK - 1) // HEAD_BLOCK):
        end = min(R, ib * HEAD_BLOCK + HEAD_BLOCK)
        for r0 in range(ib * HEAD_BLOCK, end, ROWS):
            _tokens(w, r0, min(end, r0 + ROWS), xs, out)


def _driver(
    kind: str,
    variant: str,
    nr: int | None = None,
    prefetch: int | None = None,
    locality: int | None = None,
    nan_branch: bool = True,
    prescale: bool = True,
):
    """The drive function of `kind` compiled with `variant`'s row kernels: see `q8._driver`
    (own globals, no closure, named after kind, variant and simd.py's hash for numba's cache).
    `_tokens` is rebuilt in the same globals so it calls this variant's row kernels."""
    g = dict(globals())
    rows = "bf16" if kind == "bf16" else "fp8"
    g["_GROUP"] = MAX_GROUP[variant]
    nr = ONE_TOKEN_ROWS if nr is None else nr
    g["ONE_TOKEN_ROWS"] = nr
    pf = PREFETCH_PASSES if prefetch is None else prefetch
    loc = PREFETCH_LOCALITY if locality is None else locality

    def bind_rows(into: dict, prescaled: bool) -> None:
        """`_tokens`' row kernels into `into`: one per token group of 1 .. the variant's largest
        (larger groups never run: bound to the 1-token kernel) and the one-token pass kernel."""
        for t in range(1, 9):
            into[f"_row{t}"] = (
                _row_intrinsic(rows, variant, t, nan_branch=nan_branch, prescaled=prescaled)
                if t <= g["_GROUP"]
                else into["_row1"]
            )
        into["_row1x"] = _row_intrinsic(
            rows, variant, 1, nr, prefetch=pf, locality=loc, nan_branch=nan_branch, prescaled=prescaled
        )
        into["_row2x"] = _row_intrinsic(
            rows, variant, 2, TWO_TOKEN_ROWS, prefetch=pf, locality=loc, nan_branch=nan_branch, prescaled=prescaled
        )

    bind_rows(g, False)
    g["_PERMUTED"] = kind.startswith("fp8") and variant == "avx512"
    g["_act64"] = _act_intrinsic(g["_PERMUTED"])
    g["_PRESCALE"] = kind.startswith("fp8") and variant == "avx2" and prescale
    if g["_PRESCALE"]:
        g["_actf64"] = _act_intrinsic(False, prescaled=True)
        # `_tokens` again, over the prescaled row kernels (its own globals: the same groups)
        gf = dict(g)
        bind_rows(gf, True)
        g["_tokensf"] = njit(inline="always", **_JIT)(pytypes.FunctionType(_tokens.__code__, gf, "_tokensf"))
    # without the prescaled kernels `_fp8_block` calls a stand-in that declines every block
    block = _prescaled_block if g["_PRESCALE"] else _no_prescaled_block
    g["_prescaled_block"] = njit(inline="always", **_JIT)(pytypes.FunctionType(block.__code__, g, "_prescaled_block"))
    for name, fn in (("_tokens", _tokens), ("_fp8_block", _fp8_block)):
        g[name] = njit(inline="always", **_JIT)(pytypes.FunctionType(fn.__code__, g, name))
    body = {"fp8": _fp8_drive, "fp8pair": _fp8_pair_drive, "bf16": _bf16_drive}[kind]
    f = pytypes.FunctionType(body.__code__, g, f"{kind}bf16_{variant}_{simd.STAMP}")
    f.__qualname__ = f.__name__
    return njit(parallel=True, **_JIT)(f)


_DRIVERS: dict[tuple[str, str], object] = {}


def _drive(kind: str, variant: str | None):
    if variant is None:
        raise RuntimeError(f"no fast {kind} x BF16 kernel for this CPU target (kernels.cpu.variant({kind!r}) is None)")
    key = (kind, variant)
    if key not in _DRIVERS:
        _DRIVERS[key] = _driver(kind, variant)
    return _DRIVERS[key]


# ---------------------------------------------------------------- public products ------------


def fp8_matmul(data, scale, block: tuple[int, int], x: np.ndarray, variant: str | None = None) -> np.ndarray:
    """X (T, C) float32 times an E4M3 weight (R, C) with (ceil(R/br), ceil(C/bc)) scales (E8M0
    bytes or float32) -> (T, R) float32; C a multiple of 64."""
    x = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)
    out = np.empty((x.shape[0], data.shape[0]), np.float32)
    _drive("fp8", variant or cpu.variant("fp8"))(data, scale, block[0], block[1], x[None], data.shape[0], out)
    return out


def fp8_matmul_pair(w1, w3, x: np.ndarray, variant: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`fp8_matmul` of two FP8 QWeights of one shape, block and scale dtype times X (T, C), in
    one parallel region; each result equals its `fp8_matmul` bit for bit."""
    x = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)
    y1 = np.empty((x.shape[0], w1.rows), np.float32)
    y3 = np.empty((x.shape[0], w3.rows), np.float32)
    br, bc = w1.block
    _drive("fp8pair", variant or cpu.variant("fp8"))(w1.data, w1.scale, w3.data, w3.scale, br, bc, x, y1, y3)
    return y1, y3


def fp8_matmul_grouped(data, scale, block: tuple[int, int], x: np.ndarray, variant: str | None = None) -> np.ndarray:
    """X (T, G, C): group i times rows i * R/G .. of one E4M3 weight (R, C) (the row blocks of the
    grouped output projection, back to back) -> (T, R), in one parallel region; R/G a multiple
    of the block's rows. Each group's columns equal its own `fp8_matmul` bit for bit."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rpg = data.shape[0] // x.shape[1]
    if rpg * x.shape[1] != data.shape[0] or rpg % block[0]:
        raise ValueError(f"{x.shape[1]} groups of an FP8 weight of {data.shape[0]} rows, blocks {block}")
    out = np.empty((x.shape[0], data.shape[0]), np.float32)
    xg = np.ascontiguousarray(x.transpose(1, 0, 2))
    _drive("fp8", variant or cpu.variant("fp8"))(data, scale, block[0], block[1], xg, rpg, out)
    return out


def bf16_prepare(x: np.ndarray) -> np.ndarray:
    return to_bf16(x)


def bf16_multiply(data, xs: np.ndarray, variant: str | None = None) -> np.ndarray:
    """BF16 weight bits (R, C) times BF16 activations xs (T, C) (from `to_bf16`) -> (T, R)."""
    out = np.empty((xs.shape[0], data.shape[0]), np.float32)
    _drive("bf16", variant or cpu.variant("bf16"))(data, xs, out)
    return out


def bf16_matmul(data, x: np.ndarray, variant: str | None = None) -> np.ndarray:
    """X (T, C) float32 times BF16 weight bits (R, C) -> (T, R) float32; C a multiple of 64."""
    return bf16_multiply(data, to_bf16(x), variant)


def set_threads(n: int) -> None:
    numba.set_num_threads(n)
