"""Rotary position embedding as V4 uses it.

Owns: the two frequency tables (window-only layers: `rope_theta`, plain; compressed layers
and their compressors/indexer: `compress_rope_theta` with YaRN) and the rotation itself.
V4 rotates only the trailing `qk_rope_head_dim` channels of a vector, in interleaved pairs
(channels 2i and 2i+1 form one complex number). The YaRN table keeps attention factor 1:
cos/sin are not rescaled.

Frequencies and angles are float32, as in the reference implementations, so that angles at
large positions round the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..checkpoint.config import ModelConfig
from .ops import fused

F32 = np.float32


@dataclass(frozen=True)
class Rope:
    inv_freq: np.ndarray  # (rd/2,) float32, one frequency per interleaved pair
    # the last few position sets asked for and their tables: every layer of a forward pass asks
    # for the same ones (queries; compressed rows), so each is computed once per pass
    _last: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions (T,) int -> cos, sin each (T, rd/2) float32 (read-only: shared between calls)."""
        key = np.asarray(positions, dtype=np.int64).tobytes()
        hit = self._last.get(key)
        if hit is not None:
            return hit
        ang = positions.astype(F32)[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        cos.flags.writeable = sin.flags.writeable = False
        if len(self._last) >= 4:
            del self._last[next(iter(self._last))]
        self._last[key] = (cos, sin)
        return cos, sin


def plain_inv_freq(theta: float, rd: int) -> np.ndarray:
    exps = np.arange(0, rd, 2, dtype=F32) / F32(rd)
    return (F32(1.0) / (F32(theta) ** exps)).astype(F32)


def yarn_inv_freq(
    theta: float, rd: int, factor: float, original_max: int, beta_fast: float, beta_slow: float
) -> np.ndarray:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return rd * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rd - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = np.clip((np.arange(rd // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1).astype(F32)
    keep = F32(1.0) - ramp  # 1 where the frequency is left as is (extrapolation)
    pos_freqs = F32(theta) ** (np.arange(0, rd, 2, dtype=F32) / F32(rd))
    extrap = F32(1.0) / pos_freqs
    interp = F32(1.0) / (F32(factor) * pos_freqs)
    return (interp * (F32(1.0) - keep) + extrap * keep).astype(F32)


def rope_tables(cfg: ModelConfig) -> tuple[Rope, Rope]:
    """(window-only table, compressed-layer table) for a model."""
    rd = cfg.qk_rope_head_dim
    main = Rope(plain_inv_freq(cfg.rope_theta, rd))
    rs = cfg.rope_scaling
    if rs is None or rs.factor <= 1.0:
        comp = Rope(plain_inv_freq(cfg.compress_rope_theta, rd))
    else:
        comp = Rope(
            yarn_inv_freq(
                cfg.compress_rope_theta, rd, rs.factor, rs.original_max_position_embeddings, rs.beta_fast, rs.beta_slow
            )
        )
    return main, comp


def apply_rope(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False, in_place: bool = False
) -> np.ndarray:
    """Rotate the trailing rd channels of x (T, ..., d) by the angles cos/sin (T, rd/2).

    inverse=True rotates by the negative angle (used to de-rotate the attention output).
    Returns a rotated float32 copy; with in_place=True (the forward pass, on arrays fresh from a
    projection) a writable float32 x is rotated where it is and returned, copying only the
    rd channels being rotated.
    """
    writable = in_place and x.ndim >= 2 and x.flags.c_contiguous and x.flags.writeable and x.size
    if writable and fused(x, cos, sin) and cos.shape == sin.shape == (x.shape[0], cos.shape[-1]):
        from ..kernels import trunkops  # numba, like the fast backend

        return trunkops.rope(x, cos, sin, inverse)
    return apply_rope_numpy(x, cos, sin, inverse, in_place)


def apply_rope_numpy(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False, in_place: bool = False
) -> np.ndarray:
    """`apply_rope` in numpy: the definition `kernels.trunkops.rope` follows bit for bit."""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    c = cos.reshape(shape)
    s = sin.reshape(shape)
    out = x if in_place and x.dtype == F32 and x.flags.writeable else x.astype(F32)
    tail = out[..., out.shape[-1] - 2 * half :]
    even = tail[..., 0::2].copy()  # (T, ..., rd/2): only the rotated channels are copied
    odd = tail[..., 1::2].copy()
    if inverse:
        tail[..., 0::2] = even * c + odd * s
        tail[..., 1::2] = odd * c - even * s
    else:
        tail[..., 0::2] = even * c - odd * s
        tail[..., 1::2] = odd * c + even * s
    return out
