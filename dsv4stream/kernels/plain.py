"""BF16 and float32 weights times one token or a tile of tokens.

Owns `_plain_mv` / `_plain_mv_serial` (matvec) and `_plain_mm` (row tiles times blocks of TOKS
tokens): the same lanes as FP8 (column j into lane j mod 32) with no scales; BF16 is shifted
into float32 (exact). Does not own the dispatch (`fast.py`).

The matvecs take MV_ROWS rows per pass over x in vector IR (`_plain_dot32_rows`): each row
keeps its own 32 lanes, each an FMA chain in column order, so a row's bits are `_plain_row`'s.
The mHC's float32 24 x 16384 (1.5 MiB, twice a layer) read at 3.7-4.8 GB per CPU second row by
row (x of 64 KiB does not stay in L1 beside the weight stream, and numba's scalar loop was
not vectorised); see `bench/plain_rows.py`.
"""

from __future__ import annotations

from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .jit import (
    _F32,
    _I16,
    _I32,
    _I64,
    _INLINE,
    _JIT,
    _bf16,
    _finish,
    _fma,
    _item_ptr,
    _lane_sum,
    _nn,
    _stack_f32,
    _stack_f64,
)
from .tiles import CHUNK, LANES, ROW_TILE, _chunk_start, _chunk_times_tokens, _prefetch_next_chunk


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


MV_ROWS = 4  # rows per pass over x in the matvecs
MV_LANES = MV_ROWS * LANES
_V32F = ir.VectorType(_F32, 32)


def _plain_dot32_intrinsic(rows: int):
    """acc[32 q : 32 q + 32] = fma(w[r + q, j], x[j], lane j mod 32) over the whole 32-column
    groups of rows r .. r + rows, in column order, the lanes in registers; x loaded once for the
    rows. The lane arithmetic of `_plain_row` (float32 as is, BF16 bits shifted into float32)."""

    def typer(typingctx, w, r, x, acc):
        if not all(isinstance(t, types.Array) and t.layout == "C" for t in (w, x, acc)):
            return None
        if w.dtype not in (types.float32, types.uint16) or x.dtype != types.float32 or acc.dtype != types.float32:
            return None
        bf = w.dtype == types.uint16
        sig = types.void(w, r, x, acc)

        def codegen(context, builder, sig, args):
            w_, r_, x_, acc_ = args
            tw, tr, tx, tacc = sig.args
            fma = builder.module.declare_intrinsic("llvm.fma.v32f32", (), ir.FunctionType(_V32F, [_V32F] * 3))
            r0 = context.cast(builder, r_, tr, types.intp)
            cols = builder.extract_value(context.make_array(tw)(context, builder, w_).shape, 1)
            at = [
                _item_ptr(context, builder, tacc, acc_, [(ir.Constant(_I64, LANES * q), types.intp)], _V32F)
                for q in range(rows)
            ]
            lanes = [cgutils.alloca_once(builder, _V32F) for _ in range(rows)]  # promoted to registers
            for q in range(rows):
                builder.store(builder.load(at[q], align=4), lanes[q])
            welem = ir.VectorType(_I16, 32) if bf else _V32F
            with cgutils.for_range(builder, builder.udiv(cols, ir.Constant(_I64, LANES))) as loop:
                j = builder.mul(loop.index, ir.Constant(_I64, LANES))
                xv = builder.load(_item_ptr(context, builder, tx, x_, [(j, types.intp)], _V32F), align=4)
                for q in range(rows):
                    rq = builder.add(r0, ir.Constant(_I64, q))
                    ptr = _item_ptr(context, builder, tw, w_, [(rq, types.intp), (j, types.intp)], welem)
                    wv = builder.load(ptr, align=2 if bf else 4)
                    if bf:
                        wide = builder.zext(wv, ir.VectorType(_I32, 32))
                        wv = builder.bitcast(builder.shl(wide, ir.Constant(ir.VectorType(_I32, 32), [16] * 32)), _V32F)
                    builder.store(builder.call(fma, [wv, xv, builder.load(lanes[q])]), lanes[q])
            for q in range(rows):
                builder.store(builder.load(lanes[q]), at[q], align=4)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = typer.__qualname__ = f"_plain_dot32_r{rows}"
    return intrinsic(typer)


_plain_dot32_rows = _plain_dot32_intrinsic(MV_ROWS)


@njit(**_INLINE)
def _plain_rows(w, r, x, acc, out):
    """Rows r .. r + MV_ROWS dot x into out, each row's lanes and order as `_plain_row`'s."""
    for k in range(MV_LANES):
        acc[k] = 0
    _plain_dot32_rows(w, r, x, acc)
    cols = w.shape[1]
    nb = cols // LANES
    for q in range(MV_ROWS):
        for k in range(cols - nb * LANES):
            acc[q * LANES + k] = _fma(_widen(w[r + q, nb * LANES + k]), x[nb * LANES + k], acc[q * LANES + k])
        out[r + q] = _finish(_lane_sum(acc, q * LANES), 1.0)


@njit(**_INLINE)
def _plain_pass(w, g, x, rpg, acc, out):
    """Rows MV_ROWS g .. of w (x group r // rpg per row) into out: one pass where the rows share
    an x group, else row by row; the same bits either way."""
    r = g * MV_ROWS
    end = min(w.shape[0], r + MV_ROWS)
    if end - r == MV_ROWS and r // rpg == (end - 1) // rpg:
        _plain_rows(w, r, x[r // rpg], acc, out)
        return
    for i in range(r, end):
        out[i] = _plain_row(w, i, x[i // rpg], acc)


@njit(parallel=True, **_JIT)
def _plain_mv(w, x, rpg, out):
    for g in prange((w.shape[0] + MV_ROWS - 1) // MV_ROWS):
        acc = carray(_stack_f32(MV_LANES), (MV_LANES,))
        _plain_pass(w, g, x, rpg, acc, out)


@njit(**_JIT)
def _plain_mv_serial(w, x, rpg, out):
    acc = carray(_stack_f32(MV_LANES), (MV_LANES,))
    for g in range((w.shape[0] + MV_ROWS - 1) // MV_ROWS):
        _plain_pass(w, g, x, rpg, acc, out)


@njit(**_INLINE)
def _plain_decode(w, r, c0, cw, tile, q):
    for j in range(cw):
        tile[q * CHUNK + j] = _widen(w[r, _nn(c0 + j)])


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
