"""FP4 (E2M1, 32-column blocks) weights times one token, a few tokens or a tile of tokens.

Owns the FP4 kernels: `_fp4_mv` / `_fp4_mv_serial` (matvec), `_fp4_mv2` (two weights, one
token), `_fp4_mvt` / `_fp4_mvt2` (2..FEW_TOKENS tokens, each byte decoded once) and `_fp4_mm`
(row tiles times blocks of TOKS tokens), with the vector-IR block op they share. The packed
byte k of 32-block b feeds lane (b mod 2) * 16 + k (`fast.py` has the arithmetic). Does not
own the dispatch (`fast.py`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic

from .jit import (
    _F32,
    _I8,
    _I32,
    _I64,
    _INLINE,
    _JIT,
    _decode_via_half,
    _e2m1_hi,
    _e2m1_lo,
    _finish,
    _fma,
    _host_has,
    _item_ptr,
    _lane_sum,
    _nn,
    _stack_f32,
    _stack_f64,
)
from .tiles import (
    CHUNK,
    LANES,
    MAX_BLOCKS,
    ROW_TILE,
    TILE_LANES,
    TOKS,
    _block_out,
    _block_start,
    _chunk_start,
    _prefetch_next_chunk,
    _row_rel,
    _tile_rels,
)

FP4_LANES = 32  # lane h*16 + k: even * scale * x_even, then odd * scale * x_odd; 32-blocks of parity h
FEW_TOKENS = 3  # FP4 products of 2..FEW_TOKENS tokens decode each byte once for all (`_fp4_mvt`)
FEW_LANES = FEW_TOKENS * FP4_LANES


# ---- FP4 blocks in vector IR ----------------------------------------------------------------------
#
# One 16-byte block of a row: acc[a : a+16] = fma(hi * rel, xo[i], fma(lo * rel, xe[i], acc)),
# lo / hi the byte's nibbles decoded as `_e2m1_lo` / `_e2m1_hi` do (E2M1 times 2^-14 through
# float16). Written in vector IR, not as a numba loop, so the decode is the one chosen here. Two decodes:
# - table (AVX-512): the 16 possible values are one float32 register; `vpermps` looks 16
#   nibbles up at once, after one multiply of the table by rel. ~7 instructions per 16 bytes
#   instead of ~15 (widenings, shifts and masks, float16 conversions, two multiplies). One row
#   at a time: interleaving two rows (four lane chains instead of two) measured slower.
# - half (any CPU): shifts into float16 bit patterns, widened, times rel; in vector IR too,
#   which measured faster than the numba loop on AVX2.
# table[c] * rel and decode(c) * rel are the same float32 multiply, so both give the same bits.


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
# plus two FMAs per extra token, instead of `_fp4_mm`'s tile of 3 tokens (which computes 2
# tokens as 3 and decodes into memory first); the same bits.
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


# ---- FP4 matmul: a tile of rows times blocks of tokens (see `tiles.py`) --------------------------


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
            nr = _tile_rels(s, r0, rows, 1, 14, rel, fac, tile)
            nc = (cols + CHUNK - 1) // CHUNK
            for ci in range(nc):
                c0 = ci * CHUNK
                cw = min(CHUNK, cols - c0)
                for q in range(nr):
                    _fp4_decode(w, r0 + q, rel[q * MAX_BLOCKS :], c0, cw, tile, q)
                _prefetch_next_chunk(w, r0, nr, ci, nc, CHUNK // 2)
                _fp4_chunk_times_tokens(tile, xe, xo, c0, cw, acc, ci == nc - 1, fac, out, r0, nr)
