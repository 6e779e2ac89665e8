"""BF16 and float32 weights times one token or a tile of tokens.

Owns `_plain_mv` / `_plain_mv_serial` (matvec) and `_plain_mm` (row tiles times blocks of TOKS
tokens): the same lanes as FP8 (column j into lane j mod 32) with no scales; BF16 is shifted
into float32 (exact). Does not own the dispatch (`fast.py`).
"""

from __future__ import annotations

from numba import carray, njit, prange, types
from numba.extending import overload

from .jit import _INLINE, _JIT, _bf16, _finish, _fma, _lane_sum, _nn, _stack_f32, _stack_f64
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
