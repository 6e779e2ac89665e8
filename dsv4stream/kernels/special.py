"""Special functions numpy lacks, as numba ufuncs: `erf` (the vision aligner's exact GELU).

Computed in float64 by the C library's erf (through numba's `math.erf`), so a float32 caller
gets the correctly rounded value of its argument's erf almost always.
"""

from __future__ import annotations

import math

import numba


@numba.vectorize(["float64(float64)"])
def erf(x: float) -> float:
    return math.erf(x)
