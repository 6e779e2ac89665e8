"""How far each numerics is from the float32 references of the oracle fixtures (V4: transformers'
logits; V4.1: DeepSeek's fp32 reference), prefill and step: per fixture and feeding mode, the
median over positions of max|ours - ref| / max|ref| and the argmax agreement on clear positions
(top-2 gap of the reference >= CLEAR of max|ref|). Used by tests/test_numerics_wiring.py, in
process and, as a script printing JSON, in a child process with another numba CPU target
(`NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=`: the AVX2 variants)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"
V4_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "oracle.npz").exists())
V41_NAMES = sorted(p.name for p in (FIXTURES / "v41").iterdir() if (p / "oracle.npz").exists())
CLEAR = 0.01  # top-2 gap / max |logit| below which an argmax is a coin toss under rounding
STEPS = 24  # decoded positions per fixture (step mode costs one forward pass a token)


def _oracle(path: Path) -> dict:
    with np.load(path / "oracle.npz") as z:
        return {k: z[k] for k in z.files}


def figures(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1)
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) / np.abs(ref).max(axis=1) >= CLEAR
    agree = float((got.argmax(1) == ref.argmax(1))[clear].mean()) if clear.any() else 1.0
    return float(np.median(err)), agree


def _logits(eng, ids: np.ndarray, mode: str) -> np.ndarray:
    if mode == "prefill":
        return eng.session(chunk_size=1 << 30).prefill(ids)
    s = eng.session(segment=1)
    return np.stack([s.step(int(t)) for t in ids])


INT8_HEAD = "fast+int8 head"  # fast numerics with the pack's int8 head copy (`trunkpack.headcopy`)


def with_int8_head(eng) -> bool:
    """Give an engine's head the int8 copy pack-trunk would write (False where the head takes none)."""
    from dataclasses import replace

    from dsv4stream import kernels
    from dsv4stream.kernels.head import Int8Head
    from dsv4stream.trunkpack.headcopy import COL_MULTIPLE, quantize_rows

    top = eng.trunk.head()
    if top.head.kind != "bf16" or top.head.cols % COL_MULTIPLE:
        return False
    eng.trunk._head = replace(top, q8=Int8Head(*quantize_rows(kernels.dense(top.head))))
    return True


def deviations(numerics: tuple[str, ...] = ("exact", "official", "fast"), names: tuple[str, ...] | None = None) -> dict:
    """{"v4/NAME/prefill": {numerics: [median, agree]}, ...} for every fixture (names: only those)."""
    from dsv4stream import kernels
    from dsv4stream.engine.session import Engine

    out: dict = {}
    cases = [("v4", FIXTURES / n, "logits", "logits") for n in V4_NAMES]
    cases += [("v41", FIXTURES / "v41" / n, "prefill_fp32", "step_fp32_owner") for n in V41_NAMES]
    cases = [c for c in cases if names is None or c[1].name in names]
    try:
        for fam, path, pre_key, step_key in cases:
            o = _oracle(path)
            ids = o["token_ids"]
            for mode, key, n in (("prefill", pre_key, ids.size), ("step", step_key, min(STEPS, ids.size))):
                row = out.setdefault(f"{fam}/{path.name}/{mode}", {})
                for m in numerics:
                    eng = Engine.open(path, numerics="fast" if m == INT8_HEAD else m)
                    if m == INT8_HEAD and not with_int8_head(eng):
                        continue  # a head the copy does not take: fast reads the BF16 head
                    row[m] = figures(_logits(eng, ids[:n], mode), o[key][:n])
    finally:
        kernels.set_numerics("exact")  # the process's numerics as the other tests expect them
    return out


if __name__ == "__main__":
    json.dump(deviations(), sys.stdout)
