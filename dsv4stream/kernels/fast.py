"""Fused numba kernels: FP4 / FP8 / BF16 / F32 weights times a vector or a few tokens.

Owns the fast CPU backend of `kernels` (`matvec`, `matmul`, `matmul_pair`, `matmul_grouped`,
`set_threads`, `warmup`). No dequantised matrix is built: a row is decoded in registers
(matvec) or into a small per-tile buffer reused by every token (matmul). An optional BLAS path
(`BLAS_PATH`, off by default) dequantises row tiles of a few MB to float32 from
`BLAS_MIN_TOKENS` on and multiplies them with numpy's sgemm. Does not own the
weight formats (`formats.py`) or the dispatch (`kernels/__init__.py`). One file on purpose:
numba's on-disk cache is invalidated by this file's timestamp only, so the bit-level helpers
must live next to the kernels that inline them.

Arithmetic, identical in every path so that results do not depend on the thread count and
`matvec(w, x) == matmul(w, x[None])[0]` bit for bit:
- decode: E2M1 and E4M3 become float16 bit patterns (exact), widened to float32; the value is
  then 2^-14 (E2M1) or 2^-8 (E4M3) times the true one. BF16 is shifted into float32 (exact).
- scales: per output row, the largest block scale's exponent E is factored out; each block
  gets `rel = scale * 2^(127 - E + shift)` in float32 (shift undoes the decode offset), and the
  row sum is multiplied by 2^(E - 127) in float64 at the end. So E8M0 byte 0 (2^-127, a float32
  subnormal) or 2^+127 never under/overflow inside the lanes. A block whose scale is below
  2^-126 of the row's largest is flushed to zero (it cannot move the result).
- a non-finite scale (E8M0 0xFF is NaN) makes its whole output row NaN; E4M3 NaN bytes are NaN.
- accumulation (fused kernels): 32 float32 lanes per (row, token), each an FMA chain in column
  order, then a fixed pairwise tree over the lanes. FP8 / BF16 / F32: lane = column mod 32, `lane = fma(w *
  rel, x, lane)`. FP4: packed byte k of 32-block b feeds lane (b mod 2)*16 + k with
  `lane = fma(odd * rel, x_odd, fma(even * rel, x_even, lane))` (decoded by a table lookup where
  AVX-512 has one, else through float16 bit patterns; same bits): one FMA per product, so the
  matmul multiplies a pre-scaled tile (the products by rel are exact: rel is a power of two
  and the decoded values stay above 2^-149). Parallel over output rows only.
- BLAS path (off by default): the tile holds decode * rel (exact for E8M0 scales), sgemm sums
  it in its own order, the row factor is applied in float64. Its bits are NOT independent of
  the BLAS thread count: OpenBLAS 0.3.31's Haswell kernels on a Zen 3 give different sums with
  1 and 2 threads and for different row splits, so it agrees with the fused kernels only to
  float32 rounding (tests/test_kernels.py checks that bound at both thread counts), and the
  attention products moved to fixed-order numba kernels (kernels/attn.py).
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import replace

import numba
import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

# libgomp (numba's "omp" threading layer) spins idle workers long after each parallel region,
# taking both cores from OpenBLAS and the I/O threads: a 512^3 sgemm right after a kernel went
# 1.36 -> 5.0 ms here; with this spin count 1.41 ms, and back-to-back kernels stay as fast.
# Read when libgomp loads (the first parallel call), so it must be set before that.
os.environ.setdefault("GOMP_SPINCOUNT", "100000")

LANES = 32
FP4_LANES = 32  # lane h*16 + k: even * scale * x_even, then odd * scale * x_odd; 32-blocks of parity h
MAX_BLOCKS = 1024  # stack room for one row's relative scales: FP4 cols <= 32768, FP8 cols <= 131072
# FP8 rows a wide matvec takes per pass over x (divides the row block, so they share one scale). A
# row of >= WIDE_COLS columns has an x of >= 32 KiB, which does not stay in L1 beside the weight
# stream: each row then reads x from L2. One thread, CPU time, Zen 4: wo_b 4096x8192 6.8 -> 8.4
# GB/s with 4 rows per pass; narrow rows lose (wq_b 32768x1024 7.3 -> 4.6), so they keep one.
MV_ROWS = 4
WIDE_COLS = 8192
MV_LANES = MV_ROWS * LANES
ROW_TILE = 4  # rows decoded together by matmul
FEW_TOKENS = 3  # FP4 products of 2..FEW_TOKENS tokens decode each byte once for all (`_fp4_mvt`)
FEW_LANES = FEW_TOKENS * FP4_LANES
# V4's FP8 at up to this many tokens, where `_fp8_mvt` does not take it (a weight below the
# parallel floor, or blocks not a multiple of 32 wide), runs the one-token matvec once per token,
# the same bits: the tile kernel decodes each weight into a float32 tile first, a fixed cost of
# several matvecs (M4, 1 thread, CPU time, tile against per token, before the tile's vector
# decode: wq_b 32768x1024 at 2 / 4 / 7 tokens 24.6 / 25.1 / 26.0 ms against 7.3 / 15.5 / 26.5).
FP8_PER_TOKEN = 4
# FP8 products of 2..FP8_FEW tokens (blocks a multiple of 32 wide) decode each 32-column group once
# for all tokens (`_fp8_mvt`), the same bits. M4 (Zen 4), 1 thread, CPU time, V4 128x128 blocks,
# `_fp8_mvt` against the tile kernel (with its vector decode, `_fp8_decode_wide`): wq_b 32768x1024
# at 2 / 4 / 7 tokens 5.4 / 10.2 / 14.4 ms against 7.7 / 9.8 / 11.9; wo_b 4096x8192 6.7 / 9.4 /
# 13.0 against 6.4 / 8.3 / 10.4; V4.1's 32x32 blocks alike. From 4 tokens the tile's decode is
# shared by enough tokens.
FP8_FEW = 3
FP8_FEW_LANES = FP8_FEW * LANES
# Tokens per register block: 4 rows x 3 tokens x 32 lanes are 24 AVX-512 accumulators, and each
# vector load of a weight feeds 3 FMAs instead of 2 (Zen 4, one thread: FP8 64-token matmul
# 71 -> 76 GFLOP/s). A token's result does not depend on its place in the block.
TOKS = 3  # `_fma_block` / `_fp4_fma_block` are written out for 3
TILE_LANES = ROW_TILE * TOKS * 32
# Columns decoded at a time by matmul (a multiple of 128). A token block's lanes leave the
# registers at the end of each chunk: 512 -> 1024 took a 64-token FP8 matmul (Zen 4, one thread,
# weight in L2) from 71 to 78 GFLOP/s; the 16 KiB tile still leaves L1 room for the x slices.
CHUNK = 1024
MAX_TOKENS = 128  # tokens per matmul kernel call (rounded up to a multiple of TOKS); larger X is split
# Below this many weight bytes a matvec runs serially. On 2 EPYC (Zen 4) cores, idle, a
# parallel region saves at most ~20 us on a 2 MB matvec; with the other core busy (reader
# threads, other processes; load 8 here) a 1 MB FP8 matvec took 0.5-4 ms parallel, 0.04-0.14
# ms serial. Every routed or shared expert matrix and the big attention projections stay
# parallel; norms, gates, mHC and small projections do not.
PARALLEL_MIN_BYTES = 4 << 20
# From this many tokens matmul dequantises row tiles and calls BLAS. Measured on the Flash
# shapes (bench/matmul_bw.py, 2 EPYC cores under load 9-13): the fused kernels were faster at
# every count up to 256 (e.g. expert w1 at 256 tokens 240 vs 363 ms); their cost grows
# linearly with tokens (the weight was decoded again per 64 tokens then, 128 now) while BLAS's dequantisation
# is paid once, so BLAS takes over where the fused kernels would decode a weight 8 times.
BLAS_MIN_TOKENS = {"fp4": 512, "fp8": 512, "bf16": 512, "f32": 512}
# The BLAS path is off by default: its rounding differs from the fused kernels', so a prefill
# segment of >= 512 tokens (the planner sizes segments from --budget) would give logits that
# depend on the budget, and greedy ids must not. It never measured faster here either.
BLAS_PATH = False
TILE_ELEMS = 1 << 22  # float32 values per dequantised row tile (16 MiB; one parallel region each)
ACC_LANES = -(-MAX_TOKENS // TOKS) * TILE_LANES
REL_LANES = ROW_TILE * MAX_BLOCKS
CHUNK_LANES = ROW_TILE * CHUNK
_JIT = {"cache": True, "fastmath": False}
_INLINE = {"inline": "always", **_JIT}  # numba-level inlining: stack lanes land in the kernel

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32, _F64 = ir.FloatType(), ir.DoubleType()


# ---- bit-level helpers (LLVM IR: 16/32-bit integer lanes; numba would widen to int64) ----------


def _decode_via_half(builder, byte, mag_shift: int, sign_shift: int, mag_mask: int, lanes: int = 0):
    """uint8 -> float32 through a float16 bit pattern: ((b << mag_shift) & mag_mask) | sign; on a
    vector of `lanes` bytes when lanes > 0."""

    def ty(t):
        return ir.VectorType(t, lanes) if lanes else t

    def const(c):
        return ir.Constant(ty(_I16), [c] * lanes if lanes else c)

    v = builder.zext(byte, ty(_I16))
    mag = builder.and_(builder.shl(v, const(mag_shift)), const(mag_mask))
    sgn = builder.and_(builder.shl(v, const(sign_shift)), const(-0x8000))
    return builder.fpext(builder.bitcast(builder.or_(mag, sgn), ty(ir.HalfType())), ty(_F32))


def _item_ptr(context, builder, aryty, ary, inds, elem: ir.Type):
    """Pointer to ary[inds] (no wraparound: indices are >= 0) as elem* (a vector type for vector
    loads and stores)."""
    inds = [context.cast(builder, v, t, types.intp) for v, t in inds]
    ptr = cgutils.get_item_pointer(context, builder, aryty, context.make_array(aryty)(context, builder, ary), inds)
    return builder.bitcast(ptr, elem.as_pointer())


@intrinsic
def _e2m1_lo(typingctx, b):
    """Low nibble of a packed byte as float32, times 2^-14."""

    def codegen(context, builder, sig, args):
        return _decode_via_half(builder, args[0], 9, 12, 0x0E00)

    return types.float32(types.uint8), codegen


@intrinsic
def _e2m1_hi(typingctx, b):
    """High nibble of a packed byte as float32, times 2^-14."""

    def codegen(context, builder, sig, args):
        return _decode_via_half(builder, args[0], 5, 8, 0x0E00)

    return types.float32(types.uint8), codegen


@intrinsic
def _e4m3(typingctx, b):
    """E4M3FN byte as float32, times 2^-8 (S.1111.111 -> NaN)."""

    def codegen(context, builder, sig, args):
        # sign-extended byte << 7 puts the sign at bit 15 (and a copy at bit 14, masked off) and
        # the 7 magnitude bits at 13..7: the float16 pattern in two operations instead of five
        # (one thread, 32768x1024 FP8 matvec from RAM: 4.04-4.31 -> 3.64-4.07 ms)
        v = builder.sext(args[0], _I16)
        bits = builder.and_(builder.shl(v, ir.Constant(_I16, 7)), ir.Constant(_I16, -0x4080))
        is_nan = builder.icmp_unsigned("==", builder.and_(v, ir.Constant(_I16, 0x7F)), ir.Constant(_I16, 0x7F))
        bits = builder.select(is_nan, ir.Constant(_I16, 0x7E00), bits)
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), _F32)

    return types.float32(types.uint8), codegen


@intrinsic
def _bf16(typingctx, h):
    """BF16 bit pattern (uint16) as float32."""

    def codegen(context, builder, sig, args):
        v = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
        return builder.bitcast(v, _F32)

    return types.float32(types.uint16), codegen


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c, rounded once, whatever the CPU (llvm.fma)."""

    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.fma", [_F32], ir.FunctionType(_F32, [_F32] * 3))
        return builder.call(fn, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _f32_bits(typingctx, f):
    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], _I32), _I64)

    return types.int64(types.float32), codegen


