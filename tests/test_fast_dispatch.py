"""The per-product dispatch of `fast` numerics (kernels/numerics.py's `Router`): the decisions
it takes once instead of per call (the variant of a weight's kind and width) and the kernel
thread count it puts on whichever thread multiplies.

Independent checks: the variant cache against `fast_variant` asked afresh, and numba's own
per-thread count read back in a worker thread.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest

from dsv4stream import kernels
from dsv4stream.checkpoint import formats
from dsv4stream.kernels import QWeight, cpu, numerics

fast = pytest.importorskip("dsv4stream.kernels.fast")
needs_fast = pytest.mark.skipif(cpu.variant("fp4") is None, reason="no fast kernel variant for this CPU target")


def fp4(rng, r: int, c: int) -> QWeight:
    d, s = formats.quantize_fp4((rng.standard_normal((r, c)) * 0.02).astype(np.float32))
    return QWeight("fp4", d, s, r, c, role="experts")


@pytest.fixture
def fast_numerics():
    before = kernels.get_numerics()
    kernels.set_numerics("fast")
    try:
        yield
    finally:
        kernels.set_numerics(before)


@needs_fast
def test_variant_decided_per_kind_and_width(fast_numerics):
    """A width the fast FP4 kernel does not take (not a multiple of 256) goes the exact way even
    after a weight of the same kind that it does take, and the other way round."""
    rng = np.random.default_rng(0)
    router = kernels._numerics
    ok, narrow = fp4(rng, 8, 256), fp4(rng, 8, 96)
    for w in (ok, narrow, ok, narrow):
        assert router._variant(w) == numerics.fast_variant(w, fast)
    assert router._variant(ok) and router._variant(narrow) is None
    x = rng.standard_normal((1, 96)).astype(np.float32)
    assert kernels.matmul(narrow, x).tobytes() == fast.matmul(narrow, x).tobytes()  # the exact kernel's bits


@needs_fast
@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 cores")
def test_fast_thread_setting_holds_in_other_threads(fast_numerics):
    """numba's count is per thread: a fast product in a worker thread (the server's engine
    thread) runs with the count `set_threads` asked for, not numba's default."""
    w = fp4(np.random.default_rng(1), 16, 256)
    before = kernels.get_threads()
    seen = []

    def work():
        kernels.matmul(w, np.ones((1, 256), np.float32))
        seen.append(numba.get_num_threads())

    try:
        kernels.set_threads(1)
        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        kernels.set_threads(before)
    assert seen == [1]


@needs_fast
@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 cores")
def test_small_products_run_on_the_calling_thread(fast_numerics, monkeypatch):
    """A weight below SERIAL_BELOW_BYTES at a few tokens runs without a parallel region (numba's
    count 1 while it runs, put back after); a larger one, or many tokens, on every thread."""
    rng = np.random.default_rng(2)
    small, big = fp4(rng, 16, 256), fp4(rng, 4096, 2048)  # 2 KB; 4 MiB of codes + scales
    assert small.nbytes < numerics.SERIAL_BELOW_BYTES <= big.nbytes
    seen = []
    real = numerics._fast

    def spy(*args):
        seen.append(numba.get_num_threads())
        return real(*args)

    monkeypatch.setattr(numerics, "_fast", spy)
    before = kernels.get_threads()
    try:
        kernels.set_threads(2)
        kernels.matmul(small, rng.standard_normal((1, 256)).astype(np.float32))
        assert numba.get_num_threads() == 2
        kernels.matmul(big, rng.standard_normal((1, 2048)).astype(np.float32))
        kernels.matmul(small, rng.standard_normal((numerics.SERIAL_TOKENS + 1, 256)).astype(np.float32))
    finally:
        kernels.set_threads(before)
    assert seen == [1, 2, 2]
