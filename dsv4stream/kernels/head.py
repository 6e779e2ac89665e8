"""The head's logits: the BF16 head through `kernels.matmul`, or its int8 copy under `fast`.

Owns `Int8Head` (the copy `trunkpack.headcopy` writes into a pack: int8 rows, one float32 scale
per row) and `head_logits`, which every head product of the main model goes through. The copy
is used only while the kernels' numerics is `fast` (exact and official never read it), on the
CPU (a head moved to a GPU keeps its own product), where `headq8` has a SIMD variant (`copy_runs`). Imports numba (`headq8`) only when the copy
is used, like `kernels` itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Int8Head:
    """q (vocab, dim) int8 in [-127, 127], s (vocab,) float32: row r is q[r] * s[r]."""

    q: np.ndarray
    s: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.s.nbytes


def copy_runs() -> bool:
    """Whether this process multiplies by the copy under fast: the numba backend on a CPU target
    with a SIMD variant of `headq8` (AVX-512 VNNI or AVX2). Elsewhere fast reads the BF16 head
    through the exact kernels, as every other product of fast does on such a target."""
    from . import backend_name

    if backend_name() != "fast":
        return False
    from . import headq8

    return headq8.variant() != "plain"


def head_logits(head, q8: Int8Head | None, x: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
    """Logits of normed hidden rows x (T, dim) -> (T, vocab) float32; `extra` (n, dim): other
    normed rows (a drafter's) in the same call, their logits after x's (T + n, vocab): the head's
    weights are read once for both."""
    from . import _count, get_numerics, matmul

    if extra is not None:
        x = np.concatenate([x, extra.astype(x.dtype, copy=False)])
    if q8 is None or get_numerics() != "fast" or head.on_device or not copy_runs():
        return matmul(head, x)
    from . import headq8
    from .jit import _apply_threads

    t0 = time.perf_counter()
    _apply_threads()  # numba's thread count is per calling thread: set_threads' count, as the other kernels
    y = headq8.matmul(q8.q, q8.s, np.ascontiguousarray(x, dtype=np.float32))
    _count(head.role, t0)
    return y
