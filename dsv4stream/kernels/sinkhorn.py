"""The Sinkhorn passes of the hyper-connection mix (`model.mhc.split_mixes`) in one numba call.

Owns `sinkhorn(comb, iters, eps)`: comb (T, hc, hc) float32, every entry positive (a softmax
plus eps), normalised in place as numpy does it: one column pass, then iters - 1 (row, column)
passes, each entry divided by (its row's or column's sum + eps). At decode a comb is 16 values,
and numpy's per-call cost on each of the 120 reductions, additions and divisions of 20 passes
outweighs the arithmetic, two mixes per layer and token.

Same bits as numpy: a division and an addition are rounded once either way; the sums are
taken in index order, which is what numpy's reduction does for fewer than 8 terms along either
axis (its pairwise summation unrolls from 8 on), so `hc < MAX_HC` is required here and the
caller keeps numpy's loop for wider mixes. tests/test_v41_kernels.py compares the bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .jit import _JIT

MAX_HC = 8  # numpy sums fewer terms than this one by one, in order


@njit(**_JIT)
def _passes(comb, iters, eps):
    t, n = comb.shape[0], comb.shape[1]
    for b in range(t):
        for p in range(2 * iters - 1):
            if p % 2 == 1:  # rows (axis -1)
                for i in range(n):
                    s = comb[b, i, 0]
                    for j in range(1, n):
                        s = s + comb[b, i, j]
                    d = s + eps
                    for j in range(n):
                        comb[b, i, j] = comb[b, i, j] / d
            else:  # columns (axis -2)
                for j in range(n):
                    s = comb[b, 0, j]
                    for i in range(1, n):
                        s = s + comb[b, i, j]
                    d = s + eps
                    for i in range(n):
                        comb[b, i, j] = comb[b, i, j] / d


def sinkhorn(comb: np.ndarray, iters: int, eps: np.float32) -> np.ndarray:
    """comb (T, hc, hc) float32 (hc < MAX_HC), normalised in place and returned."""
    if comb.ndim != 3 or comb.shape[1] != comb.shape[2] or comb.shape[1] >= MAX_HC or comb.dtype != np.float32:
        raise ValueError(f"sinkhorn takes (T, hc, hc) float32 with hc < {MAX_HC}, found {comb.shape} {comb.dtype}")
    if not comb.flags.c_contiguous or not comb.flags.writeable:
        raise ValueError("sinkhorn normalises in place: comb must be C-contiguous and writable")
    _passes(comb, max(1, int(iters)), np.float32(eps))
    return comb


def warmup() -> None:
    sinkhorn(np.ones((1, 4, 4), np.float32), 2, np.float32(1e-6))
