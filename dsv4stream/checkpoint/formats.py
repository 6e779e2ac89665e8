"""Number formats of the release, decoded with ml_dtypes (no hand-written bit twiddling).

Owns: E4M3FN, E8M0, E2M1 (packed two per byte), BF16 codecs; `QWeight` (a linear weight as
stored: FP8, FP4, BF16 or F32 plus its scales; what the catalog reads and the kernels
multiply); block dequantisation of FP8 weights (128x128 scales, ceil at the edges) and FP4
weights (1x32 scales along the input dim); quantisers used by the checkpoint generator.
Scales come either as E8M0 bytes (`uint8`, value 2^(b-127); b = 0 is 2^-127, 0xFF is NaN) or
as float32; both occur.

Raw weights are held as unsigned integer views (uint8 for FP8/FP4, uint16 for BF16) so
that numba kernels and O_DIRECT slots can use them unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
FP4_BLOCK = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0


@dataclass(frozen=True)
class QWeight:
    """y = W @ x with W logically (rows, cols) float.

    data: fp8 uint8 (R, C); fp4 uint8 (R, C//2); bf16 uint16 (R, C); f32 float32 (R, C).
    scale: fp8 (ceil(R/br), ceil(C/bc)) for `block` (br, bc): (128, 128) in V4, (32, 32) in V4.1;
    fp4 (R, C//32); uint8 E8M0 bytes or float32; else None.
    """

    kind: str
    data: np.ndarray
    scale: np.ndarray | None
    rows: int
    cols: int
    role: str = "trunk"  # whose time `kernel_seconds` counts it as: "experts", "head" or "trunk"
    block: tuple[int, int] = (128, 128)  # FP8 scale block (rows, cols); unused by the other kinds

    # A subclass whose arrays live on a device (dsv4stream.gpu.DeviceQWeight) sets this and
    # multiplies itself there: matvec / matmul / dense hand it over instead of a CPU backend.
    on_device: ClassVar[bool] = False

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)


def e8m0_to_f32(b: np.ndarray) -> np.ndarray:
    """E8M0 bytes (any shape, uint8) -> float32 2^(b-127)."""
    return np.asarray(b, dtype=np.uint8).view(E8M0).astype(np.float32)


def e4m3_to_f32(b: np.ndarray) -> np.ndarray:
    """E4M3FN bytes (uint8) -> float32."""
    return np.asarray(b, dtype=np.uint8).view(E4M3).astype(np.float32)


def e2m1_to_f32(nibbles: np.ndarray) -> np.ndarray:
    """Unpacked E2M1 codes 0..15 (uint8) -> float32."""
    return (np.asarray(nibbles, dtype=np.uint8) & 0x0F).view(E2M1).astype(np.float32)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) -> float32."""
    return np.asarray(bits, dtype=np.uint16).view(BF16).astype(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns (uint16), round to nearest even."""
    return np.asarray(x, dtype=np.float32).astype(BF16).view(np.uint16)


def scale_to_f32(scale: np.ndarray) -> np.ndarray:
    """A scale tensor stored as E8M0 bytes (uint8) or float32 -> float32."""
    if scale.dtype == np.uint8:
        return e8m0_to_f32(scale)
    return np.asarray(scale, dtype=np.float32)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """(R, C/2) bytes -> (R, C) float32 values; element 2j is the low nibble of byte j."""
    p = np.asarray(packed).view(np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.float32)
    out[..., 0::2] = e2m1_to_f32(p & 0x0F)
    out[..., 1::2] = e2m1_to_f32(p >> 4)
    return out


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """(R, C) E2M1 codes 0..15 -> (R, C/2) uint8, even element in the low nibble."""
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2:
        raise ValueError("FP4 packing needs an even number of columns")
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def fp8_scale_shape(rows: int, cols: int, block: tuple[int, int] = (128, 128)) -> tuple[int, int]:
    return (math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def fp4_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    return (rows, cols // FP4_BLOCK)


def dequant_fp8(w: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """(R, C) E4M3 bytes with (ceil(R/br), ceil(C/bc)) scales -> (R, C) float32."""
    r, c = w.shape
    s = scale_to_f32(scale)
    if s.shape != fp8_scale_shape(r, c, block):
        raise ValueError(f"FP8 scale shape {s.shape} does not fit weight {w.shape} with blocks {block}")
    full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[:r, :c]
    return e4m3_to_f32(w) * full


def dequant_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(R, C/2) packed E2M1 with (R, C/32) scales -> (R, C) float32."""
    vals = unpack_fp4(packed)
    r, c = vals.shape
    s = scale_to_f32(scale)
    if s.shape != fp4_scale_shape(r, c):
        raise ValueError(f"FP4 scale shape {s.shape} does not fit weight ({r}, {c})")
    return (vals.reshape(r, c // FP4_BLOCK, FP4_BLOCK) * s[:, :, None]).reshape(r, c)


def _pow2_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Smallest power of two s with amax / s <= qmax, as float32 (all-zero blocks get 1)."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(np.where(amax > 0, amax / qmax, 1.0)))
    return np.exp2(np.clip(e, -127, 127)).astype(np.float32)


def _encode_scale(s: np.ndarray, scale_fmt: str) -> np.ndarray:
    if scale_fmt == "ue8m0":
        return s.astype(E8M0).view(np.uint8)
    return s.astype(np.float32)


def quantize_fp8(
    w: np.ndarray, scale_fmt: str = "ue8m0", block: tuple[int, int] = (128, 128)
) -> tuple[np.ndarray, np.ndarray]:
    """(R, C) float -> (E4M3 bytes (R, C), scales): E8M0 powers of two, or float32 amax/448."""
    w = np.asarray(w, dtype=np.float32)
    r, c = w.shape
    sr, sc = fp8_scale_shape(r, c, block)
    pad = np.zeros((sr * block[0], sc * block[1]), np.float32)
    pad[:r, :c] = w
    amax = np.abs(pad.reshape(sr, block[0], sc, block[1])).max(axis=(1, 3))
    if scale_fmt == "ue8m0":
        s = _pow2_scale(amax, E4M3_MAX)
    else:
        s = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[:r, :c]
    q = np.clip(w / full, -E4M3_MAX, E4M3_MAX).astype(E4M3).view(np.uint8)
    return q, _encode_scale(s, scale_fmt)


def quantize_fp4(w: np.ndarray, scale_fmt: str = "ue8m0") -> tuple[np.ndarray, np.ndarray]:
    """(R, C) float -> (packed (R, C/2) uint8, scales (R, C/32)): E8M0 or float32."""
    w = np.asarray(w, dtype=np.float32)
    r, c = w.shape
    if c % FP4_BLOCK:
        raise ValueError(f"FP4 needs columns in multiples of {FP4_BLOCK}, found {c}")
    blocks = w.reshape(r, c // FP4_BLOCK, FP4_BLOCK)
    amax = np.abs(blocks).max(axis=2)
    if scale_fmt == "ue8m0":
        s = _pow2_scale(amax, E2M1_MAX)
    else:
        s = np.where(amax > 0, amax / E2M1_MAX, 1.0).astype(np.float32)
    q = np.clip(blocks / s[:, :, None], -E2M1_MAX, E2M1_MAX).reshape(r, c).astype(E2M1).view(np.uint8)
    return pack_fp4(q), _encode_scale(s, scale_fmt)
