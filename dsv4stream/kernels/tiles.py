"""What every weight product shares: the lane layout, block scales relative to a row's largest,
and the loop that multiplies a decoded row tile by blocks of tokens.

Owns: the shape constants of the lanes and tiles (`LANES`, `MAX_BLOCKS`, `ROW_TILE`, `TOKS`,
`CHUNK`), `_row_rel` (a row's block scales as powers of two relative to its largest, and the
row factor applied at the end), `_tile_rels` (the head of FP4's and FP8's matmul row tiles), and the tile loop of the FP8 / BF16 / F32 matmuls
(`_chunk_times_tokens`, with `_block_start` / `_block_out` / `_chunk_start` that FP4's
matmul uses too). Does not own the decodes (`fp4.py`, `fp8.py`, `plain.py`) nor the
dispatch (`fast.py`); the arithmetic they all follow is written down in `fast.py`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .jit import _INLINE, _JIT, _f32_bits, _f32_from_bits, _finish, _fma, _lane_sum, _pow2_f64, _prefetch

LANES = 32
MAX_BLOCKS = 1024  # stack room for one row's relative scales: FP4 cols <= 32768, FP8 cols <= 131072
ROW_TILE = 4  # rows decoded together by matmul
# Tokens per register block: 4 rows x 3 tokens x 32 lanes are 24 AVX-512 accumulators, and each
# vector load of a weight feeds 3 FMAs instead of 2. A token's result does not depend on its
# place in the block.
TOKS = 3  # `_fma_block` / `_fp4_fma_block` are written out for 3
TILE_LANES = ROW_TILE * TOKS * 32
# Columns decoded at a time by matmul (a multiple of 128). A token block's lanes leave the
# registers at the end of each chunk, so a longer chunk keeps them there longer; the 16 KiB
# tile still leaves L1 room for the x slices.
CHUNK = 1024


@njit(**_INLINE)
def _prefetch_next_chunk(w, r0, nr, ci, nc, chunk_elems):
    """Prefetch the weight bytes the next chunk of this row tile decodes, or the first chunk of
    the next row tile: weights stream from RAM (expert slots), and a decode that waits on each
    line stalls the FMAs behind it. The token loop in between hides the fetch."""
    rows, row_elems = w.shape[0], w.shape[1]
    if ci + 1 < nc:
        r_start, r_end, j0 = r0, r0 + nr, (ci + 1) * chunk_elems
    else:
        r_start, r_end, j0 = r0 + ROW_TILE, min(rows, r0 + 2 * ROW_TILE), 0
    j1 = min(row_elems, j0 + chunk_elems)
    for r in range(r_start, r_end):
        for j in range(j0, j1, 64 // w.itemsize):
            _prefetch(w, r, j)


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


# ---- a tile of rows times a few tokens (decode once per column chunk, reuse for every token) -----
#
# Scratch of one row tile: rel (4 rows x MAX_BLOCKS), the decoded chunk (4 rows x CHUNK
# float32, 16 KiB: stays in L1 next to the token slices it meets) and the lanes of every
# (token, row) pair (MAX_TOKENS x 4 x 32). Scratch cannot alias the weights, so LLVM
# vectorises the decode and keeps the lanes in registers without runtime checks.


@njit(**_INLINE)
def _tile_rels(s, r0, rows, scale_rows, shift, rel, fac, tile):
    """The head of a matmul's row tile at r0 (FP4's and FP8's): each of its rows' block scales
    relative to the row's largest into rel (row q at rel[q * MAX_BLOCKS :]) and the row's
    factor into fac; weight row r takes scale row s[r // scale_rows] (FP4: 1, FP8: the block's
    height; inlined, so FP4's division by the literal 1 is gone). A short last tile is zeroed:
    its missing rows are multiplied too, and their lanes dropped. Returns the tile's rows."""
    nr = min(ROW_TILE, rows - r0)
    for q in range(nr):
        fac[q] = _row_rel(s[(r0 + q) // scale_rows], shift, rel[q * MAX_BLOCKS :])
    if nr < ROW_TILE:
        tile[:] = 0
    return nr


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
    so zeroing and summing them all per row tile went through L2."""
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
