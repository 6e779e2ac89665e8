"""The KV compressor: every `ratio` source tokens become one compressed row.

Owns: the compressor's math and its per-sequence state. Used by compressed attention
layers (ratio 4 with overlap, any other ratio without) and, at ratio 4, a second time by
the lightning indexer at index_head_dim.

Per token the compressor projects the block input to kv and gate (width d, or 2d with
overlap). A closed window's row is sum over slots of softmax_slots(gate + ape) * kv, taken
per channel, then RMS-normed and roped (compressed-layer table) at the position of the
window's first token. With overlap, channels [:d] of a token (Ca) belong to the *next*
window and channels [d:] (Cb) to its own: row w mixes 2*ratio slots, window w-1's Ca and
window w's Cb; for the very first window the Ca slots are empty (-inf gate).

State between calls (no full-length history): the tokens of the still-open window
(raw kv and gate), the last closed window's Ca kv and gate (+ape) for the overlap, and the
rows emitted so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ...kernels import QWeight, matmul
from ..cache import RowBuffer
from ..ops import rms_norm, softmax
from ..rope import Rope, apply_rope

F32 = np.float32


@dataclass(frozen=True)
class CompressorWeights:
    wkv: QWeight  # (d or 2d, D)
    wgate: QWeight  # (d or 2d, D)
    ape: np.ndarray  # (ratio, d or 2d) float32, added to the gate per slot
    norm: np.ndarray  # (d,) float32

    @property
    def ratio(self) -> int:
        return self.ape.shape[0]


@dataclass
class CompressorState:
    """One compressor's state. After `pos` tokens it holds pos // ratio rows, the pos % ratio
    tokens of the open window, and with overlap the last closed window's Ca (once one closed):
    what a state file's counters are checked against."""

    d: int  # width of an emitted row
    overlap: bool
    ratio: int  # tokens per row
    pend_kv: np.ndarray | None = None  # (n < ratio, width) tokens of the open window
    pend_gate: np.ndarray | None = None
    prev_kv: np.ndarray | None = None  # (ratio, d) Ca of the last closed window
    prev_gate: np.ndarray | None = None  # (ratio, d), ape already added
    out: RowBuffer = field(init=False)

    def __post_init__(self) -> None:
        self.out = RowBuffer(self.d)

    @property
    def rows(self) -> np.ndarray:
        return self.out.rows

    def check_restored(self, fresh: CompressorState, pos: int) -> str | None:
        """What is wrong with this state, read from a state file, after `pos` tokens (None: fine)."""
        facts, want = (self.d, self.overlap, self.ratio), (fresh.d, fresh.overlap, fresh.ratio)
        if facts != want or self.out._a.shape[1] != self.d:
            return f"a compressor of width, overlap and ratio {facts}, expected {want}"
        width = 2 * self.d if self.overlap else self.d
        if not _pair(self.pend_kv, self.pend_gate, width) or not _pair(self.prev_kv, self.prev_gate, self.d):
            return "open or last window rows of another width, or only half of a pair"
        n, left = divmod(pos, self.ratio)
        if self.out.n != n:
            return f"{self.out.n} rows after {pos} tokens, expected {n}"
        held = 0 if self.pend_kv is None else self.pend_kv.shape[0]
        if held != left:
            return f"an open window of {held} tokens after {pos} tokens, expected {left}"
        kept = 0 if self.prev_kv is None else self.prev_kv.shape[0]
        if kept != (self.ratio if self.overlap and n else 0):
            return f"a last window of {kept} tokens kept after {n} rows (overlap {self.overlap})"
        return None


def _pair(kv: np.ndarray | None, gate: np.ndarray | None, width: int) -> bool:
    """Both None, or two arrays of one shape (n, width)."""
    if kv is None or gate is None:
        return kv is None and gate is None
    return kv.shape == gate.shape and kv.shape[1] == width


def pool_windows(
    kv: np.ndarray, gate: np.ndarray, prev_kv: np.ndarray | None, prev_gate: np.ndarray | None, overlap: bool
) -> np.ndarray:
    """Closed windows kv, gate (n, ratio, width) (gate with ape) -> pooled rows (n, d), pre-norm."""
    if not overlap:
        return np.sum(softmax(gate, axis=1) * kv, axis=1)
    n, r, w2 = kv.shape
    d = w2 // 2
    skv = np.zeros((n, 2 * r, d), dtype=F32)
    sgate = np.full((n, 2 * r, d), -np.inf, dtype=F32)
    skv[:, r:] = kv[..., d:]
    sgate[:, r:] = gate[..., d:]
    skv[1:, :r] = kv[:-1, :, :d]
    sgate[1:, :r] = gate[:-1, :, :d]
    if prev_kv is not None:
        skv[0, :r] = prev_kv
        sgate[0, :r] = prev_gate
    return np.sum(softmax(sgate, axis=1) * skv, axis=1)


def compress(
    st: CompressorState,
    x: np.ndarray,
    w: CompressorWeights,
    rope: Rope,
    eps: float,
    grid: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Feed block inputs x (T, D) of the next T positions; returns the rows emitted (m, d).

    grid, if given, rounds the rows after their norm and RoPE, before they are kept (V4's
    `official` numerics: `kernels.actquant.kv_grid_v4` / `index_grid_v4`).

    The rows are also appended to st.rows. Row j of the sequence covers positions
    j*ratio .. j*ratio + ratio - 1, so a query at position t may use rows j < (t+1)//ratio.
    """
    kv, gate = matmul(w.wkv, x), matmul(w.wgate, x)
    if st.pend_kv is not None:
        kv = np.concatenate([st.pend_kv, kv])
        gate = np.concatenate([st.pend_gate, gate])
    r = w.ratio
    n = kv.shape[0] // r
    st.pend_kv, st.pend_gate = kv[n * r :].copy(), gate[n * r :].copy()
    if n == 0:
        return np.zeros((0, st.d), dtype=F32)
    kvw = kv[: n * r].reshape(n, r, -1)
    gw = gate[: n * r].reshape(n, r, -1) + w.ape
    pooled = pool_windows(kvw, gw, st.prev_kv, st.prev_gate, st.overlap)
    if st.overlap:
        st.prev_kv, st.prev_gate = kvw[-1, :, : st.d].copy(), gw[-1, :, : st.d].copy()
    first = st.out.n
    positions = (np.arange(first, first + n) * r).astype(np.int64)
    cos, sin = rope.cos_sin(positions)
    rows = apply_rope(rms_norm(pooled, w.norm, eps), cos, sin, in_place=True)
    if grid is not None:
        rows = grid(rows)
    st.out.extend(rows)
    return rows
