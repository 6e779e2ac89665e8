"""FP8 (E4M3 with block scales) weights times one token, a few tokens or a tile of tokens.

Owns the FP8 kernels. Blocks a multiple of 32 columns wide (V4's 128x128, V4.1's 32x32) take
the vector-IR kernels: `_fp8_mvv` / `_fp8_mvv_serial` (matvec), `_fp8_mv2v` (two weights, one
token), `_fp8_mvt` / `_fp8_mvt2` (2..FP8_FEW tokens, each 32-column group decoded once). Other
widths (generated checkpoints only) take the scalar loops: `_fp8_mv`, `_fp8_mv_serial`,
`_fp8_mv_wide`, `_fp8_mv2`. `_fp8_mm` (row tiles times blocks of TOKS tokens) takes both.
Column j feeds lane j mod 32 in every one of them (`fast.py` has the arithmetic), so they give
the same bits. Does not own the dispatch (`fast.py`).
"""

from __future__ import annotations

from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit import (
    _F32,
    _I8,
    _I16,
    _I32,
    _I64,
    _INLINE,
    _JIT,
    _e4m3,
    _finish,
    _fma,
    _half_to_f32,
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
    _chunk_start,
    _chunk_times_tokens,
    _prefetch_next_chunk,
    _row_rel,
    _tile_rels,
)

# FP8 rows a wide matvec takes per pass over x (divides the row block, so they share one scale).
# A row of >= `fast.WIDE_COLS` columns has an x that does not stay in L1 beside the weight
# stream: each row then reads x from L2, and 4 rows per pass read it a quarter as often.
MV_ROWS = 4
MV_LANES = MV_ROWS * LANES
# FP8 products of 2..FP8_FEW tokens (blocks a multiple of 32 wide) decode each 32-column group once
# for all tokens (`_fp8_mvt`), the same bits. From 4 tokens the tile kernel's decode is shared by
# enough tokens to be faster.
FP8_FEW = 3
FP8_FEW_LANES = FP8_FEW * LANES


# ---- any block width: scalar loops ---------------------------------------------------------------


@njit(**_INLINE)
def _fp8_row(w, s, br, bc, r, x, rel, acc):
    """Row r of E4M3 (R, C) with (br, bc) block scales, dot x (C,)."""
    # _nn on every index: with the block width bc a run-time value, LLVM cannot prove j0 + k >= 0,
    # keeps numba's negative-index wraparound per element and leaves the 32 lanes scalar (the
    # same bits with it, several times faster)
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
def _fp8_mv2(w1, s1, w3, s3, br, bc, x, out1, out3):
    for r in prange(w1.shape[0]):
        rel = carray(_stack_f32(MAX_BLOCKS), (MAX_BLOCKS,))
        acc = carray(_stack_f32(LANES), (LANES,))
        out1[r] = _fp8_row(w1, s1, br, bc, r, x, rel, acc)
        out3[r] = _fp8_row(w3, s3, br, bc, r, x, rel, acc)


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
            nr = _tile_rels(s, r0, rows, br, 8, rel, fac, tile)
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


# ---- FP8 in vector IR: 32 columns per vector op (V4's 128-column blocks, V4.1's 32) ---------------
#
# Where scale blocks are a multiple of 32 columns wide, a 32-column group lies in one block and
# is one lane group: 32 bytes decoded at once in vector IR, times the block's rel, one
# <32 x float> FMA into the lanes. The same operations as `_fp8_row` / `_fp8_decode` (lane =
# column mod 32, `fma(e4m3(w) * rel, x, lane)`), so the same bits; numba's scalar loop over a
# block of unknown width was not vectorised. The rows of a block row share one scale row: its rel is computed once for
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
    return _half_to_f32(builder, bits, 32)


def _splat32(builder, v):
    one = builder.insert_element(ir.Constant(_V32F, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, 32), [0] * 32))


# A 32-byte group without subnormal or NaN bytes (nearly every group of real weights: 0.3 % of
# the groups of Gaussian weights quantised per 128x128 block have a subnormal) is decoded
# straight into float32 bits: sign-extended byte << 20, masked, is the E4M3 value times 2^-120,
# a normal float32; rel * 2^112 is exact (rel < 2^9), so its product with that is the same real
# number as `_e4m3_v32`'s value times rel, rounded once: the same bits. Other groups
# take `_e4m3_v32`: a subnormal float32 operand costs Zen 4 a slow multiply, and NaN bytes
# need the select.
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
