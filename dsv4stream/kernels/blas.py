"""numpy's BLAS on one thread for one-query products, through the library's own entry points.

Owns `one_thread(on)`. One query's attention (per layer and decode step: (H, hd) x (hd, S)
and back, S up to the window plus the compressed rows) is a few MFLOP, and OpenBLAS splits
it over all cores: the second thread then waits for a core that numba's workers, the expert
readers and other programs hold. Measured on 2 busy AMD EPYC cores (load 8; `attend` at
V4-Flash's 64 heads x 512): 3 keys 0.28 -> 0.035 ms, 21 keys and 5 compressed rows 0.77 ->
0.10 ms, 128 keys and 512 indexed rows 15.7 -> 3.5 ms; after a 200-token prompt one layer's
`attend` took 176 ms, which made decode slower the longer the prompt. Products of several
queries (prefill) keep every thread. Libraries without these entry points (MKL, Accelerate,
a BLAS not yet loaded) are left alone: `one_thread` is then a no-op.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np  # noqa: F401  (loads numpy's BLAS, so /proc/self/maps lists it)

# (get, set) entry points as OpenBLAS builds name them: numpy's wheels, 64-bit-int and plain
_NAMES = (
    ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
    ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
    ("openblas_get_num_threads", "openblas_set_num_threads"),
)
_lib: list = []  # [(get, set)] once found, [None] if there is none


def _entry_points():
    if _lib:
        return _lib[0]
    found = None
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and ln.rstrip().endswith(".so")})
    except OSError:
        paths = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get, put in _NAMES:
            if hasattr(lib, get) and hasattr(lib, put):
                getattr(lib, put).argtypes = [ctypes.c_int]
                found = (getattr(lib, get), getattr(lib, put))
                break
        if found:
            break
    _lib.append(found)
    return found


@contextmanager
def one_thread(on: bool = True) -> Iterator[None]:
    """numpy's BLAS on one thread inside the block when `on` (else untouched); restored after."""
    fns = _entry_points() if on else None
    if fns is None:
        yield
        return
    get, put = fns
    before = get()
    if before == 1:
        yield
        return
    put(1)
    try:
        yield
    finally:
        put(before)


def threads() -> int | None:
    """numpy's BLAS thread count now, or None where it cannot be read."""
    fns = _entry_points()
    return None if fns is None else int(fns[0]())
