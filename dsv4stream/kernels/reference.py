"""Readable numpy definitions: the quantized linears (dequantise, then float32 GEMM) and
attention's two products (softmax attention with a sink, the indexer's scores).

Large weights are dequantised a block of rows at a time (at most ``BLOCK_ELEMS`` float32
values, a multiple of 128 rows and of the FP8 scale block), so the scratch a product needs is
bounded whatever the weight's size: a whole V4-Flash head would otherwise need a 2 GB
float32 copy, and `--budget` has to cover every byte the process holds. The blocking
depends only on the weight's shape, so results do not depend on anything else.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from ..checkpoint import formats

BLOCK_ELEMS = 1 << 22  # float32 values dequantised at once (16 MB)
GATHER_FLOATS = 4 << 20  # compressed rows gathered / indexer scores per block of queries (16 MB)


def dequant(w) -> np.ndarray:
    """QWeight -> (R, C) float32."""
    if w.kind == "fp8":
        return formats.dequant_fp8(w.data, w.scale, w.block)
    if w.kind == "fp4":
        return formats.dequant_fp4(w.data, w.scale)
    if w.kind == "bf16":
        return formats.bf16_to_f32(w.data)
    if w.kind == "f32":
        return np.asarray(w.data, dtype=np.float32)
    raise ValueError(f"unknown weight kind {w.kind!r}")


def scratch_bytes(rows: int, cols: int) -> int:
    """Upper bound of the float32 scratch a product with a (rows, cols) weight allocates
    (dequantised block, its scales broadcast, the product)."""
    elems = rows * cols if rows * cols <= BLOCK_ELEMS else min(rows, max(128, BLOCK_ELEMS // cols // 128 * 128)) * cols
    return 3 * 4 * elems


def _row_blocks(w) -> Iterator[tuple[int, int, object]]:
    """(first row, end row, QWeight of those rows) covering w."""
    if w.rows * w.cols <= BLOCK_ELEMS:
        yield 0, w.rows, w
        return
    unit = math.lcm(128, w.block[0]) if w.kind == "fp8" else 128
    step = max(unit, BLOCK_ELEMS // w.cols // unit * unit)
    for a in range(0, w.rows, step):
        b = min(w.rows, a + step)
        if w.kind == "fp8":
            br = w.block[0]
            scale = w.scale[a // br : -(-b // br)]
        elif w.kind == "fp4":
            scale = w.scale[a:b]
        else:
            scale = w.scale
        yield a, b, replace(w, data=w.data[a:b], scale=scale, rows=b - a)


def matvec(w, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if w.rows * w.cols <= BLOCK_ELEMS:
        return dequant(w) @ x
    out = np.empty(w.rows, dtype=np.float32)
    for a, b, part in _row_blocks(w):
        out[a:b] = dequant(part) @ x
    return out


def matmul(w, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if w.rows * w.cols <= BLOCK_ELEMS:
        return x @ dequant(w).T
    out = np.empty((x.shape[0], w.rows), dtype=np.float32)
    for a, b, part in _row_blocks(w):
        out[:, a:b] = x @ dequant(part).T
    return out


def attend(q, keys, key_mask, comp, comp_mask, comp_idx, sink) -> np.ndarray:
    """Softmax attention with a sink (see `kernels.attend`); numpy's BLAS sums in its own order."""
    t, h, hd = q.shape
    if comp is not None and comp_idx is not None and t > 1 and t * comp_idx.shape[1] * hd > GATHER_FLOATS:
        # queries are independent: gather each block's rows alone, so the (T, K, hd) copy
        # stays near GATHER_FLOATS (64 queries x 512 rows x 512 would be 64 MiB)
        step = max(1, GATHER_FLOATS // max(1, comp_idx.shape[1] * hd))
        return np.concatenate(
            [
                attend(q[a : a + step], keys, key_mask[a : a + step], comp, None, comp_idx[a : a + step], sink)
                for a in range(0, t, step)
            ]
        )
    scale = np.float32(hd**-0.5)
    qf = q.reshape(t * h, hd)
    parts = [np.where(key_mask[:, None, :], (qf @ keys.T).reshape(t, h, -1) * scale, -np.inf)]
    gathered = None
    if comp is not None and comp_mask is not None:
        parts.append(np.where(comp_mask[:, None, :], (qf @ comp.T).reshape(t, h, -1) * scale, -np.inf))
    elif comp is not None and comp_idx is not None and comp_idx.shape[1]:
        gathered = comp[np.maximum(comp_idx, 0)]  # (T, K, hd)
        sc = np.matmul(q, gathered.transpose(0, 2, 1)) * scale
        parts.append(np.where(comp_idx[:, None, :] >= 0, sc, -np.inf))
    parts.append(np.broadcast_to(sink[None, :, None], (t, h, 1)))
    logits = np.concatenate(parts, axis=-1).astype(np.float32, copy=False)
    m = np.max(logits, axis=-1, keepdims=True)
    e = np.exp(logits - m)
    p = e / np.sum(e, axis=-1, keepdims=True)
    s = keys.shape[0]
    out = (p[:, :, :s].reshape(t * h, s) @ keys).reshape(t, h, hd)
    if comp is not None and comp_mask is not None:
        n = comp.shape[0]
        out += (p[:, :, s : s + n].reshape(t * h, n) @ comp).reshape(t, h, hd)
    elif gathered is not None:
        k = gathered.shape[1]
        out += np.matmul(p[:, :, s : s + k], gathered)
    return out


def index_scores(q: np.ndarray, w: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The indexer's scores (see `kernels.index_scores`), queries in blocks so the (block, h, n)
    intermediate stays near GATHER_FLOATS even when a long context has hundreds of thousands
    of rows."""
    t, h, c = q.shape
    n = keys.shape[0]
    out = np.empty((t, n), dtype=np.float32)
    step = max(1, GATHER_FLOATS // max(1, h * n))
    for a in range(0, t, step):
        b = min(t, a + step)
        s = (q[a:b].reshape((b - a) * h, c) @ keys.T).reshape(b - a, h, n)
        np.maximum(s, 0, out=s)
        s *= np.float32(c**-0.5)
        out[a:b] = np.einsum("thn,th->tn", s, w[a:b], dtype=np.float32)
    return out