@intrinsic
def _f32_from_bits(typingctx, i):
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.trunc(args[0], _I32), _F32)

    return types.float32(types.int64), codegen


@intrinsic
def _pow2_f64(typingctx, e):
    """2^e as float64 for -1022 <= e <= 1023."""

    def codegen(context, builder, sig, args):
        bits = builder.shl(builder.add(args[0], ir.Constant(_I64, 1023)), ir.Constant(_I64, 52))
        return builder.bitcast(bits, _F64)

    return types.float64(types.int64), codegen


@intrinsic
def _nn(typingctx, i):
    """i, promised to be >= 0: lets LLVM drop numba's negative-index wraparound and vectorise."""

    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.assume", (), ir.FunctionType(ir.VoidType(), [ir.IntType(1)]))
        builder.call(fn, [builder.icmp_signed(">=", args[0], ir.Constant(_I64, 0))])
        return args[0]

    return types.int64(types.int64), codegen


@intrinsic
def _prefetch(typingctx, w, r, j):
    """Ask for the cache line of w[r, j] (a hint: no fault, no result)."""
    sig = types.void(w, r, j)

    def codegen(context, builder, sig, args):
        tw, tr, tj = sig.args
        ptr = _item_ptr(context, builder, tw, args[0], [(args[1], tr), (args[2], tj)], _I8)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch.p0", (), ir.FunctionType(ir.VoidType(), [ptr.type, _I32, _I32, _I32])
        )
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(**_INLINE)
def _prefetch_next_chunk(w, r0, nr, ci, nc, chunk_elems):
    """Prefetch the weight bytes the next chunk of this row tile decodes, or the first chunk of
    the next row tile: weights stream from RAM (expert slots), and a decode that waits on each
    line stalls the FMAs behind it. The token loop in between hides the fetch. One thread, CPU
    time, 2048x4096 FP8 at 384 tokens: 80.8 -> 88.7 GFLOP/s."""
    rows, row_elems = w.shape[0], w.shape[1]
    if ci + 1 < nc:
        r_start, r_end, j0 = r0, r0 + nr, (ci + 1) * chunk_elems
    else:
        r_start, r_end, j0 = r0 + ROW_TILE, min(rows, r0 + 2 * ROW_TILE), 0
    j1 = min(row_elems, j0 + chunk_elems)
    for r in range(r_start, r_end):
        for j in range(j0, j1, 64 // w.itemsize):
            _prefetch(w, r, j)


def _stack_buffer(n, elem: ir.Type, nbtype):
    """Typing of an n-element stack buffer: a pointer into an array allocated once at the
    enclosing function's entry, 64-byte aligned (a vector load must not span two lines)."""
    if not isinstance(n, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        arr = cgutils.alloca_once(builder, ir.ArrayType(elem, n.literal_value))
        arr.align = 64
        return builder.bitcast(arr, elem.as_pointer())

    return types.CPointer(nbtype)(n), codegen


@intrinsic
def _stack_f32(typingctx, n):
    """Pointer to n float32 on the stack of the enclosing function."""
    return _stack_buffer(n, _F32, types.float32)


@intrinsic
def _stack_f64(typingctx, n):
    """Pointer to n float64 on the stack (a row tile's row factors: a heap array per tile was a
    malloc per 4 rows)."""
    return _stack_buffer(n, _F64, types.float64)


# ---- scales: E8M0 bytes or float32, one code path ----------------------------------------------


def _scale_key(v):
    """Order key of a scale: float32-like bits of |scale| (E8M0 byte b -> b << 23)."""


@overload(_scale_key, jit_options=_JIT)
def _ol_scale_key(v):
    if v == types.uint8:
        return lambda v: np.int64(v) << 23
    if v == types.float32:
        return lambda v: _f32_bits(v) & 0x7FFFFFFF
    return None


def _scale_rel(v, e, shift):
    """scale * 2^(127 - e + shift) as float32 (flushed to 0 below float32 normals)."""


@overload(_scale_rel, jit_options=_JIT)
def _ol_scale_rel(v, e, shift):
    if v == types.uint8:

        def rel_e8m0(v, e, shift):
            d = np.int64(v) - e + shift + 127
            return _f32_from_bits(max(d, 0) << 23)

        return rel_e8m0
    if v == types.float32:
        return lambda v, e, shift: np.float32(np.float64(v) * _pow2_f64(127 - e + shift))
    return None


@njit(**_INLINE)
def _row_rel(srow, shift, rel):
    """Relative block scales of one row into rel[:n]; returns the row factor 2^(E-127) (NaN if bad)."""
    n = srow.shape[0]
    kmax = np.int64(0)
    for b in range(n):
        kmax = max(kmax, _scale_key(srow[b]))
    if kmax >= 0x7F800000:
        return np.nan
    e = kmax >> 23
    for b in range(n):
        rel[b] = _scale_rel(srow[b], e, shift)
    return _pow2_f64(e - 127)


# ---- lanes --------------------------------------------------------------------------------------


@intrinsic
def _lane_sum(typingctx, acc, base):
    """Fixed pairwise tree over acc[base : base + 32] (LANES = FP4_LANES = 32): level h adds lane
    k + h to lane k (h = 16, 8, 4, 2, 1). In vector IR: each level adds the upper half of a vector
    to its lower half, which is that tree and what a CPU's own reductions do. numba's scalar version
    (32 loads, each with a negative-index check) cost more than the FMAs of a 1024-column row tile:
    an 8192x1024 FP8 matmul of 384 tokens (wq_b's width), one thread, CPU time, went 58.9 -> 78.6
    GFLOP/s with this."""
    if not (isinstance(acc, types.Array) and acc.ndim == 1 and acc.layout == "C" and acc.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        at = _item_ptr(context, builder, sig.args[0], args[0], [(args[1], sig.args[1])], ir.VectorType(_F32, 32))
        v = builder.load(at, align=4)
        n = 32
        while n > 1:
            n //= 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float32(acc, base), codegen


@njit(**_INLINE)
def _finish(lane_total, fac):
    return np.float32(np.float64(lane_total) * fac)


# ---- FP4 blocks in vector IR ----------------------------------------------------------------------
#
# One 16-byte block of a row: acc[a : a+16] = fma(hi * rel, xo[i], fma(lo * rel, xe[i], acc)),
# lo / hi the byte's nibbles decoded as `_e2m1_lo` / `_e2m1_hi` do (E2M1 times 2^-14 through
# float16). Written in vector IR, not as a numba loop, so the decode is the one chosen here. Two decodes:
# - table (AVX-512): the 16 possible values are one float32 register; `vpermps` looks 16
#   nibbles up at once, after one multiply of the table by rel. ~7 instructions per 16 bytes
#   instead of ~15 (widenings, shifts and masks, float16 conversions, two multiplies). A
#   2048x4096 matvec, one thread, weights in L3, Zen 4: 0.773 -> 0.461 ms. One row at a time:
#   interleaving two rows (four lane chains instead of two) measured slower (0.640 ms).
# - half (any CPU): shifts into float16 bit patterns, widened, times rel. The same matvec
#   compiled for Haswell (AVX2) on this CPU: 0.806 ms as a numba loop, 0.746 ms in vector IR.
# table[c] * rel and decode(c) * rel are the same float32 multiply, so both give the same bits.


def _host_has(feature: str) -> bool:
    from llvmlite import binding
    from numba.core import config

    if config.CPU_NAME:  # a pinned target (portable caches): only what it names
        return f"+{feature}" in (config.CPU_FEATURES or "")
    return bool(binding.get_host_cpu_features().get(feature))


FP4_TABLE = [float(np.array([((c & 7) << 9) | ((c & 8) << 12)], np.uint16).view(np.float16)[0]) for c in range(16)]
FP4_BY_TABLE = _host_has("avx512f")
_V16F, _V16I = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16)


def _splat16(builder, v, vty):
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(_V16I, [0] * 16))


def _fp4_decoded(builder, raw, sr, table: bool = True):
    """16 packed bytes -> (low nibbles, high nibbles) as <16 x float> times sr (see above)."""
    rel = _splat16(builder, sr, _V16F)
    if table and FP4_BY_TABLE:  # never emitted where the instruction does not exist
        idx = builder.zext(raw, _V16I)
        scaled = builder.fmul(ir.Constant(_V16F, FP4_TABLE), rel)
        perm = builder.module.declare_intrinsic(
            "llvm.x86.avx512.permvar.sf.512", (), ir.FunctionType(_V16F, [_V16F, _V16I])
        )
        lo = builder.call(perm, [scaled, builder.and_(idx, ir.Constant(_V16I, [15] * 16))])
        hi = builder.call(perm, [scaled, builder.lshr(idx, ir.Constant(_V16I, [4] * 16))])
    else:
        lo = builder.fmul(_decode_via_half(builder, raw, 9, 12, 0x0E00, 16), rel)
        hi = builder.fmul(_decode_via_half(builder, raw, 5, 8, 0x0E00, 16), rel)
    return lo, hi


def _fp4_block_intrinsic(table: bool, tokens: int = 1):
    """The block op for one token (xe, xo: (C/2,)) or, decoded once, for `tokens` tokens (xe, xo:
    (tokens, C/2); token k's lanes at acc[a + 32 k :], each its own FMA chain as for one token)."""

    def typer(typingctx, w, r, b, xe, xo, sr, acc, a):
        arrays = (w, xe, xo, acc)
        if not all(isinstance(t, types.Array) and t.layout == "C" for t in arrays) or sr != types.float32:
            return None  # vector loads need contiguous rows
        if xe.ndim != (1 if tokens == 1 else 2):
            return None
        sig = types.void(w, r, b, xe, xo, sr, acc, a)

        def codegen(context, builder, sig, args):
            w_, r_, b_, xe_, xo_, sr_, acc_, a_ = args
            tw, tr, tb, txe, txo, _, tacc, ta = sig.args
            i = builder.mul(context.cast(builder, b_, tb, types.intp), ir.Constant(_I64, 16))
            at_i = (i, types.intp)
            raw = builder.load(_item_ptr(context, builder, tw, w_, [(r_, tr), at_i], ir.VectorType(_I8, 16)), align=1)
            lo, hi = _fp4_decoded(builder, raw, sr_, table)
            fma = builder.module.declare_intrinsic("llvm.fma.v16f32", (), ir.FunctionType(_V16F, [_V16F] * 3))
            a0 = context.cast(builder, a_, ta, types.intp)
            for k in range(tokens):
                row = [] if tokens == 1 else [(ir.Constant(_I64, k), types.intp)]
                xe_v = builder.load(_item_ptr(context, builder, txe, xe_, [*row, at_i], _V16F), align=4)
                xo_v = builder.load(_item_ptr(context, builder, txo, xo_, [*row, at_i], _V16F), align=4)
                ak = builder.add(a0, ir.Constant(_I64, 32 * k))
                acc_ptr = _item_ptr(context, builder, tacc, acc_, [(ak, types.intp)], _V16F)
                v = builder.call(fma, [lo, xe_v, builder.load(acc_ptr, align=4)])
                builder.store(builder.call(fma, [hi, xo_v, v]), acc_ptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    name = ("_fp4_block_table" if table else "_fp4_block_half") + (f"_t{tokens}" if tokens > 1 else "")
    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


_fp4_block_table = _fp4_block_intrinsic(True)  # the half decode where AVX-512 is missing
_fp4_block_half = _fp4_block_intrinsic(False)
# A few tokens (2 or 3: a routed expert in a short prompt) at the matvec's cost per weight byte
# plus two FMAs per extra token, instead of `_fp4_mm`'s tile of 3 tokens: a Flash expert's w1/w3
# pair at 2 tokens, 2 threads, Zen 4, 2.31 -> 1.02 ms (3 tokens 1.90 -> 1.54); the same bits.
_fp4_block_t2 = _fp4_block_intrinsic(True, 2)
_fp4_block_t3 = _fp4_block_intrinsic(True, 3)


@njit(**_INLINE)
def _fp4_block(w, r, b, xe, xo, sr, acc):
    """Block b (16 bytes) of row r into lanes (b mod 2) * 16 .. + 16."""
    _fp4_block_table(w, r, b, xe, xo, sr, acc, (b % 2) * 16)


@njit(**_INLINE)
def _fp4_row(w, s, r, xe, xo, rel, acc):
    """Row r of packed FP4 (R, C/2) with (R, C/32) scales, dot x given as its even / odd halves.

    Even and odd 32-blocks go to separate lanes: two independent FMA chains per row.
    """
    fac = _row_rel(s[r], 14, rel)
    for k in range(FP4_LANES):
        acc[k] = 0
    nb = w.shape[1] // 16
    for bp in range(nb // 2):
        _fp4_block(w, r, 2 * bp, xe, xo, rel[2 * bp], acc)
        _fp4_block(w, r, 2 * bp + 1, xe, xo, rel[2 * bp + 1], acc)
    if nb % 2:
        _fp4_block(w, r, nb - 1, xe, xo, rel[nb - 1], acc)
    return _finish(_lane_sum(acc, 0), fac)


@njit(**_INLINE)
def _fp4_row_tokens(w, s, r, xe, xo, rel, acc, out):
    """`_fp4_row` for the 2 or 3 tokens of xe / xo (T, C/2) into out[:, r]; lanes per token as there."""
    t = xe.shape[0]
    fac = _row_rel(s[r], 14, rel)
    for k in range(t * FP4_LANES):
        acc[k] = 0
    nb = w.shape[1] // 16
    for bp in range(nb // 2):
        if t == 2:
            _fp4_block_t2(w, r, 2 * bp, xe, xo, rel[2 * bp], acc, 0)
            _fp4_block_t2(w, r, 2 * bp + 1, xe, xo, rel[2 * bp + 1], acc, 16)
        else:
            _fp4_block_t3(w, r, 2 * bp, xe, xo, rel[2 * bp], acc, 0)
            _fp4_block_t3(w, r, 2 * bp + 1, xe, xo, rel[2 * bp + 1], acc, 16)
    if nb % 2:
        if t == 2:
            _fp4_block_t2(w, r, nb - 1, xe, xo, rel[nb - 1], acc, 0)
        else:
            _fp4_block_t3(w, r, nb - 1, xe, xo, rel[nb - 1], acc, 0)
    for k in range(t):
        out[k, r] = _finish(_lane_sum(acc, k * FP4_LANES), fac)


@njit(**_INLINE)
def _fp8_row(w, s, br, bc, r, x, rel, acc):
    """Row r of E4M3 (R, C) with (br, bc) block scales, dot x (C,)."""
    # _nn on every index: with the block width bc a run-time value, LLVM cannot prove j0 + k >= 0,
    # keeps numba's negative-index wraparound per element and leaves the 32 lanes scalar (one
    # thread, CPU time, 2048x4096 matvec: 5.99 -> 0.65 ms with it; the same bits)
    fac = _row_rel(s[r // br], 8, rel)
    cols = w.shape[1]
    for k in range(LANES):
        acc[k] = 0
    for cb in range(s.shape[1]):
        sr = rel[cb]
        j0 = cb * bc
        j1 = min(cols, j0 + bc)
        while j0 + LANES <= j1:
            for k in range(LANES):
                acc[k] = _fma(_e4m3(w[r, _nn(j0 + k)]) * sr, x[_nn(j0 + k)], acc[k])
            j0 += LANES
        for k in range(j1 - j0):
            acc[k] = _fma(_e4m3(w[r, _nn(j0 + k)]) * sr, x[_nn(j0 + k)], acc[k])
    return _finish(_lane_sum(acc, 0), fac)


@njit(**_INLINE)
def _fp8_rows(w, s, br, bc, r, x, rel, acc, out):
    """Rows r .. r + MV_ROWS of E4M3 (one br-row scale block) dot x into out: each x element is
    loaded once for all of them (a wide row's x does not stay in L1), each row's lanes as `_fp8_row`."""
    fac = _row_rel(s[r // br], 8, rel)
    cols = w.shape[1]
    for k in range(MV_ROWS * LANES):
        acc[k] = 0
    for cb in range(s.shape[1]):
        sr = rel[cb]
        j0 = cb * bc
        j1 = min(cols, j0 + bc)
        while j0 + LANES <= j1:
            for q in range(MV_ROWS):
                for k in range(LANES):
                    acc[q * LANES + k] = _fma(_e4m3(w[r + q, _nn(j0 + k)]) * sr, x[_nn(j0 + k)], acc[q * LANES + k])
            j0 += LANES
        for q in range(MV_ROWS):
            for k in range(j1 - j0):
                acc[q * LANES + k] = _fma(_e4m3(w[r + q, _nn(j0 + k)]) * sr, x[_nn(j0 + k)], acc[q * LANES + k])
    for q in range(MV_ROWS):
        out[r + q] = _finish(_lane_sum(acc, q * LANES), fac)


@njit(**_INLINE)
def _plain_row(w, r, x, acc):
    """Row r of BF16 bits (uint16) or float32 (R, C), dot x (C,)."""
    cols = w.shape[1]
    nb = cols // LANES
    for k in range(LANES):
        acc[k] = 0
    for b in range(nb):
        for k in range(LANES):
            acc[k] = _fma(_widen(w[r, b * LANES + k]), x[b * LANES + k], acc[k])
    for k in range(cols - nb * LANES):
        acc[k] = _fma(_widen(w[r, nb * LANES + k]), x[nb * LANES + k], acc[k])
    return _finish(_lane_sum(acc, 0), 1.0)


def _widen(v):
    """A plain weight element as float32."""


@overload(_widen, jit_options=_JIT)
def _ol_widen(v):
    if v == types.uint16:
        return lambda v: _bf16(v)
    if v == types.float32:
        return lambda v: v
    return None


# Matvec kernels take the input per group: x (g, C) and rows per group rpg, row r meeting
# x[r // rpg] (g = 1 for a plain matvec; the grouped output projection in one call). Each comes
# parallel and serial (same loop body, so the same bits): a parallel region costs ~15 us on an
# idle core and milliseconds when the other core is busy, more than a small matrix takes alone.


@njit(parallel=True, **_JIT)
def _fp4_mv(w, s, xe, xo, rpg, out):
    for r in prange(w.shape[0]):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(LANES), (LANES,))
        out[r] = _fp4_row(w, s, r, xe[r // rpg], xo[r // rpg], rel, acc)


@njit(**_JIT)
def _fp4_mv_serial(w, s, xe, xo, rpg, out):
    rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
    acc = carray(_stack_f32(LANES), (LANES,))
    for r in range(w.shape[0]):
        out[r] = _fp4_row(w, s, r, xe[r // rpg], xo[r // rpg], rel, acc)


@njit(parallel=True, **_JIT)
def _fp8_mv(w, s, br, bc, x, rpg, out):
    for r in prange(w.shape[0]):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(LANES), (LANES,))
        out[r] = _fp8_row(w, s, br, bc, r, x[r // rpg], rel, acc)


@njit(**_JIT)
def _fp8_mv_serial(w, s, br, bc, x, rpg, out):
    rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
    acc = carray(_stack_f32(LANES), (LANES,))
    for r in range(w.shape[0]):
        out[r] = _fp8_row(w, s, br, bc, r, x[r // rpg], rel, acc)


@njit(parallel=True, **_JIT)
def _fp8_mv_wide(w, s, br, bc, x, rpg, out):
    """`_fp8_mv` by MV_ROWS rows at a time (the same bits: each row's lanes are its own); the
    caller makes sure MV_ROWS divides br."""
    n = w.shape[0] // MV_ROWS if rpg % MV_ROWS == 0 else 0
    for g in prange(n):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(MV_LANES), (MV_LANES,))
        r = g * MV_ROWS
        _fp8_rows(w, s, br, bc, r, x[r // rpg], rel, acc, out)
    rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
    acc = carray(_stack_f32(LANES), (LANES,))
    for r in range(n * MV_ROWS, w.shape[0]):
        out[r] = _fp8_row(w, s, br, bc, r, x[r // rpg], rel, acc)


@njit(parallel=True, **_JIT)
def _plain_mv(w, x, rpg, out):
    for r in prange(w.shape[0]):
        acc = carray(_stack_f32(LANES), (LANES,))
        out[r] = _plain_row(w, r, x[r // rpg], acc)


@njit(**_JIT)
def _plain_mv_serial(w, x, rpg, out):
    acc = carray(_stack_f32(LANES), (LANES,))
    for r in range(w.shape[0]):
        out[r] = _plain_row(w, r, x[r // rpg], acc)


@njit(parallel=True, **_JIT)
def _fp4_mv2(w1, s1, w3, s3, xe, xo, out1, out3):
    """Two weights of one shape times one x: one parallel region instead of two."""
    for r in prange(w1.shape[0]):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(LANES), (LANES,))
        out1[r] = _fp4_row(w1, s1, r, xe, xo, rel, acc)
        out3[r] = _fp4_row(w3, s3, r, xe, xo, rel, acc)


@njit(parallel=True, **_JIT)
def _fp4_mvt(w, s, xe, xo, out):
    """out (T, R) for T = 2 or 3 tokens (xe, xo: (T, C/2)): each weight byte decoded once for all."""
    for r in prange(w.shape[0]):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(FEW_LANES), (FEW_LANES,))
        _fp4_row_tokens(w, s, r, xe, xo, rel, acc, out)


@njit(parallel=True, **_JIT)
def _fp4_mvt2(w1, s1, w3, s3, xe, xo, out1, out3):
    """`_fp4_mvt` of two weights of one shape (a routed expert's w1 and w3): one parallel region."""
    for r in prange(w1.shape[0]):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(FEW_LANES), (FEW_LANES,))
        _fp4_row_tokens(w1, s1, r, xe, xo, rel, acc, out1)
        _fp4_row_tokens(w3, s3, r, xe, xo, rel, acc, out3)


@njit(parallel=True, **_JIT)
def _fp8_mv2(w1, s1, w3, s3, br, bc, x, out1, out3):
    for r in prange(w1.shape[0]):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(LANES), (LANES,))
        out1[r] = _fp8_row(w1, s1, br, bc, r, x, rel, acc)
        out3[r] = _fp8_row(w3, s3, br, bc, r, x, rel, acc)


# ---- rows dequantised to float32 for BLAS (prefill-sized token counts) ----------------------------
#
# Values come out relative to each row's largest block scale (times `rel`, exactly as the fused
# kernels scale them) and the row factor 2^(E-127) is applied to the product afterwards in
# float64: a row of 2^-127 scales stays in float32's normal range inside BLAS.


@njit(parallel=True, **_JIT)
def _fp4_dequant(w, s, r0, tile, fac):
    """Rows r0 .. r0+n of packed FP4 -> tile (n, C) float32 relative values, fac (n,) row factors."""
    for q in prange(tile.shape[0]):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        r = r0 + q
        fac[q] = _row_rel(s[r], 14, rel)
        for b in range(w.shape[1] // 16):
            sr = rel[b]
            for k in range(16):
                byte = w[r, b * 16 + k]
                tile[q, 32 * b + 2 * k] = _e2m1_lo(byte) * sr
                tile[q, 32 * b + 2 * k + 1] = _e2m1_hi(byte) * sr


@njit(parallel=True, **_JIT)
def _fp8_dequant(w, s, br, bc, r0, tile, fac):
    cols = w.shape[1]
    for q in prange(tile.shape[0]):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        r = r0 + q
        fac[q] = _row_rel(s[r // br], 8, rel)
        for cb in range(s.shape[1]):
            sr = rel[cb]
            for j in range(cb * bc, min(cols, cb * bc + bc)):
                tile[q, j] = _e4m3(w[r, j]) * sr


@njit(parallel=True, **_JIT)
def _plain_dequant(w, r0, tile, fac):
    for q in prange(tile.shape[0]):
        fac[q] = 1.0
        for j in range(w.shape[1]):
            tile[q, j] = _widen(w[r0 + q, j])


# ---- a tile of rows times a few tokens (decode once per column chunk, reuse for every token) -----
#
# Stack layout of one row tile: rel (4 rows x MAX_BLOCKS), the decoded chunk (4 rows x CHUNK
# float32, 16 KiB: stays in L1 next to the token slices it meets) and the lanes of every
# (token, row) pair (MAX_TOKENS x 4 x 32). Stack buffers cannot alias the weights, so LLVM
# vectorises the decode and keeps the lanes in registers without runtime checks.


@njit(**_INLINE)
def _fp4_decode(w, r, rel, c0, cw, tile, q):
    """Columns c0 .. c0+cw of row r times their blocks' rel: even elements to tile[q, :cw/2], odd to
    tile[q, CHUNK/2:] (exact: rel is a power of two and the products stay above 2^-149)."""
    for b in range(cw // 32):
        sr = rel[c0 // 32 + b]
        for k in range(16):
            i = b * 16 + k
            byte = w[r, _nn(c0 // 2 + i)]
            tile[q * CHUNK + i] = _e2m1_lo(byte) * sr
            tile[q * CHUNK + CHUNK // 2 + i] = _e2m1_hi(byte) * sr


@njit(**_INLINE)
def _fp4_fma_row(tile, q, i, xe0, xo0, xe1, xo1, xe2, xo2, acc, a):
    """Lane a of row q's three tokens (lanes 128 apart), as `_fp4_block` does it. Written out:
    numba's loops over tokens and rows would stop LLVM vectorising the lane loop around them."""
    lo = tile[q * CHUNK + i]
    hi = tile[q * CHUNK + CHUNK // 2 + i]
    acc[a] = _fma(hi, xo0, _fma(lo, xe0, acc[a]))
    acc[a + 128] = _fma(hi, xo1, _fma(lo, xe1, acc[a + 128]))
    acc[a + 256] = _fma(hi, xo2, _fma(lo, xe2, acc[a + 256]))


@njit(**_INLINE)
def _fp4_fma_block(tile, xe, xo, t, h, i, k, acc, a0):
    """Lane k of 4 rows x TOKS tokens for byte i of the chunk (x offset h = c0 / 2)."""
    j = h + i
    xe0, xo0, xe1, xo1, xe2, xo2 = xe[t, j], xo[t, j], xe[t + 1, j], xo[t + 1, j], xe[t + 2, j], xo[t + 2, j]
    _fp4_fma_row(tile, 0, i, xe0, xo0, xe1, xo1, xe2, xo2, acc, a0 + k)
    _fp4_fma_row(tile, 1, i, xe0, xo0, xe1, xo1, xe2, xo2, acc, a0 + 32 + k)
    _fp4_fma_row(tile, 2, i, xe0, xo0, xe1, xo1, xe2, xo2, acc, a0 + 64 + k)
    _fp4_fma_row(tile, 3, i, xe0, xo0, xe1, xo1, xe2, xo2, acc, a0 + 96 + k)


@njit(**_INLINE)
def _fp4_chunk_times_tokens(tile, xe, xo, c0, cw, acc, last, fac, out, r0, nr):
    """Byte i of a 32-byte group feeds lane i mod 32: two 32-blocks, parity first (CHUNK / 32 is
    even, so a block's parity within the chunk is its parity within the row). See `_block_start`."""
    nbytes = cw // 2
    ng = nbytes // FP4_LANES
    for p in range(xe.shape[0] // TOKS):
        a0 = p * TILE_LANES
        _block_start(acc, a0, c0)
        for g in range(ng):
            for k in range(FP4_LANES):
                _fp4_fma_block(tile, xe, xo, TOKS * p, c0 // 2, g * FP4_LANES + k, k, acc, a0)
        for k in range(nbytes - ng * FP4_LANES):
            _fp4_fma_block(tile, xe, xo, TOKS * p, c0 // 2, ng * FP4_LANES + k, k, acc, a0)
        if last:
            _block_out(acc, a0, fac, out, r0, nr, TOKS * p)


@njit(**_INLINE)
def _fp8_decode(w, r, rel, bc, c0, cw, tile, q):
    """Same loop shape as `_fp8_row`; c0 is a multiple of bc (bc divides CHUNK)."""
    for cb in range((cw + bc - 1) // bc):
        sr = rel[c0 // bc + cb]
        j0 = cb * bc
        j1 = min(cw, j0 + bc)
        while j0 + LANES <= j1:
            for k in range(LANES):
                tile[q * CHUNK + j0 + k] = _e4m3(w[r, _nn(c0 + j0 + k)]) * sr
            j0 += LANES
        for k in range(j1 - j0):
            tile[q * CHUNK + j0 + k] = _e4m3(w[r, _nn(c0 + j0 + k)]) * sr


@njit(**_INLINE)
def _plain_decode(w, r, c0, cw, tile, q):
    for j in range(cw):
        tile[q * CHUNK + j] = _widen(w[r, _nn(c0 + j)])


@njit(**_INLINE)
def _fma_row(tile, q, j, x0, x1, x2, acc, a):
    w = tile[q * CHUNK + j]
    acc[a] = _fma(w, x0, acc[a])
    acc[a + 128] = _fma(w, x1, acc[a + 128])
    acc[a + 256] = _fma(w, x2, acc[a + 256])


@njit(**_INLINE)
def _fma_block(tile, xs, t, c0, j, k, acc, a0):
    """Lane k of 4 rows x TOKS tokens: acc[a0 + (u*4 + q)*32 + k] += tile[q, j] * xs[t + u, c0 + j]."""
    x0, x1, x2 = xs[t, c0 + j], xs[t + 1, c0 + j], xs[t + 2, c0 + j]
    _fma_row(tile, 0, j, x0, x1, x2, acc, a0 + k)
    _fma_row(tile, 1, j, x0, x1, x2, acc, a0 + 32 + k)
    _fma_row(tile, 2, j, x0, x1, x2, acc, a0 + 64 + k)
    _fma_row(tile, 3, j, x0, x1, x2, acc, a0 + 96 + k)


@njit(**_INLINE)
def _chunk_times_tokens(tile, xs, c0, cw, acc, last, fac, out, r0, nr):
    """Add the decoded chunk (4 rows x cw) times xs[:, c0 : c0 + cw] to every token block's lanes."""
    nb = cw // LANES
    for p in range(xs.shape[0] // TOKS):
        t = TOKS * p
        a0 = p * TILE_LANES
        _block_start(acc, a0, c0)
        for b in range(nb):
            for k in range(LANES):
                _fma_block(tile, xs, t, c0, b * LANES + k, k, acc, a0)
        for k in range(cw - nb * LANES):
            _fma_block(tile, xs, t, c0, nb * LANES + k, k, acc, a0)
        if last:
            _block_out(acc, a0, fac, out, r0, nr, t)


@njit(**_INLINE)
def _block_start(acc, a0, c0):
    """A token block's lanes start at zero in the first chunk, and leave in the last one
    (`_block_out`) right after their final FMAs, while still in L1: 128 tokens' lanes are 66 KB,
    so zeroing and summing them all per row tile went through L2. (Measured within noise on
    one thread: 64-token FP8 2048x4096 70.6 -> 72.8 GFLOP/s; wq_b's 1024 columns stay at ~49.)"""
    if c0 == 0:
        for k in range(TILE_LANES):
            acc[a0 + k] = 0


@njit(**_INLINE)
def _block_out(acc, a0, fac, out, r0, nr, t0):
    """Outputs of one token block: lanes (u * ROW_TILE + q) * 32 of token t0 + u, row r0 + q."""
    for u in range(min(TOKS, out.shape[0] - t0)):
        for q in range(nr):
            out[t0 + u, r0 + q] = _finish(_lane_sum(acc, a0 + (u * ROW_TILE + q) * LANES), fac[q])


@njit(**_INLINE)
def _chunk_start(c, nch, ntiles):
    """First row tile of chunk c of nch (contiguous, sizes differing by at most one)."""
    return (c * ntiles) // nch


@njit(parallel=True, **_JIT)
def _fp4_mm(w, s, xe, xo, out, accs, tiles, rels):
    """out (T, R) = X @ W.T for T <= MAX_TOKENS; xe / xo: X[:, 0::2] / X[:, 1::2], T rounded up to a
    multiple of TOKS. accs / tiles / rels: one row of scratch per chunk of row tiles (`_scratch`)."""
    rows, cols = w.shape[0], 2 * xe.shape[1]
    ntiles = (rows + ROW_TILE - 1) // ROW_TILE
    nch = accs.shape[0]
    for c in prange(nch):
        acc, tile, rel = accs[c], tiles[c], rels[c]
        fac = carray(_stack_f64(ROW_TILE), (ROW_TILE,))
        for ti in range(_chunk_start(c, nch, ntiles), _chunk_start(c + 1, nch, ntiles)):
            r0 = ti * ROW_TILE
            nr = min(ROW_TILE, rows - r0)
            for q in range(nr):
                fac[q] = _row_rel(s[r0 + q], 14, rel[q * MAX_BLOCKS :])
            if nr < ROW_TILE:  # the missing rows are multiplied too (their lanes are dropped)
                tile[:] = 0
            nc = (cols + CHUNK - 1) // CHUNK
            for ci in range(nc):
                c0 = ci * CHUNK
                cw = min(CHUNK, cols - c0)
                for q in range(nr):
                    _fp4_decode(w, r0 + q, rel[q * MAX_BLOCKS :], c0, cw, tile, q)
                _prefetch_next_chunk(w, r0, nr, ci, nc, CHUNK // 2)
                _fp4_chunk_times_tokens(tile, xe, xo, c0, cw, acc, ci == nc - 1, fac, out, r0, nr)


@njit(parallel=True, **_JIT)
def _fp8_mm(w, s, br, bc, xs, out, accs, tiles, rels):
    rows, cols = w.shape[0], xs.shape[1]
    ntiles = (rows + ROW_TILE - 1) // ROW_TILE
    nch = accs.shape[0]
    for c in prange(nch):
        acc, tile, rel = accs[c], tiles[c], rels[c]
        fac = carray(_stack_f64(ROW_TILE), (ROW_TILE,))
        for ti in range(_chunk_start(c, nch, ntiles), _chunk_start(c + 1, nch, ntiles)):
            r0 = ti * ROW_TILE
            nr = min(ROW_TILE, rows - r0)
            for q in range(nr):
                fac[q] = _row_rel(s[(r0 + q) // br], 8, rel[q * MAX_BLOCKS :])
            if nr < ROW_TILE:  # the missing rows are multiplied too (their lanes are dropped)
                tile[:] = 0
            nc = (cols + CHUNK - 1) // CHUNK
            for ci in range(nc):
                c0 = ci * CHUNK
                cw = min(CHUNK, cols - c0)
                for q in range(nr):
                    if bc % 32 == 0 and cw % 32 == 0:
                        _fp8_decode_wide(w, r0 + q, rel[q * MAX_BLOCKS :], bc, c0, cw, tile, q)
                    else:
                        _fp8_decode(w, r0 + q, rel[q * MAX_BLOCKS :], bc, c0, cw, tile, q)
                _prefetch_next_chunk(w, r0, nr, ci, nc, CHUNK)
                _chunk_times_tokens(tile, xs, c0, cw, acc, ci == nc - 1, fac, out, r0, nr)


@njit(parallel=True, **_JIT)
def _plain_mm(w, xs, out, accs, tiles):
    rows, cols = w.shape[0], xs.shape[1]
    ntiles = (rows + ROW_TILE - 1) // ROW_TILE
    nch = accs.shape[0]
    for c in prange(nch):
        acc, tile = accs[c], tiles[c]
        fac = carray(_stack_f64(ROW_TILE), (ROW_TILE,))
        fac[:] = 1.0
        for ti in range(_chunk_start(c, nch, ntiles), _chunk_start(c + 1, nch, ntiles)):
            r0 = ti * ROW_TILE
            nr = min(ROW_TILE, rows - r0)
            if nr < ROW_TILE:  # the missing rows are multiplied too (their lanes are dropped)
                tile[:] = 0
            nc = (cols + CHUNK - 1) // CHUNK
            for ci in range(nc):
                c0 = ci * CHUNK
                cw = min(CHUNK, cols - c0)
                for q in range(nr):
                    _plain_decode(w, r0 + q, c0, cw, tile, q)
                _prefetch_next_chunk(w, r0, nr, ci, nc, CHUNK)
                _chunk_times_tokens(tile, xs, c0, cw, acc, ci == nc - 1, fac, out, r0, nr)


# ---- FP8 in vector IR: 32 columns per vector op (V4's 128-column blocks, V4.1's 32) ---------------
#
# Where scale blocks are a multiple of 32 columns wide, a 32-column group lies in one block and
# is one lane group: 32 bytes decoded at once in vector IR, times the block's rel, one
# <32 x float> FMA into the lanes. The same operations as `_fp8_row` / `_fp8_decode` (lane =
# column mod 32, `fma(e4m3(w) * rel, x, lane)`), so the same bits; numba's scalar loop over a
# block of unknown width was not vectorised (V4.1's FP8 one token ~1.2 GB/s per CPU-second
# against FP4's ~11). The rows of a block row share one scale row: its rel is computed once for
# them, not per row (160 blocks for a 5120-column row).

_V32F, _V32H = ir.VectorType(_F32, 32), ir.VectorType(_I16, 32)


def _e4m3_v32(builder, raw):
    """<32 x i8> E4M3 bytes -> <32 x float>, times 2^-8: `_e4m3` lane-wise."""

    def c(k):
        return ir.Constant(_V32H, [k] * 32)

    v = builder.sext(raw, _V32H)
    bits = builder.and_(builder.shl(v, c(7)), c(-0x4080))
    is_nan = builder.icmp_unsigned("==", builder.and_(v, c(0x7F)), c(0x7F))
    bits = builder.select(is_nan, c(0x7E00), bits)
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 32)), _V32F)


def _splat32(builder, v):
    one = builder.insert_element(ir.Constant(_V32F, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, 32), [0] * 32))


# A 32-byte group without subnormal or NaN bytes (nearly every group of real weights: 0.3 % of
# the groups of Gaussian weights quantised per 128x128 block have a subnormal) is decoded
# straight into float32 bits: sign-extended byte << 20, masked, is the E4M3 value times 2^-120,
# a normal float32; rel * 2^112 is exact (rel < 2^9), so its product with that is the same real
# number as `_e4m3_v32`'s value times rel, rounded once: the same bits. Other groups
# take `_e4m3_v32`: a subnormal float32 operand costs Zen 4 a slow multiply (uniform random
# bytes, 1/16 subnormal, ran at 0.66x), and NaN bytes need the select. M4, wq_b 32768x1024
# from RAM, one row at a time, wall: 1 thread 9.5 -> 11.5 GB/s, 2 threads 17.0 -> 20.8;
# a shared expert's 2048x4096 at 2 threads 22.1 -> 29.0 GB/s.
_DIRECT_SHIFT = 2.0**112
_V32I = ir.VectorType(_I32, 32)


def _e4m3_special(builder, raw):
    """i1: any byte of <32 x i8> raw is an E4M3 subnormal (magnitude 1..7) or NaN (0x7F)."""

    def c(k):
        return ir.Constant(ir.VectorType(_I8, 32), [k] * 32)

    mag = builder.and_(raw, c(0x7F))
    sub = builder.icmp_unsigned("<", builder.sub(mag, c(1)), c(7))  # 0 wraps to 255
    nan = builder.icmp_unsigned("==", mag, c(0x7F))
    any_ = builder.bitcast(builder.or_(sub, nan), ir.IntType(32))
    return builder.icmp_unsigned("!=", any_, ir.Constant(ir.IntType(32), 0))


def _decoded32(context, builder, tw, w_, r_, tr, j_, tj, sr_):
    """e4m3(w[r, j : j+32]) * 2^-8 * sr as <32 x float>, by the direct decode where it applies."""
    raw = builder.load(_item_ptr(context, builder, tw, w_, [(r_, tr), (j_, tj)], ir.VectorType(_I8, 32)), align=1)
    special = _e4m3_special(builder, raw)
    with builder.if_else(special, likely=False) as (slow, fast):
        with slow:
            via_half = builder.fmul(_e4m3_v32(builder, raw), _splat32(builder, sr_))
            slow_end = builder.block
        with fast:
            bits = builder.shl(builder.sext(raw, _V32I), ir.Constant(_V32I, [20] * 32))
            bits = builder.and_(bits, ir.Constant(_V32I, [-0x78100000] * 32))  # 0x87F00000
            sr112 = builder.fmul(sr_, ir.Constant(_F32, _DIRECT_SHIFT))
            direct = builder.fmul(builder.bitcast(bits, _V32F), _splat32(builder, sr112))
            fast_end = builder.block
    d = builder.phi(_V32F)
    d.add_incoming(via_half, slow_end)
    d.add_incoming(direct, fast_end)
    return d


def _fma32_into(builder, d, x_ptr, acc_ptr):
    """*acc_ptr = fma(d, *x_ptr, *acc_ptr) on <32 x float>."""
    fma = builder.module.declare_intrinsic("llvm.fma.v32f32", (), ir.FunctionType(_V32F, [_V32F] * 3))
    xv = builder.load(x_ptr, align=4)
    builder.store(builder.call(fma, [d, xv, builder.load(acc_ptr, align=4)]), acc_ptr, align=4)


@intrinsic
def _fp8_dec32(typingctx, w, r, j, sr, tile, a):
    """tile[a : a+32] = e4m3(w[r, j : j+32]) * sr."""
    if not all(isinstance(t, types.Array) and t.layout == "C" for t in (w, tile)) or sr != types.float32:
        return None
    sig = types.void(w, r, j, sr, tile, a)

    def codegen(context, builder, sig, args):
        w_, r_, j_, sr_, tile_, a_ = args
        tw, tr, tj, _, ttile, ta = sig.args
        d = _decoded32(context, builder, tw, w_, r_, tr, j_, tj, sr_)
        builder.store(d, _item_ptr(context, builder, ttile, tile_, [(a_, ta)], _V32F), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _fp8_dot32_intrinsic(rows: int):
    """The row op for `rows` rows from r: acc[32 q : 32 q + 32] += row r + q's whole 32-column groups
    (ng of them; block b = group // gpb has rel[b]) decoded times rel times x, lane = column mod 32,
    in column order. The lanes stay in registers for the whole row (a <32 x float> FMA chain per
    row), and each x group is loaded once for the rows."""

    def typer(typingctx, w, r, x, rel, gpb, ng, acc):
        arrays = (w, x, rel, acc)
        if not all(isinstance(t, types.Array) and t.layout == "C" for t in arrays):
            return None  # vector loads need contiguous rows
        if w.dtype != types.uint8 or any(t.dtype != types.float32 for t in arrays[1:]):
            return None
        sig = types.void(w, r, x, rel, gpb, ng, acc)

        def codegen(context, builder, sig, args):
            w_, r_, x_, rel_, gpb_, ng_, acc_ = args
            tw, tr, tx, trel, tgpb, tng, tacc = sig.args
            fma = builder.module.declare_intrinsic("llvm.fma.v32f32", (), ir.FunctionType(_V32F, [_V32F] * 3))
            r0 = context.cast(builder, r_, tr, types.intp)
            gpb = context.cast(builder, gpb_, tgpb, types.intp)
            ng = context.cast(builder, ng_, tng, types.intp)
            at = [
                _item_ptr(context, builder, tacc, acc_, [(ir.Constant(_I64, LANES * q), types.intp)], _V32F)
                for q in range(rows)
            ]
            lanes = [cgutils.alloca_once(builder, _V32F) for _ in range(rows)]  # promoted to registers
            for q in range(rows):
                builder.store(builder.load(at[q], align=4), lanes[q])
            nblk = builder.sdiv(builder.add(ng, builder.sub(gpb, ir.Constant(_I64, 1))), gpb)
            with cgutils.for_range(builder, nblk) as blk:
                sr = builder.load(_item_ptr(context, builder, trel, rel_, [(blk.index, types.intp)], _F32), align=4)
                g0 = builder.mul(blk.index, gpb)
                g1 = builder.add(g0, gpb)
                g1 = builder.select(builder.icmp_signed("<", g1, ng), g1, ng)
                with cgutils.for_range_slice(builder, g0, g1, ir.Constant(_I64, 1), inc=True) as (g, _):
                    j = builder.mul(g, ir.Constant(_I64, LANES))
                    xv = builder.load(_item_ptr(context, builder, tx, x_, [(j, types.intp)], _V32F), align=4)
                    for q in range(rows):
                        rq = builder.add(r0, ir.Constant(_I64, q))
                        d = _decoded32(context, builder, tw, w_, rq, types.intp, j, types.intp, sr)
                        builder.store(builder.call(fma, [d, xv, builder.load(lanes[q])]), lanes[q])
            for q in range(rows):
                builder.store(builder.load(lanes[q]), at[q], align=4)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = typer.__qualname__ = f"_fp8_dot32_r{rows}"
    return intrinsic(typer)


_fp8_dot32 = _fp8_dot32_intrinsic(1)
_fp8_dot32_rows = _fp8_dot32_intrinsic(MV_ROWS)


@njit(**_INLINE)
def _fp8_tail(w, r, x, rel, bc, acc, a):
    """Row r's last cols mod 32 columns (in one scale block) into lanes a.. (`_fp8_row`'s tail)."""
    cols = w.shape[1]
    j = cols - cols % 32
    for k in range(cols % 32):
        acc[a + k] = _fma(_e4m3(w[r, j + k]) * rel[j // bc], x[j + k], acc[a + k])


# Rows per task of the vector FP8 matvec: a task's rows share one scale row (32 divides V4's 128
# and is V4.1's block), and a shared expert's 2048 rows make 64 tasks, not the 16 of its 128-row
# blocks, so 8-16 threads stay evenly busy.
TASK_ROWS = 32


@njit(**_INLINE)
def _fp8_rowtask(w, s, br, bc, task, wide, x, rpg, out, rel, acc):
    """Task `task`'s rows (at most TASK_ROWS of one scale row, blocks a multiple of 32 wide) into
    out, x group r // rpg per row; `wide`: MV_ROWS rows per pass over x (see WIDE_COLS) where
    they share an x group."""
    per = -(-br // TASK_ROWS)
    g = task // per
    fac = _row_rel(s[g], 8, rel)
    r = g * br + (task % per) * TASK_ROWS
    r1 = min(w.shape[0], g * br + br, r + TASK_ROWS)
    ng, gpb = w.shape[1] // 32, bc // 32
    while wide and r + MV_ROWS <= r1 and r // rpg == (r + MV_ROWS - 1) // rpg:
        for k in range(MV_LANES):
            acc[k] = 0
        _fp8_dot32_rows(w, r, x[r // rpg], rel, gpb, ng, acc)
        for q in range(MV_ROWS):
            _fp8_tail(w, r + q, x[r // rpg], rel, bc, acc, q * LANES)
            out[r + q] = _finish(_lane_sum(acc, q * LANES), fac)
        r += MV_ROWS
    while r < r1:
        for k in range(LANES):
            acc[k] = 0
        _fp8_dot32(w, r, x[r // rpg], rel, gpb, ng, acc)
        _fp8_tail(w, r, x[r // rpg], rel, bc, acc, 0)
        out[r] = _finish(_lane_sum(acc, 0), fac)
        r += 1


@njit(parallel=True, **_JIT)
def _fp8_mvv(w, s, br, bc, wide, x, rpg, out):
    """FP8 matvec, blocks a multiple of 32 wide (V4's 128, V4.1's 32): a task per TASK_ROWS rows
    of one scale row, its rel computed once for them."""
    for task in prange(s.shape[0] * -(-br // TASK_ROWS)):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(MV_LANES), (MV_LANES,))
        _fp8_rowtask(w, s, br, bc, task, wide, x, rpg, out, rel, acc)


@njit(**_JIT)
def _fp8_mvv_serial(w, s, br, bc, wide, x, rpg, out):
    rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
    acc = carray(_stack_f32(MV_LANES), (MV_LANES,))
    for task in range(s.shape[0] * -(-br // TASK_ROWS)):
        _fp8_rowtask(w, s, br, bc, task, wide, x, rpg, out, rel, acc)


@njit(parallel=True, **_JIT)
def _fp8_mv2v(w1, s1, w3, s3, br, bc, x, out1, out3):
    """`_fp8_mvv` of two weights of one shape times one x (1, C) (a shared expert's w1 and w3)."""
    for task in prange(s1.shape[0] * -(-br // TASK_ROWS)):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(MV_LANES), (MV_LANES,))
        _fp8_rowtask(w1, s1, br, bc, task, False, x, w1.shape[0], out1, rel, acc)
        _fp8_rowtask(w3, s3, br, bc, task, False, x, w1.shape[0], out3, rel, acc)


@njit(**_INLINE)
def _fp8_decode32(w, r, rel, c0, cw, tile, q):
    """`_fp8_decode` at bc = 32, a block per vector op."""
    nb = cw // 32
    for cb in range(nb):
        _fp8_dec32(w, r, c0 + cb * 32, rel[c0 // 32 + cb], tile, q * CHUNK + cb * 32)
    for k in range(cw - nb * 32):
        tile[q * CHUNK + nb * 32 + k] = _e4m3(w[r, c0 + nb * 32 + k]) * rel[c0 // 32 + nb]


@njit(**_INLINE)
def _fp8_decode_wide(w, r, rel, bc, c0, cw, tile, q):
    """`_fp8_decode` for blocks a multiple of 32 wide (V4's 128): 32 columns per vector op, as
    `_fp8_decode32` (the scalar loop over a block of run-time width was not vectorised)."""
    if bc == 32:
        _fp8_decode32(w, r, rel, c0, cw, tile, q)
        return
    j, end = c0, c0 + cw
    while j < end:  # a block at a time: a division per 32 columns cost more than their decode
        sr = rel[j // bc]
        stop = min(end, (j // bc + 1) * bc)
        while j < stop:
            _fp8_dec32(w, r, j, sr, tile, q * CHUNK + j - c0)
            j += 32


# ---- FP8 at a few tokens: each 32-column group decoded once, in registers, for every token --------
#
# Where column blocks are a multiple of 32 wide (V4's 128, V4.1's 32), a 32-column group lies in
# one scale block and column j feeds lane j mod 32 in `_fp8_row` and `_fp8_mvv` alike. So a
# group decoded once and multiplied into each token's own 32 lanes gives every token its
# matvec's bits, and costs one decode plus one FMA per token per weight: a matvec per token
# decodes the weight once per token, and the tile kernel's float32 tile pays off from 4 tokens
# (`FP8_FEW`).


@intrinsic
def _fp8_fma32_tokens(typingctx, w, r, j, xs, t, sr, acc):
    """acc[32 u : 32 u + 32] = fma(e4m3(w[r, j : j+32]) * sr, xs[u, j : j+32], acc[32 u :]) for u < t:
    the group decoded once, kept in registers for every token."""
    if not all(isinstance(a, types.Array) and a.layout == "C" for a in (w, xs, acc)) or sr != types.float32:
        return None
    sig = types.void(w, r, j, xs, t, sr, acc)

    def codegen(context, builder, sig, args):
        w_, r_, j_, xs_, t_, sr_, acc_ = args
        tw, tr, tj, txs, tt, _, tacc = sig.args
        d = _decoded32(context, builder, tw, w_, r_, tr, j_, tj, sr_)
        with cgutils.for_range(builder, context.cast(builder, t_, tt, types.intp)) as loop:
            u = loop.index
            x_ptr = _item_ptr(context, builder, txs, xs_, [(u, types.intp), (j_, tj)], _V32F)
            a = builder.mul(u, ir.Constant(_I64, LANES))
            _fma32_into(builder, d, x_ptr, _item_ptr(context, builder, tacc, acc_, [(a, types.intp)], _V32F))
        return context.get_dummy_value()

    return sig, codegen


@njit(**_INLINE)
def _fp8_row_tokens32(w, r, xs, t, bc, rel, fac, acc, out):
    """Row r of E4M3 (block width bc a multiple of 32, columns too) times the first t tokens of xs
    (T, C) into out[:t, r]; token u's lanes at acc[32 u :]."""
    for k in range(t * LANES):
        acc[k] = 0
    cols = w.shape[1]
    for b in range(-(-cols // bc)):
        sr = rel[b]
        for j in range(b * bc, min(cols, b * bc + bc), 32):
            _fp8_fma32_tokens(w, r, j, xs, t, sr, acc)
    for u in range(t):
        out[u, r] = _finish(_lane_sum(acc, u * LANES), fac)


@njit(**_INLINE)
def _fp8_rowblock_tokens(w, s, br, bc, g, xs, t, rel, acc, out):
    """The rows of scale row g times the first t tokens of xs into out; their rel computed once."""
    fac = _row_rel(s[g], 8, rel)
    for r in range(g * br, min(w.shape[0], g * br + br)):
        _fp8_row_tokens32(w, r, xs, t, bc, rel, fac, acc, out)


@njit(parallel=True, **_JIT)
def _fp8_mvt(w, s, br, bc, xs, out):
    """out (T, R) for 2 <= T <= FP8_FEW tokens of xs (T, C): row blocks of one scale row per task."""
    for g in prange(s.shape[0]):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(FP8_FEW_LANES), (FP8_FEW_LANES,))
        _fp8_rowblock_tokens(w, s, br, bc, g, xs, xs.shape[0], rel, acc, out)


@njit(parallel=True, **_JIT)
def _fp8_mvt2(w1, s1, w3, s3, br, bc, xs, out1, out3):
    """`_fp8_mvt` of two weights of one shape (a shared expert's w1 and w3): one parallel region."""
    for g in prange(s1.shape[0]):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(FP8_FEW_LANES), (FP8_FEW_LANES,))
        _fp8_rowblock_tokens(w1, s1, br, bc, g, xs, xs.shape[0], rel, acc, out1)
        _fp8_rowblock_tokens(w3, s3, br, bc, g, xs, xs.shape[0], rel, acc, out3)


# ---- public API ----------------------------------------------------------------------------------


_threads = [0]  # requested by set_threads (0: numba's default); applied in whichever thread calls


def set_threads(n: int) -> int:
    """Threads for the kernels, clamped to 1..cores; returns the count in effect.

    numba's own setting is per calling thread; this one holds for every thread that calls
    the kernels afterwards.
    """
    _threads[0] = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(_threads[0])
    return _threads[0]


def get_threads() -> int:
    return numba.get_num_threads()


def _apply_threads() -> None:
    if _threads[0] and numba.get_num_threads() != _threads[0]:
        numba.set_num_threads(_threads[0])


def _u8(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _scale(w) -> np.ndarray:
    s = np.ascontiguousarray(w.scale)
    if s.dtype.itemsize == 1:
        return s.view(np.uint8)
    return s if s.dtype == np.float32 else s.astype(np.float32)


def _check(w, cols: int) -> None:
    """Shape contract of a QWeight against the input width; ValueError naming what differs."""
    if cols != w.cols:
        raise ValueError(f"{w.kind} weight ({w.rows}, {w.cols}) cannot take inputs of width {cols}")
    if w.kind == "fp4":
        if w.cols % 32:
            raise ValueError(f"FP4 weight needs columns in multiples of 32, found {w.cols}")
        want_d, want_s = (w.rows, w.cols // 2), (w.rows, w.cols // 32)
    elif w.kind == "fp8":
        br, bc = w.block
        if br < 1 or bc < 1 or CHUNK % bc:
            raise ValueError(f"FP8 scale blocks ({br}, {bc}): the kernels take column blocks dividing {CHUNK}")
        want_d, want_s = (w.rows, w.cols), (-(-w.rows // br), -(-w.cols // bc))
    elif w.kind in ("bf16", "f32"):
        want_d, want_s = (w.rows, w.cols), None
    else:
        raise ValueError(f"unknown weight kind {w.kind!r}")
    got_s = None if w.scale is None else tuple(w.scale.shape)
    if tuple(w.data.shape) != want_d or got_s != want_s:
        raise ValueError(
            f"{w.kind} weight data {tuple(w.data.shape)} / scale {got_s} do not fit ({w.rows}, {w.cols}):"
            f" expected {want_d} / {want_s}"
        )
    if want_s is not None and want_s[1] > MAX_BLOCKS:
        raise ValueError(f"{w.kind} weight has {want_s[1]} scale blocks per row, the kernels hold {MAX_BLOCKS}")


def _aligned_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros starting on a 64-byte boundary. numpy's buffers start 16 bytes past one, so
    every 64-byte vector load of a kernel input would span two cache lines: 64-token FP8 matmul,
    one thread, Zen 4, 47 -> 71 GFLOP/s with this and the stack buffers aligned too."""
    n = math.prod(shape)  # np.prod's dispatch cost more than the allocation at one token
    raw = np.zeros(n + 16, np.float32)
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip : skip + n].reshape(shape)


def _aligned_copy(x: np.ndarray) -> np.ndarray:
    out = _aligned_zeros(x.shape)
    out[...] = x
    return out


# Scratch of the few-token kernels, per calling thread and thread count: one row per chunk of
# row tiles (a chunk per kernel thread). It was stack memory inside each kernel: LLVM then spent
# ~6-8 s of a 12 s compile per kernel on the 66 KB of lanes and 32 KB of tile and scales
# (one thread, Zen 4: FP8 matmul 12.0 -> 4.1 s of CPU to compile with them here; same bits).
_scratch_held = threading.local()


def _scratch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lanes, tile, relative scales) rows for each of the kernel threads, 64-byte aligned."""
    n = numba.get_num_threads()
    held = getattr(_scratch_held, "bufs", None)
    if held is None or held[0].shape[0] != n:
        held = (_aligned_zeros((n, ACC_LANES)), _aligned_zeros((n, CHUNK_LANES)), _aligned_zeros((n, REL_LANES)))
        _scratch_held.bufs = held
    return held


def _halves(x: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(T, C) -> X[:, 0::2], X[:, 1::2] as (rows, C/2) float32 (rows >= T; extra rows zero)."""
    t, c = x.shape
    xe = _aligned_zeros((rows, c // 2))
    xo = _aligned_zeros((rows, c // 2))
    xe[:t] = x[:, 0::2]
    xo[:t] = x[:, 1::2]
    return xe, xo


def _tokens(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"matmul takes X of shape (T, C), found {x.shape}")
    return x


def _plain(w) -> np.ndarray:
    d = np.ascontiguousarray(w.data)
    if w.kind == "bf16":
        return d.view(np.uint16)
    return d if d.dtype == np.float32 else d.astype(np.float32)


def _v41_fp8(w) -> bool:
    """Whether w is FP8 as V4.1 ships it (32-column scale blocks, E8M0 scales). Its tile kernel is
    as fast as the per-token matvec from 4 tokens, so it skips `FP8_PER_TOKEN`."""
    return w.kind == "fp8" and w.block[1] == 32 and w.scale.dtype.itemsize == 1


def _vec_fp8(w) -> bool:
    """Whether the vector matvec kernels (`_fp8_mvv`) take w: FP8 with scale blocks a multiple of
    32 columns wide, as V4 (128) and V4.1 (32) ship. Other widths restart the lanes inside a
    32-column group and keep the generic `_fp8_mv` (generated checkpoints only)."""
    return w.kind == "fp8" and w.block[1] % 32 == 0


def _fp8_few(w, t: int) -> bool:
    """Whether `_fp8_mvt` takes t tokens times w: FP8 whose 32-column groups each lie in one scale
    block, 2..FP8_FEW tokens, and bytes enough for a parallel region."""
    if w.kind != "fp8" or w.block[1] % 32 or w.cols % 32 or not _parallel(w):
        return False
    return 2 <= t <= FP8_FEW


def _parallel(w) -> bool:
    """Whether a matvec with w gets a parallel region: only when it has the bytes to pay for one."""
    return _threads[0] != 1 and numba.get_num_threads() > 1 and w.nbytes >= PARALLEL_MIN_BYTES


def _matvec_rows(w, x: np.ndarray, out: np.ndarray, rpg: int | None = None) -> None:
    """out (R,) = W @ x for x (C,), or group-wise for x (g, C) with rpg rows per group."""
    xg = x.reshape(-1, w.cols)
    rpg = rpg or w.rows
    par = _parallel(w)
    if w.kind == "fp4":
        xe, xo = _halves(xg, xg.shape[0])
        (_fp4_mv if par else _fp4_mv_serial)(_u8(w.data), _scale(w), xe, xo, rpg, out)
    elif _vec_fp8(w):
        br, bc = w.block
        wide = w.cols >= WIDE_COLS
        (_fp8_mvv if par else _fp8_mvv_serial)(_u8(w.data), _scale(w), br, bc, wide, _aligned_copy(xg), rpg, out)
    elif w.kind == "fp8":
        br, bc = w.block
        wide = w.cols >= WIDE_COLS and br % MV_ROWS == 0
        kernel = (_fp8_mv_wide if wide else _fp8_mv) if par else _fp8_mv_serial
        kernel(_u8(w.data), _scale(w), br, bc, _aligned_copy(xg), rpg, out)
    else:
        (_plain_mv if par else _plain_mv_serial)(_plain(w), _aligned_copy(xg), rpg, out)


def matvec(w, x: np.ndarray) -> np.ndarray:
    """W (R, C) @ x (C,) -> (R,) float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"matvec takes x of shape (C,), found {x.shape}")
    _check(w, x.shape[0])
    _apply_threads()
    out = np.empty(w.rows, np.float32)
    _matvec_rows(w, x, out)
    return out


def blas_min_tokens(w) -> int:
    """Token count from which `matmul` dequantises row tiles and calls BLAS (measured per kind)."""
    return BLAS_MIN_TOKENS[w.kind]


def matmul(w, x: np.ndarray) -> np.ndarray:
    """X (T, C) @ W.T -> (T, R) float32.

    The fused kernels run (row t equals matvec(w, X[t]) bit for bit) unless BLAS_PATH is on
    and X has at least `blas_min_tokens(w)` tokens: then row tiles
    are dequantised and multiplied by numpy's BLAS sgemm: the same value to float32 rounding
    (summation order differs), still independent of the thread count."""
    x = _tokens(x)
    _check(w, x.shape[1])
    _apply_threads()
    t = x.shape[0]
    out = np.empty((t, w.rows), np.float32)
    if t == 1:
        _matvec_rows(w, x[0], out[0])
        return out
    if t == 0:
        return out
    if _fp8_few(w, t):
        _fp8_mvt(_u8(w.data), _scale(w), *w.block, _aligned_copy(x), out)
        return out
    if w.kind == "fp8" and t <= FP8_PER_TOKEN and not _v41_fp8(w):
        for i in range(t):
            _matvec_rows(w, x[i], out[i])
        return out
    if BLAS_PATH and t >= blas_min_tokens(w):
        _blas_matmul(w, x, out)
        return out
    for t0 in range(0, t, MAX_TOKENS):
        n = min(MAX_TOKENS, t - t0)
        part = out[t0 : t0 + n]
        if w.kind == "fp4" and n <= FEW_TOKENS and _parallel(w):
            xe, xo = _halves(x[t0 : t0 + n], n)
            _fp4_mvt(_u8(w.data), _scale(w), xe, xo, part)
            continue
        if w.kind == "fp4":
            xe, xo = _halves(x[t0 : t0 + n], n - n % -TOKS)
            _fp4_mm(_u8(w.data), _scale(w), xe, xo, part, *_scratch())
            continue
        xs = _aligned_zeros((n - n % -TOKS, w.cols))
        xs[:n] = x[t0 : t0 + n]
        if w.kind == "fp8":
            _fp8_mm(_u8(w.data), _scale(w), *w.block, xs, part, *_scratch())
        else:
            _plain_mm(_plain(w), xs, part, *_scratch()[:2])
    return out


def _blas_matmul(w, x: np.ndarray, out: np.ndarray) -> None:
    """out (T, R) = X @ W.T through float32 row tiles of at most TILE_ELEMS values and BLAS."""
    if w.kind == "f32":
        np.matmul(x, _plain(w).T, out=out)
        return
    step = max(1, min(w.rows, TILE_ELEMS // w.cols))
    tile = np.empty((step, w.cols), np.float32)
    fac = np.empty(step, np.float64)
    prod = np.empty((x.shape[0], step), np.float32)
    for a in range(0, w.rows, step):
        n = min(step, w.rows - a)
        if w.kind == "fp4":
            _fp4_dequant(_u8(w.data), _scale(w), a, tile[:n], fac[:n])
        elif w.kind == "fp8":
            _fp8_dequant(_u8(w.data), _scale(w), *w.block, a, tile[:n], fac[:n])
        else:
            _plain_dequant(_plain(w), a, tile[:n], fac[:n])
        p = np.matmul(x, tile[:n].T, out=prod[:, :n])
        np.multiply(p, fac[:n], out=out[:, a : a + n], casting="unsafe")  # float64 product, rounded once


def matmul_pair(w1, w3, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(X @ W1.T, X @ W3.T) for two weights of one kind and shape; at one token (FP4: up to
    FEW_TOKENS, FP8: as `_fp8_few` says) one parallel pass."""
    x = _tokens(x)
    same = w1.kind == w3.kind and w1.rows == w3.rows and w1.cols == w3.cols and w1.kind in ("fp4", "fp8")
    same = same and (w1.kind != "fp8" or w1.block == w3.block)
    t = x.shape[0]
    few = w1.kind == "fp4" and 1 < t <= FEW_TOKENS
    few8 = same and _fp8_few(w1, t) and _v41_fp8(w1) == _v41_fp8(w3)
    if (t != 1 and not few and not few8) or not same or not _parallel(w1):
        return matmul(w1, x), matmul(w3, x)
    _check(w1, x.shape[1])
    _check(w3, x.shape[1])
    _apply_threads()
    if few or few8:
        y1 = np.empty((t, w1.rows), np.float32)
        y3 = np.empty((t, w3.rows), np.float32)
        if few:
            xe, xo = _halves(x, t)
            _fp4_mvt2(_u8(w1.data), _scale(w1), _u8(w3.data), _scale(w3), xe, xo, y1, y3)
        else:
            _fp8_mvt2(_u8(w1.data), _scale(w1), _u8(w3.data), _scale(w3), *w1.block, _aligned_copy(x), y1, y3)
        return y1, y3
    y1 = np.empty((1, w1.rows), np.float32)
    y3 = np.empty((1, w3.rows), np.float32)
    if w1.kind == "fp4":
        xe, xo = _halves(x[:1], 1)
        _fp4_mv2(_u8(w1.data), _scale(w1), _u8(w3.data), _scale(w3), xe[0], xo[0], y1[0], y3[0])
    elif _vec_fp8(w1):
        x1 = _aligned_copy(x[:1])
        _fp8_mv2v(_u8(w1.data), _scale(w1), _u8(w3.data), _scale(w3), *w1.block, x1, y1[0], y3[0])
    else:
        _fp8_mv2(_u8(w1.data), _scale(w1), _u8(w3.data), _scale(w3), *w1.block, x[0], y1[0], y3[0])
    return y1, y3


def _consecutive(parts: list[np.ndarray]) -> np.ndarray | None:
    """The parts (C-contiguous, one shape and dtype) as one array along axis 0 when they lie back
    to back in memory (row blocks of one tensor), else None. A view: nothing is copied."""
    p0 = parts[0]
    for i, p in enumerate(parts):
        ok = p.flags.c_contiguous and p.dtype == p0.dtype and p.shape == p0.shape
        if not ok or p.ctypes.data != p0.ctypes.data + i * p0.nbytes:
            return None
    shape = (len(parts) * p0.shape[0], *p0.shape[1:])
    # writable like its parts (the kernels never write it): numba types a read-only array apart,
    # and a read-only view here would compile a second kernel inside the first decode step
    writeable = all(p.flags.writeable for p in parts)
    return np.lib.stride_tricks.as_strided(p0, shape=shape, strides=p0.strides, writeable=writeable)


def _joined(ws) -> object | None:
    """Row blocks of one weight (the grouped output projection) as that one weight, or None."""
    w0 = ws[0]
    if any(w.kind != w0.kind or w.rows != w0.rows or w.cols != w0.cols or w.block != w0.block for w in ws):
        return None
    if w0.kind == "fp8" and w0.rows % w0.block[0]:
        return None
    data = _consecutive([np.ascontiguousarray(w.data) for w in ws])
    scale = None if w0.scale is None else _consecutive([np.ascontiguousarray(w.scale) for w in ws])
    if data is None or (w0.scale is not None and scale is None):
        return None
    return replace(w0, data=data, scale=scale, rows=len(ws) * w0.rows)


def matmul_grouped(ws, x: np.ndarray) -> np.ndarray:
    """X (T, g, C): group i times ws[i] (R, C) -> (T, g * R); at one token a single call."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 3 or x.shape[1] != len(ws):
        raise ValueError(f"matmul_grouped takes X of shape (T, {len(ws)}, C), found {x.shape}")
    whole = _joined(ws) if x.shape[0] == 1 else None
    if whole is None:
        return np.concatenate([matmul(w, x[:, i]) for i, w in enumerate(ws)], axis=1)
    _check(ws[0], x.shape[2])
    _apply_threads()
    out = np.empty((1, whole.rows), np.float32)
    _matvec_rows(whole, x[0], out[0], rpg=ws[0].rows)
    return out


def warmup() -> float:
    """Compile (or load from numba's cache) every product kernel at every form (`warm.FORMS`);
    returns the seconds it took. A run compiles only its checkpoint's forms (`kernels.warmup`).

    Writable arrays only: every weight a run hands the kernels is writable (its own buffer, a
    ring slot, or a view of those), and numba would type a read-only one apart."""
    from . import warm  # imports this module

    t0 = time.perf_counter()
    for unit in warm.units(f for f in warm.FORMS if f != "base"):
        warm.warm_unit(unit)
    return time.perf_counter() - t0
