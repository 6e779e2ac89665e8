"""Special functions numpy lacks, as numba ufuncs: `erf` (the vision aligner's exact GELU).

Computed in float64 by the C library's erf (through numba's `math.erf`), so a float32 caller
gets the correctly rounded value of its argument's erf almost always.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np


def _erf(x: float) -> float:
    return math.erf(x)


@functools.cache
def _erf_ufunc():
    # compiled at the first call, not at import: every `dsv4` process imports this module (the
    # engine imports the vision tower), and compiling here cost each ~0.2 CPU-s that runs no image
    return numba.vectorize(["float64(float64)"])(_erf)


def erf(x: np.ndarray) -> np.ndarray:
    """erf of each element of float64 `x`."""
    return _erf_ufunc()(x)
