"""The int8 head's row kernels: rows read several at a time give each row the bits it has alone
(any row count, remainders, the prefetch past the last row), and the integer dot products are
exact at the extremes (AVX-512's unsigned w + 128 with its -128 * sum(a) start, AVX2's sign
trick). AVX2 runs in-process here (this machine has it); tests/test_head_int8.py has the
float-math checks and the child processes for other CPU targets."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4stream import kernels
from dsv4stream.kernels import cpu

pytestmark = [
    pytest.mark.skipif(kernels.backend_name() != "fast", reason="numba kernels only"),
    pytest.mark.skipif(cpu.features().isdisjoint({"avx512vnni"}), reason="needs AVX-512 VNNI"),
]
VARIANTS = ["avx512", "avx2"]


def _q(rng, rows, cols):
    q = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
    s = rng.uniform(0.001, 0.1, rows).astype(np.float32)
    return q, s


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 17, 35])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 7, 8])
def test_a_row_has_the_bits_it_has_alone(variant, rows, tokens):
    from dsv4stream.kernels import headq8

    rng = np.random.default_rng(rows * 10 + tokens)
    q, s = _q(rng, rows, 192)
    x = rng.standard_normal((tokens, 192)).astype(np.float32)
    got = headq8.matmul(q, s, x, v=variant)
    alone = np.concatenate([headq8.matmul(q[r : r + 1], s[r : r + 1], x, v=variant) for r in range(rows)], axis=1)
    np.testing.assert_array_equal(got.view(np.uint32), alone.view(np.uint32))


@pytest.mark.parametrize("variant", VARIANTS)
def test_integer_sums_are_exact_at_the_extremes(variant):
    # d = s = 1 (every row and token reaches 127), 512 columns: every partial sum is an integer
    # below 2^24, so the float result must be the exact integer dot product
    from dsv4stream.kernels import headq8

    rng = np.random.default_rng(0)
    cols = 512
    q = rng.integers(-127, 128, (37, cols), dtype=np.int8)
    q[0], q[1], q[2] = 127, -127, 0
    q[3, ::2], q[3, 1::2] = -127, 127
    q[:, 0] = np.where(q[:, 0] == 0, 0, 127)  # absmax 127 in every nonzero row
    q[2, 5] = 127
    x = rng.integers(-127, 128, (5, cols)).astype(np.float32)
    x[:, 0::32] = 127.0  # each group's absmax is 127: d = 1
    x[0], x[1] = 127.0, -127.0
    x[2, ::2], x[2, 1::2] = 127.0, -127.0
    qa, da, xc = headq8.prepare(x)
    assert (da == 1).all() and np.array_equal(qa, x.astype(np.int8))
    np.testing.assert_array_equal(xc, -128 * qa.astype(np.int32).reshape(5, -1, 4).sum(axis=2))
    got = headq8.matmul(q, np.ones(37, np.float32), x, v=variant)
    want = qa.astype(np.int64) @ q.astype(np.int64).T
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert got[0, 0] == 127 * 127 * cols and got[1, 0] == -127 * 127 * cols
