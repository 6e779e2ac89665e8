"""DeepSeek-V4.1's shared compressed KV: the compressor of a KV-source layer and what it keeps.

Owns: the two V4.1 compressors, the per-sequence state of a KV source (its open group, its
compressed rows, its index keys) and the finishing of a latent into a compressed row and an
index key. Only the layers listed in `kv_source_layer_ids` compress; every other compressed
layer reads the rows of the latest source before it (`model.v41.attention`).

Facts this follows (DeepSeek's V4.1 inference code):
- ratio 2: per token kv = wkv x and score = wgate x (float32 weights); each group of 2 tokens
  becomes one latent, sum over the group's tokens of softmax_tokens(score) * kv, per channel,
  then RMS-normed with `norm`. No position embedding, no overlap between groups.
- ratio 1: latent = norm(wkv x) per token, no gate.
- Group j covers positions j*ratio .. j*ratio + ratio - 1 and is emitted when its last token
  arrives, so a query at position t sees rows j < (t + 1) // ratio.
- From a latent (before any rotation): the index key = k_norm(wk latent), its last rd channels
  rotated at position j*ratio, then (official numerics) FP4-QDQ per 32 with E8M0 scales; the
  compressed row = the latent with its last rd channels rotated at j*ratio, then FP4-QDQ per 16
  with E4M3 scales. Both tables use the compressed layers' rope (compress_rope_theta + YaRN).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...kernels import QWeight, matmul
from ..cache import RowBuffer
from ..ops import rms_norm, softmax
from ..rope import Rope, apply_rope
from .quant import fp4_qdq_e4m3, fp4_qdq_e8m0

F32 = np.float32


@dataclass(frozen=True)
class V41CompressorWeights:
    wkv: QWeight  # (hd, D)
    wgate: QWeight | None  # (hd, D) at ratio 2; None at ratio 1
    norm: np.ndarray  # (hd,)
    ratio: int


@dataclass(frozen=True)
class IndexKeyWeights:
    """The index keys a KV source derives from its latents (`attn.indexer.wk`, `.k_norm`)."""

    wk: QWeight  # (index_head_dim, hd)
    k_norm: np.ndarray  # (index_head_dim,)


@dataclass
class SourceState:
    """A KV source's state between forward passes: no full-length history of tokens, only
    the open group's per-token kv and score, and the rows and keys emitted so far. Its
    `ratio` and `keyed` are what a state file's counters are checked against: after `pos`
    tokens it holds pos // ratio rows, as many keys when keyed (else none), and the
    pos % ratio tokens of the open group."""

    hd: int
    index_dim: int
    ratio: int  # tokens per compressed row (1 or 2)
    keyed: bool  # a KV source that is an index source: it derives an index key per row
    pend_kv: np.ndarray | None = None  # (n < ratio, hd) float32: tokens of the open group
    pend_score: np.ndarray | None = None
    rows: RowBuffer = field(init=False)  # compressed rows (n, hd), rotated and (official) QDQ'd
    keys: RowBuffer = field(init=False)  # index keys (n, index_dim), rotated and (official) QDQ'd

    def __post_init__(self) -> None:
        self.rows = RowBuffer(self.hd)
        self.keys = RowBuffer(self.index_dim)

    @property
    def n(self) -> int:
        return self.rows.n

    def check_restored(self, fresh: SourceState, pos: int) -> str | None:
        """What is wrong with this state, read from a state file, after `pos` tokens (None: fine)."""
        facts = (self.hd, self.index_dim, self.ratio, self.keyed)
        want = (fresh.hd, fresh.index_dim, fresh.ratio, fresh.keyed)
        if facts != want:
            return f"a KV source of widths, ratio and keys {facts}, expected {want}"
        if self.rows._a.shape[1] != self.hd or self.keys._a.shape[1] != self.index_dim:
            return "rows or keys of another width"
        n = pos // self.ratio
        if self.rows.n != n or self.keys.n != (n if self.keyed else 0):
            return f"{self.rows.n} rows and {self.keys.n} index keys after {pos} tokens, expected {n} and {n if self.keyed else 0}"
        if (self.pend_kv is None) != (self.pend_score is None):
            return "only half of the open group"
        # latents() leaves the open group as arrays (maybe of no rows) at ratio 2, None at ratio 1
        held = 0 if self.pend_kv is None else self.pend_kv.shape[0]
        if self.pend_kv is not None and (
            self.ratio == 1 or self.pend_kv.shape != self.pend_score.shape or self.pend_kv.shape[1] != self.hd
        ):
            return f"an open group of shape {self.pend_kv.shape}, expected ({pos % self.ratio}, {self.hd})"
        if held != pos % self.ratio:
            return f"an open group of {held} tokens after {pos} tokens, expected {pos % self.ratio}"
        return None


def latents(st: SourceState, x: np.ndarray, w: V41CompressorWeights, eps: float) -> np.ndarray:
    """Block inputs x (T, D) of the next T positions -> the latents of the groups they close (m, hd).

    The tokens of a group left open wait in st (ratio 2); the latents are not yet rotated."""
    if w.ratio == 1:
        return rms_norm(matmul(w.wkv, x), w.norm, eps)
    kv, score = matmul(w.wkv, x), matmul(w.wgate, x)
    if st.pend_kv is not None:
        kv = np.concatenate([st.pend_kv, kv])
        score = np.concatenate([st.pend_score, score])
    r = w.ratio
    n = kv.shape[0] // r
    st.pend_kv, st.pend_score = kv[n * r :].copy(), score[n * r :].copy()
    if n == 0:
        return np.zeros((0, st.hd), dtype=F32)
    kv = kv[: n * r].reshape(n, r, -1)
    weights = softmax(score[: n * r].reshape(n, r, -1), axis=1)
    return rms_norm(np.sum(weights * kv, axis=1, dtype=F32), w.norm, eps)


def append_rows(
    st: SourceState,
    latent: np.ndarray,
    ratio: int,
    rope: Rope,
    keys: IndexKeyWeights | None,
    eps: float,
    quantise: bool,
) -> None:
    """Turn latents (m, hd) of the next m groups into index keys (when this source has key
    weights) and compressed rows, appended to st. Keys first: they are derived from the latent
    before its rotation and quantisation."""
    m = latent.shape[0]
    if m == 0:
        return
    positions = (np.arange(st.n, st.n + m) * ratio).astype(np.int64)
    cos, sin = rope.cos_sin(positions)
    if keys is not None:
        k = apply_rope(rms_norm(matmul(keys.wk, latent), keys.k_norm, eps), cos, sin, in_place=True)
        st.keys.extend(fp4_qdq_e8m0(k, 32) if quantise else k)
    row = apply_rope(latent.copy(), cos, sin, in_place=True)
    st.rows.extend(fp4_qdq_e4m3(row, 16) if quantise else row)
