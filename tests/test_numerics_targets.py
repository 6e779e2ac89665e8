"""The kernels on CPU targets other than this machine's: a tiny forward of a V4 and a V4.1
fixture (`tests/numerics_targets.py`: prefill then single steps, `exact` and `fast`) in a child
process with `NUMBA_CPU_NAME=generic` (no AVX2, no F16C, no FMA: every fast product falls back
to the exact kernels) and `=haswell` (the AVX2 variants), against the same forward here.

What holds, and why: `exact` gives the same bits on every target (the kernels' FMAs are
`llvm.fma`, rounded once whether the CPU has the instruction or a libm call does it; E2M1 / E4M3
decode exactly with or without F16C; nothing is reassociated). `fast` on generic is `exact`,
bit for bit; on haswell the AVX2 kernels round as the AVX-512 ones do up to the order of the
float32 sums (vdpbf16ps adds pairs), so they agree to ~1e-5 of the logits' range and are as
far from exact as this machine's fast path.

Before the half-float decode without F16C (`jit._half_to_f32`), the generic child aborted:
LLVM called compiler-rt's `__extendhfsf2`, which numba does not link."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numerics_targets as nt
import numpy as np
import pytest

from dsv4stream import kernels

pytestmark = pytest.mark.skipif(kernels.backend_name() != "fast", reason="numba kernels only")


@pytest.fixture(scope="module")
def native():
    return nt.forward()


def _child(target: str, tmp_path: Path) -> dict[str, np.ndarray]:
    env = {**os.environ, "NUMBA_CPU_NAME": target, "NUMBA_CPU_FEATURES": ""}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(nt.__file__).parents[1]), env.get("PYTHONPATH")) if p)
    out = tmp_path / f"{target}.npz"
    r = subprocess.run(
        [sys.executable, nt.__file__, str(out)], env=env, capture_output=True, text=True, timeout=1200, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


def _err(got: np.ndarray, ref: np.ndarray) -> float:
    """Median over positions of max|got - ref| / max|ref|."""
    return float(np.median(np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1)))


def test_generic_target_runs_the_exact_kernels_for_every_numerics(native, tmp_path):
    got = _child("generic", tmp_path)
    assert str(got["variant"]).endswith("fp4=exact fp8=exact bf16=exact"), got["variant"]
    for fam in nt.CASES:
        np.testing.assert_array_equal(got[f"{fam}/exact"], native[f"{fam}/exact"])
        np.testing.assert_array_equal(got[f"{fam}/fast"], native[f"{fam}/exact"])


def test_haswell_target_runs_the_avx2_variants_as_close_as_avx512(native, tmp_path):
    got = _child("haswell", tmp_path)
    assert str(got["variant"]).endswith("fp4=avx2 fp8=avx2 bf16=avx2"), got["variant"]
    for fam in nt.CASES:
        exact, fast = native[f"{fam}/exact"], native[f"{fam}/fast"]
        np.testing.assert_array_equal(got[f"{fam}/exact"], exact)
        assert not np.array_equal(got[f"{fam}/fast"], exact)  # the fast kernels ran, not the fallback
        assert _err(got[f"{fam}/fast"], fast) < 1e-4
        assert _err(got[f"{fam}/fast"], exact) <= 1.1 * _err(fast, exact) + 1e-6
        np.testing.assert_array_equal(got[f"{fam}/fast"].argmax(1), fast.argmax(1))
