"""DeepSeek-V4.1's vision tower and aligner: image patches -> one row per image token.

Owns: the ViT (patch embedding, blocks of 2-D RoPE attention and a fused gate+up SwiGLU, the
final norm) and the aligner (3 x 3 neighbourhoods concatenated, two linears with an exact GELU
between), over weights already in memory. Not here: decoding and patches (`text.image`), where
the rows go in the prompt (`engine.stack_v41`), reading the weights (`weights.loading_v41`).

Facts this follows (DeepSeek's V4.1 `inference/vision.py`):
- every linear has a bias except the MLP's; RMSNorm eps 1e-6 (not the text model's), weight
  times the normalised row.
- attention: one image, bidirectional, heads of hidden / n_heads, scale 1/sqrt(head_dim). RoPE
  on the whole head as two halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), whose
  head_dim / 2 angles are the patch row times head_dim / 4 frequencies, then its column times
  the same ones; freq_i = theta^(-2i / (head_dim / 2)).
- MLP: w1 gives gate then up (each intermediate wide); w2(silu(gate) * up).
- aligner: the (vit_h, vit_w) grid zero-padded on the right/bottom to multiples of r; each
  r x r cell in reading order becomes one row, laid out channel-major (c, dy, dx), as torch's
  unfold; rows = w2(gelu(w1(cell))).
Numerics: "fp32" computes in float32; "official" rounds to bf16 where the reference's bf16
tensors are rounded (every linear's output, the norms, the rotated q/k, the attention output,
silu and the product, each residual add), computing inside each op in float32. `fast` (the
run's `--numerics fast`) is fp32 but for the linears of BF16 weights (the release's tower has no
FP8), which go through
`kernels.matmul` and so the process's fast kernels (BF16 activations, float32 accumulation;
`kernels.numerics`) where they are the faster (at most FAST_TOKENS rows: the aligner of an image
of up to that many tokens); more rows, or a width those kernels do not take (the patch
embedding's 3 p p), stay numpy float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ...kernels import QWeight, fast_variant, matmul
from ...kernels.special import erf
from .. import ops

F32 = np.float32
NORM_EPS = 1e-6
_BF16 = np.dtype(ml_dtypes.bfloat16)
ATTN_ROWS = 512  # queries per attention block: bounds the (heads, rows, N) scores
W_ROWS = 1024  # rows of a BF16 weight widened to float32 at once
# fast: the BF16 kernels (`kernels.bf16`, built for few tokens) beat numpy's sgemm up to a few
# hundred rows when the cores are shared (1.3-2.5x at 256 rows of the aligner's 9216-wide w1,
# OpenBLAS's second thread waiting on a busy core) and lose beyond (1.5-2x slower at 1024;
# docs/performance.md): the ViT's 1500+ patches stay on sgemm, the aligner's rows of an image of
# up to FAST_TOKENS tokens take the kernels
FAST_TOKENS = 256


@dataclass(frozen=True)
class VisionBlockWeights:
    norm1: np.ndarray  # (C,)
    wqkv: np.ndarray  # (3C, C)
    bqkv: np.ndarray  # (3C,)
    wo: np.ndarray  # (C, C)
    bo: np.ndarray  # (C,)
    norm2: np.ndarray  # (C,)
    w1: np.ndarray  # (2I, C): gate rows then up rows
    w2: np.ndarray  # (C, I)


@dataclass(frozen=True)
class VisionWeights:
    """The tower, aligner and span delimiters: vectors float32 (their bf16 values), matrices
    float32 or, as `weights.loading_v41` keeps them, BF16 (widened exactly where used)."""

    patch_w: np.ndarray  # (C, 3 p p)
    patch_b: np.ndarray  # (C,)
    blocks: tuple[VisionBlockWeights, ...]
    norm: np.ndarray  # (C,)
    align_w1: np.ndarray  # (D, C r r)
    align_b1: np.ndarray
    align_w2: np.ndarray  # (D, D)
    align_b2: np.ndarray
    image_start: np.ndarray  # (D,)
    image_end: np.ndarray
    image_newline: np.ndarray


@dataclass(frozen=True)
class VisionParams:
    n_heads: int
    rope_theta: float
    downsample: int
    bf16: bool  # official numerics: round as the reference's bf16 tensors
    fast: bool = False  # fast numerics: BF16 linears of few rows on the process's fast kernels


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even), back in float32."""
    return np.asarray(x, dtype=F32).astype(_BF16).astype(F32)


def _round(x: np.ndarray, on: bool) -> np.ndarray:
    return bf16(x) if on else x


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, rnd: bool, fast: bool = False) -> np.ndarray:
    qw = None
    if fast and w.dtype == _BF16 and x.shape[0] <= FAST_TOKENS:
        qw = QWeight("bf16", np.ascontiguousarray(w).view(np.uint16), None, w.shape[0], w.shape[1])
    if qw is not None and fast_variant(qw) is not None:
        # `kernels.matmul` (not bf16.py directly): the process's numerics pick the kernel and its
        # threads; rows do not depend on the token count or the threads
        y = matmul(qw, np.ascontiguousarray(x, dtype=F32))
    elif w.dtype == F32:
        y = x @ w.T
    else:  # stored BF16: widened W_ROWS output rows at a time (exact), a bounded scratch
        y = np.empty((x.shape[0], w.shape[0]), dtype=F32)
        for a in range(0, w.shape[0], W_ROWS):
            y[:, a : a + W_ROWS] = x @ w[a : a + W_ROWS].astype(F32).T
    if b is not None:
        y += b
    return _round(y, rnd)


