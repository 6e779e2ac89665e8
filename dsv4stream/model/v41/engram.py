"""DeepSeek-V4.1's Engram: n-gram table rows gated into the residual streams before a layer.

Owns: the gate math, from rows already fetched and dequantised to the streams after the add.
Not here: which rows (the hash of the token ids, `dsv4stream.engram`), where they come from
(an `EngramRows` provider, `weights.providers`: in memory for tests, streamed from disk for
the real ~100 GB tables).

Facts this follows (DeepSeek's V4.1 `Engram.forward`):
- e = the token's rows, flattened (n_cols * head_dim); kv = wkv e, an FP8 linear (its input
  on the activation grid under the official numerics), split into a key per stream copy
  (hc x D) and one value (D).
- per copy c: dot = sum_d h_c * (q_weight_c * k_weight_c) * key_c, times rsqrt(mean h_c^2 + eps)
  * rsqrt(mean key_c^2 + eps) / sqrt(D) (each norm over D, per copy, not over the copies);
  gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))); h_c += gate * value.
- tokens inside an image span get gate 0 (they pass through unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...kernels import QWeight, matmul
from ..ops import sigmoid
from .quant import act_qdq

F32 = np.float32
GATE_FLOOR = 1e-6  # |dot| floor before the square root


@dataclass(frozen=True)
class EngramWeights:
    wkv: QWeight  # ((hc + 1) * D, n_cols * head_dim)
    qk: np.ndarray  # (hc, D) float32: q_weight * k_weight (only their product is ever used)


def engram(
    x: np.ndarray, rows: np.ndarray, w: EngramWeights, eps: float, quantise: bool, mask: np.ndarray | None = None
) -> np.ndarray:
    """Streams x (T, hc, D) and the tokens' rows (T, n_cols, head_dim) float32 -> new streams (T, hc, D).

    mask (T,) bool: False for tokens whose gate is shut (image spans); None: every token."""
    t, hc, d = x.shape
    e = rows.reshape(t, -1)
    kv = matmul(w.wkv, act_qdq(e) if quantise else e)  # (T, (hc + 1) * D)
    key = kv[:, : hc * d].reshape(t, hc, d)
    value = kv[:, hc * d :]
    r = (F32(1.0) / np.sqrt(np.mean(np.square(x), axis=-1, dtype=F32) + F32(eps))) * (
        F32(1.0) / np.sqrt(np.mean(np.square(key), axis=-1, dtype=F32) + F32(eps))
    )
    dot = np.sum(x * w.qk[None] * key, axis=-1, dtype=F32) * r * F32(d**-0.5)  # (T, hc)
    gate = sigmoid(np.copysign(np.sqrt(np.maximum(np.abs(dot), F32(GATE_FLOOR))), dot))
    if mask is not None:
        gate = np.where(mask[:, None], gate, F32(0.0))
    return x + gate[:, :, None] * value[:, None, :]
