"""Readable numpy definition of the quantized linears: dequantise, then float32 GEMM.

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
