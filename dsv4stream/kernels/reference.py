"""Readable numpy definition of the quantized linears: dequantise, then float32 GEMM."""

from __future__ import annotations

import numpy as np

from .. import formats


def dequant(w) -> np.ndarray:
    """QWeight -> (R, C) float32."""
    if w.kind == "fp8":
        return formats.dequant_fp8(w.data, w.scale)
    if w.kind == "fp4":
        return formats.dequant_fp4(w.data, w.scale)
    if w.kind == "bf16":
        return formats.bf16_to_f32(w.data)
    if w.kind == "f32":
        return np.asarray(w.data, dtype=np.float32)
    raise ValueError(f"unknown weight kind {w.kind!r}")


def matvec(w, x: np.ndarray) -> np.ndarray:
    return dequant(w) @ np.asarray(x, dtype=np.float32)


def matmul(w, x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32) @ dequant(w).T
