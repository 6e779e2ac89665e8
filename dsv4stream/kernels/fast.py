"""The fast CPU backend of `kernels`: FP4 / FP8 / BF16 / F32 weights times a vector or tokens.

Owns the dispatch (`matvec`, `matmul`, `matmul_pair`, `matmul_grouped`; `set_threads` and
`get_threads` from `jit.py`): the shape contract, which kernel takes a call (by kind, token
count and whether the weight pays for a parallel region), the aligned inputs and the per-thread
scratch. The kernels are in `fp4.py`, `fp8.py` and `plain.py`, their shared lanes and tiles in
`tiles.py`, the numba plumbing in `jit.py`. Does not own the weight formats (`formats.py`) nor
the choice of backend (`kernels/__init__.py`). No dequantised matrix is built: a row is decoded
in registers (matvec) or into a small per-tile buffer reused by every token (matmul).

Arithmetic, identical in every kernel so that results do not depend on the thread count and
`matvec(w, x) == matmul(w, x[None])[0]` bit for bit:
- decode: E2M1 and E4M3 become float16 bit patterns (exact), widened to float32; the value is
  then 2^-14 (E2M1) or 2^-8 (E4M3) times the true one. BF16 is shifted into float32 (exact).
- scales: per output row, the largest block scale's exponent E is factored out; each block
  gets `rel = scale * 2^(127 - E + shift)` in float32 (shift undoes the decode offset), and the
  row sum is multiplied by 2^(E - 127) in float64 at the end. So E8M0 byte 0 (2^-127, a float32
  subnormal) or 2^+127 never under/overflow inside the lanes. A block whose scale is below
  2^-126 of the row's largest is flushed to zero (it cannot move the result).
- a non-finite scale (E8M0 0xFF is NaN) makes its whole output row NaN; E4M3 NaN bytes are NaN.
- accumulation: 32 float32 lanes per (row, token), each an FMA chain in column order, then a
  fixed pairwise tree over the lanes. FP8 / BF16 / F32: lane = column mod 32, `lane = fma(w *
  rel, x, lane)`. FP4: packed byte k of 32-block b feeds lane (b mod 2)*16 + k with
  `lane = fma(odd * rel, x_odd, fma(even * rel, x_even, lane))` (decoded by a table lookup where
  AVX-512 has one, else through float16 bit patterns; same bits): one FMA per product, so the
  matmul multiplies a pre-scaled tile (the products by rel are exact: rel is a power of two
  and the decoded values stay above 2^-149). Parallel over output rows only.
No BLAS: sgemm sums in an order that changes with its thread count and row split, and a
prefill segment's size (which the planner picks from --budget) would then change the logits.

Matvec kernels take the input per group: x (g, C) and rows per group rpg, row r meeting
x[r // rpg] (g = 1 for a plain matvec; the grouped output projection in one call). Each comes
parallel and serial (same loop body, so the same bits): a parallel region costs more than a
small matrix takes alone, so small weights stay serial (`PARALLEL_MIN_BYTES`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import numba
import numpy as np

from .fp4 import FEW_TOKENS, _fp4_mm, _fp4_mv, _fp4_mv2, _fp4_mv_serial, _fp4_mvt, _fp4_mvt2
from .fp8 import (
    FP8_FEW,
    MV_ROWS,
    _fp8_mm,
    _fp8_mv,
    _fp8_mv2,
    _fp8_mv2v,
    _fp8_mv_serial,
    _fp8_mv_wide,
    _fp8_mvt,
    _fp8_mvt2,
    _fp8_mvv,
    _fp8_mvv_serial,
)
from .jit import _apply_threads, _threads, get_threads, set_threads
from .plain import _plain_mm, _plain_mv, _plain_mv_serial
from .tiles import CHUNK, MAX_BLOCKS, ROW_TILE, TILE_LANES, TOKS

__all__ = ["get_threads", "matmul", "matmul_grouped", "matmul_pair", "matvec", "set_threads"]

# A row of >= WIDE_COLS columns has an x of >= 32 KiB, which does not stay in L1 beside the
# weight stream: the FP8 matvec then takes MV_ROWS rows per pass over x (`fp8.MV_ROWS`); narrow
# rows lose by it, so they keep one.
WIDE_COLS = 8192
# V4's FP8 at up to this many tokens, where `_fp8_mvt` does not take it (a weight below the
# parallel floor, or blocks not a multiple of 32 wide), runs the one-token matvec once per token,
# the same bits: the tile kernel decodes each weight into a float32 tile first, a fixed cost of
# several matvecs.
FP8_PER_TOKEN = 4
MAX_TOKENS = 128  # tokens per matmul kernel call (rounded up to a multiple of TOKS); larger X is split
# Below this many weight bytes a matvec runs serially: a parallel region saves little on a small
# matrix when the cores are idle and costs milliseconds when the other core is busy (reader
# threads, other processes). Every routed or shared expert matrix and the big attention
# projections stay parallel; norms, gates, mHC and small projections do not.
PARALLEL_MIN_BYTES = 4 << 20
ACC_LANES = -(-MAX_TOKENS // TOKS) * TILE_LANES
REL_LANES = ROW_TILE * MAX_BLOCKS
CHUNK_LANES = ROW_TILE * CHUNK


# ---- the dispatch ----------------------------------------------------------------------------------


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
    every 64-byte vector load of a kernel input would span two cache lines."""
    n = math.prod(shape)  # np.prod's dispatch cost more than the allocation at one token
    raw = np.zeros(n + 16, np.float32)
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip : skip + n].reshape(shape)


def _aligned_copy(x: np.ndarray) -> np.ndarray:
    out = _aligned_zeros(x.shape)
    out[...] = x
    return out


# Scratch of the few-token kernels, per calling thread and thread count: one row per chunk of
# row tiles (a chunk per kernel thread). As stack memory inside each kernel, the 66 KB of lanes
# and 32 KB of tile and scales took LLVM most of each kernel's compile time; same bits here.
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


def matmul(w, x: np.ndarray) -> np.ndarray:
    """X (T, C) @ W.T -> (T, R) float32; row t equals matvec(w, X[t]) bit for bit."""
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
