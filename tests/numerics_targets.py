"""A tiny forward of each family under each numerics, for tests/test_numerics_targets.py: the
logits of a V4 and a V4.1 fixture (prefill of a few tokens and a few single steps after it),
`exact` and `fast`. Run in process (the host's target) and, as a script writing an .npz, in a
child process with another numba CPU target (`NUMBA_CPU_NAME=haswell` / `generic`,
`NUMBA_CPU_FEATURES=`): the AVX2 variants and the fallback to the exact kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"
CASES = {"v4": FIXTURES / "mixed", "v41": FIXTURES / "v41" / "clamp"}
PREFILL, STEPS = 6, 2


def forward() -> dict[str, np.ndarray]:
    """{"v4/exact": logits (PREFILL + STEPS, V), ..., "variant": the fast kernels' target line}."""
    from dsv4stream import kernels
    from dsv4stream.engine.session import Engine
    from dsv4stream.kernels import cpu

    out: dict[str, np.ndarray] = {"variant": np.array(cpu.describe())}
    try:
        for fam, path in CASES.items():
            with np.load(path / "oracle.npz") as z:
                ids = z["token_ids"][: PREFILL + STEPS]
            for mode in ("exact", "fast"):
                s = Engine.open(path, numerics=mode).session(chunk_size=1 << 30)
                rows = [s.prefill(ids[:PREFILL])] + [s.step(int(t))[None] for t in ids[PREFILL:]]
                out[f"{fam}/{mode}"] = np.concatenate(rows)
    finally:
        kernels.set_numerics("exact")  # the process's numerics as the other tests expect them
    return out


if __name__ == "__main__":
    np.savez(sys.argv[1], **forward())
