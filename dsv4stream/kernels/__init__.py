"""Quantized matrix times vector / matrix: the one interface the model calls for linears.

Owns: `QWeight` (a linear weight as stored: FP8, FP4, BF16 or F32 plus its scales) and the
dispatch of `matvec` / `matmul` to a backend. The numpy reference (`reference.py`) is the
readable definition; a fused numba backend replaces it when available. Backends must give
results that do not depend on the thread count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import reference

KINDS = ("fp8", "fp4", "bf16", "f32")


@dataclass(frozen=True)
class QWeight:
    """y = W @ x with W logically (rows, cols) float.

    data: fp8 uint8 (R, C); fp4 uint8 (R, C//2); bf16 uint16 (R, C); f32 float32 (R, C).
    scale: fp8 (ceil(R/128), ceil(C/128)); fp4 (R, C//32); uint8 E8M0 bytes or float32; else None.
    """

    kind: str
    data: np.ndarray
    scale: np.ndarray | None
    rows: int
    cols: int

    # A subclass whose arrays live on a device (dsv4stream.gpu.DeviceQWeight) sets this and
    # multiplies itself there: matvec / matmul / dense hand it over instead of a CPU backend.
    on_device: ClassVar[bool] = False

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)


_backend = None  # resolved on first use: the numba backend when it imports, else the reference


def set_backend(name: str) -> None:
    """'reference' (numpy) or 'fast' (numba; falls back to the reference if numba is missing)."""
    global _backend
    if name == "reference":
        _backend = reference
        return
    try:
        from . import fast  # numba import is heavy: only when first needed
    except ImportError:
        _backend = reference
    else:
        _backend = fast


def _active():
    if _backend is None:
        set_backend("fast")
    return _backend


def backend_name() -> str:
    return _active().__name__.rsplit(".", 1)[-1]


def set_threads(n: int) -> None:
    """Thread count for the CPU kernels (numba); the reference ignores it."""
    backend = _active()
    if hasattr(backend, "set_threads"):
        backend.set_threads(n)


def warmup() -> float:
    """Compile (or load from the numba cache) every kernel; returns the seconds it took."""
    backend = _active()
    return backend.warmup() if hasattr(backend, "warmup") else 0.0


def compiled_cache_exists() -> bool:
    """Whether numba's on-disk cache of the fast kernels is there (else warmup compiles, ~1 min).

    Asks numba where it keeps the cache: next to the source, under NUMBA_CACHE_DIR, or in a
    per-user folder when the package directory is read-only."""
    from pathlib import Path

    try:
        from . import fast

        cache = Path(fast._fp4_mv._cache._cache_path)  # numba's locator for this dispatcher
    except (ImportError, AttributeError):
        cache = Path(__file__).with_name("__pycache__")
    return any(cache.glob("fast.*.nbi"))


def matvec(w: QWeight, x: np.ndarray) -> np.ndarray:
    """x (C,) float32 -> (R,) float32."""
    if w.on_device:
        return w.matvec(x)
    return _active().matvec(w, x)


def matmul(w: QWeight, x: np.ndarray) -> np.ndarray:
    """X (T, C) float32 -> (T, R) float32."""
    if w.on_device:
        return w.matmul(x)
    return _active().matmul(w, x)


def dense(w: QWeight) -> np.ndarray:
    """The whole weight as float32 (R, C): for tests and small matrices only."""
    if w.on_device:
        return w.dense()
    return reference.dequant(w)