def _norm(x: np.ndarray, w: np.ndarray, rnd: bool) -> np.ndarray:
    r = F32(1.0) / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True, dtype=F32) + F32(NORM_EPS))
    return _round(w * (x * r), rnd)


def rope_angles(vit_h: int, vit_w: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (N, head_dim / 2) of the patches in reading order."""
    dim = head_dim // 2
    inv = F32(1.0) / (F32(theta) ** (np.arange(0, dim, 2, dtype=F32) / F32(dim)))
    hpos = np.repeat(np.arange(vit_h, dtype=F32), vit_w)
    wpos = np.tile(np.arange(vit_w, dtype=F32), vit_h)
    ang = np.concatenate([hpos[:, None] * inv[None], wpos[:, None] * inv[None]], axis=1)
    return np.cos(ang), np.sin(ang)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rnd: bool) -> np.ndarray:
    """x (N, heads, head_dim) rotated in halves."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return _round(np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1), rnd)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, rnd: bool) -> np.ndarray:
    """(N, heads, hd) each -> (N, heads * hd): softmax over every patch, in query blocks."""
    n, heads, hd = q.shape
    qh, kh, vh = (np.ascontiguousarray(t.transpose(1, 0, 2)) for t in (q, k, v))
    scale = F32(1.0 / math.sqrt(hd))
    out = np.empty((heads, n, hd), dtype=F32)
    for a in range(0, n, ATTN_ROWS):
        b = min(n, a + ATTN_ROWS)
        s = np.matmul(qh[:, a:b], kh.transpose(0, 2, 1)) * scale
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        out[:, a:b] = np.matmul(s, vh)
    return _round(out.transpose(1, 0, 2).reshape(n, heads * hd), rnd)


def _block(x: np.ndarray, w: VisionBlockWeights, cos, sin, p: VisionParams) -> np.ndarray:
    rnd, fast, n = p.bf16, p.fast, x.shape[0]
    hd = x.shape[1] // p.n_heads
    qkv = _linear(_norm(x, w.norm1, rnd), w.wqkv, w.bqkv, rnd, fast)
    q, k, v = (t.reshape(n, p.n_heads, hd) for t in np.split(qkv, 3, axis=1))
    o = _attention(_rotate(q, cos, sin, rnd), _rotate(k, cos, sin, rnd), v, rnd)
    x = _round(x + _linear(o, w.wo, w.bo, rnd, fast), rnd)
    gate, up = np.split(_linear(_norm(x, w.norm2, rnd), w.w1, None, rnd, fast), 2, axis=1)
    hmid = _round(_round(ops.silu(gate), rnd) * up, rnd)
    return _round(x + _linear(hmid, w.w2, None, rnd, fast), rnd)


def vit(
    patches: np.ndarray,
    vit_h: int,
    vit_w: int,
    w: VisionWeights,
    p: VisionParams,
    on_block: Callable[[int], None] | None = None,
) -> np.ndarray:
    """patches (vit_h * vit_w, 3 p p) -> features (vit_h * vit_w, C). on_block(i) after block i:
    a server's cancellation raises there, so a gone client stops the tower between blocks."""
    x = _linear(np.asarray(patches, dtype=F32), w.patch_w, w.patch_b, p.bf16, p.fast)
    cos, sin = rope_angles(vit_h, vit_w, x.shape[1] // p.n_heads, p.rope_theta)
    for i, b in enumerate(w.blocks):
        x = _block(x, b, cos, sin, p)
        if on_block is not None:
            on_block(i)
    return _norm(x, w.norm, p.bf16)


def _gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU in float32."""
    e = erf(x.astype(np.float64) * (1.0 / math.sqrt(2.0))).astype(F32)
    return F32(0.5) * x * (F32(1.0) + e)


def align(features: np.ndarray, vit_h: int, vit_w: int, w: VisionWeights, p: VisionParams) -> np.ndarray:
    """features (vit_h * vit_w, C) -> rows (llm_h * llm_w, D) in reading order."""
    r, c = p.downsample, features.shape[1]
    g = features.reshape(vit_h, vit_w, c)
    hh, ww = -(-vit_h // r) * r, -(-vit_w // r) * r
    pad = np.zeros((hh, ww, c), dtype=F32)
    pad[:vit_h, :vit_w] = g
    cells = pad.reshape(hh // r, r, ww // r, r, c).transpose(0, 2, 4, 1, 3)  # (lh, lw, C, dy, dx)
    x = cells.reshape((hh // r) * (ww // r), c * r * r)
    y = _round(_gelu(_linear(x, w.align_w1, w.align_b1, p.bf16, p.fast)), p.bf16)
    return _linear(y, w.align_w2, w.align_b2, p.bf16, p.fast)


def encode_image(
    patches: np.ndarray,
    vit_h: int,
    vit_w: int,
    w: VisionWeights,
    p: VisionParams,
    on_block: Callable[[int], None] | None = None,
) -> np.ndarray:
    """One image's aligner rows (llm_h * llm_w, D); on_block as `vit`'s."""
    return align(vit(patches, vit_h, vit_w, w, p, on_block), vit_h, vit_w, w, p)


def span_rows(types: np.ndarray, rows: np.ndarray, w: VisionWeights) -> np.ndarray:
    """A span's input rows (len(types), D): the delimiters' vectors and the aligner rows in order."""
    out = np.empty((types.size, w.image_start.size), dtype=F32)
    out[types == 0] = w.image_start
    out[types == 3] = w.image_end
    out[types == 2] = w.image_newline
    out[types == 1] = rows
    return out
