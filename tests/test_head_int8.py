"""The int8 head: the kernel against float math (AVX-512 here, AVX2 and plain in child processes
with `NUMBA_CPU_NAME=haswell` / `generic`: an instruction the CPU lacks is SIGILL, not an
exception), the copy pack-trunk writes (round trip, refusals, resume), an old pack without it
(runs on the BF16 head, upgraded in place), and fast's logits reading it (exact never does).
The plan's rule for the copy and the BF16 head: tests/test_head_plan.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv4stream import kernels, synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.errors import CheckpointError
from dsv4stream.kernels import cpu
from dsv4stream.run.memory import measure
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.trunkpack import headcopy
from dsv4stream.trunkpack.format import MANIFEST
from dsv4stream.trunkpack.reader import TrunkFile
from dsv4stream.trunkpack.upgrade import upgrade_trunk
from dsv4stream.trunkpack.writer import pack_trunk

pytestmark = pytest.mark.skipif(kernels.backend_name() != "fast", reason="numba kernels only")
ROOT = Path(__file__).resolve().parents[1]


def _case(seed: int, rows: int, cols: int, tokens: int):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)
    x = (rng.standard_normal((tokens, cols)) * rng.uniform(0.1, 10, (1, cols))).astype(np.float32)
    return w, x


# ---------------------------------------------------------------- the kernel ----------------


def test_rows_round_to_int8_within_half_a_step():
    w, _ = _case(0, 300, 192, 1)
    w[7] = 0.0
    q, s = headcopy.quantize_rows(w)
    assert q.dtype == np.int8 and s.dtype == np.float32 and q.min() >= -127 and q.max() <= 127
    assert s[7] == 0 and not q[7].any()
    np.testing.assert_allclose(q * s[:, None], w, rtol=0, atol=float(s.max()) * 0.5001)
    assert (np.abs(q).max(axis=1)[s > 0] == 127).all()  # each row's absmax lands on 127
    with pytest.raises(CheckpointError, match="NaN or an infinity"):
        headcopy.quantize_rows(np.full((2, 64), np.inf, np.float32))


@pytest.mark.skipif(cpu.features().isdisjoint({"avx512vnni"}), reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("variant", ["avx512", "avx2", "plain"])
@pytest.mark.parametrize("cols", [64, 192, 512])
def test_kernel_against_float_math(variant, cols):
    from dsv4stream.kernels import headq8

    w, x = _case(cols, 333, cols, 7)
    q, s = headcopy.quantize_rows(w)
    got = headq8.matmul(q, s, x, v=variant)
    ref = headq8.reference(q, s, x)  # the same roundings, summed in float64
    assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    err = np.abs(got - exact).max(axis=1) / np.abs(exact).max(axis=1)
    assert 0 < np.median(err) < 0.02  # int8 weights and activations: ~1% of the largest logit
    # a row's bits depend on nothing but that row and its token: not the tokens beside it, nor threads
    alone = np.stack([headq8.matmul(q, s, x[i : i + 1], v=variant)[0] for i in range(x.shape[0])])
    np.testing.assert_array_equal(alone, got)
    np.testing.assert_array_equal(headq8.matmul(q[5:9], s[5:9], x, v=variant), got[:, 5:9])
    n = kernels.get_threads()
    try:
        np.testing.assert_array_equal(headq8.matmul(q, s, x, threads=1, v=variant), got)
    finally:
        kernels.set_threads(n)


def test_a_non_finite_activation_group_makes_its_logits_nan():
    from dsv4stream.kernels import headq8

    w, x = _case(1, 40, 128, 2)
    q, s = headcopy.quantize_rows(w)
    x[1, 70] = np.nan
    got = headq8.matmul(q, s, x)
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()


_CHILD = """
import json, sys, numpy as np
from dsv4stream.kernels import head, headq8
from dsv4stream.trunkpack.headcopy import quantize_rows
rng = np.random.default_rng(3)
w = rng.standard_normal((200, 320)).astype(np.float32)
x = rng.standard_normal((3, 320)).astype(np.float32)
q, s = quantize_rows(w)
got, ref = headq8.matmul(q, s, x), headq8.reference(q, s, x)
print(json.dumps([headq8.variant(), float(np.abs(got - ref).max() / np.abs(ref).max()), head.copy_runs()]))
"""


@pytest.mark.parametrize("target,want,runs", [("haswell", "avx2", True), ("generic", "plain", False)])
def test_other_cpu_targets_run_their_variant(target, want, runs):
    # generic: fast reads the BF16 head by the exact kernels (fast is exact there), the plain
    # variant is only checked against float math
    env = {**os.environ, "NUMBA_CPU_NAME": target, "NUMBA_CPU_FEATURES": ""}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    r = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]  # SIGILL would be a negative return code
    variant, err, copy_runs = json.loads(r.stdout.strip().splitlines()[-1])
    assert variant == want and err < 2e-6 and copy_runs is runs


# ---------------------------------------------------------------- the pack -------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return synth.make_checkpoint(tmp_path_factory.mktemp("h") / "ckpt", "tiny", seed=0)


@pytest.fixture(scope="module")
def packed(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("h") / "trunk"
    pack_trunk(ckpt, out, progress=False)
    return out


def _head(cat: Catalog) -> np.ndarray:
    from dsv4stream.checkpoint.formats import bf16_to_f32

    return bf16_to_f32(cat.read("head.weight"))


def test_pack_writes_the_copy_and_it_reads_back(ckpt, packed):
    cat = Catalog.open(ckpt)
    m = json.loads((packed / MANIFEST).read_text())
    e = m[headcopy.ENTRY]
    assert (e["file"], e["rows"], e["cols"]) == (headcopy.FILE, *cat.entry("head.weight").shape)
    assert (packed / e["file"]).stat().st_size == e["file_bytes"] and e["file_bytes"] % 4096 == 0
    tf = TrunkFile.open(packed, cat, verify=True)
    q, s = tf.read_head_q8()
    want_q, want_s = headcopy.quantize_rows(_head(cat))
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(s, want_s)


def _copy(packed: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "trunk"
    shutil.copytree(packed, out)
    return out


def test_a_damaged_or_foreign_copy_is_refused(ckpt, packed, tmp_path):
    cat = Catalog.open(ckpt)
    out = _copy(packed, tmp_path)
    data = out / headcopy.FILE
    b = bytearray(data.read_bytes())
    b[10] ^= 1
    data.write_bytes(bytes(b))
    tf = TrunkFile.open(out, cat)
    with pytest.raises(CheckpointError, match="int8 head copy fails its checksum"):
        tf.read_head_q8()
    with pytest.raises(CheckpointError, match="blake2b"):
        tf.verify()
    assert upgrade_trunk(out).head_copy  # what the message says to run: writes it again
    np.testing.assert_array_equal(TrunkFile.open(out, cat).read_head_q8()[0], headcopy.quantize_rows(_head(cat))[0])
    m = json.loads((out / MANIFEST).read_text())
    m[headcopy.ENTRY]["source_xxh3"] = "0" * 16  # made from another head
    (out / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="does not describe this pack's head"):
        TrunkFile.open(out, cat)
    assert upgrade_trunk(out).head_copy
    TrunkFile.open(out, cat, verify=True)


def _strip_copy(out: Path) -> None:
    """What a pack written before the copy existed looks like."""
    m = json.loads((out / MANIFEST).read_text())
    del m[headcopy.ENTRY]
    (out / MANIFEST).write_text(json.dumps(m, indent=1))
    (out / headcopy.FILE).unlink()


def test_an_old_pack_runs_on_the_bf16_head_and_is_upgraded_in_place(ckpt, packed, tmp_path):
    cat = Catalog.open(ckpt)
    out = _copy(packed, tmp_path)
    _strip_copy(out)
    assert TrunkFile.open(out, cat, verify=True).head_q8 is None
    assert measure(ckpt, RunOptions(budget=10**9, trunk=out, numerics="fast")).head_q8_bytes == 0
    r = upgrade_trunk(out)
    assert r.head_copy and not r.up_to_date
    assert TrunkFile.open(out, cat, verify=True).head_q8 == json.loads((packed / MANIFEST).read_text())["head_q8"]
    assert upgrade_trunk(out).up_to_date
    r = pack_trunk(ckpt, out, progress=False)  # a pack holding the copy is a pack: up to date
    assert r.up_to_date and not r.head_copy_added
    pack_trunk(ckpt, out, progress=False, force=True, layers=2)  # and --force may replace it
    pack_trunk(ckpt, out, progress=False, force=True)
    _strip_copy(out)
    r = pack_trunk(ckpt, out, progress=False)  # pack-trunk on the same pack adds it too
    assert r.head_copy_added and not r.written and (out / headcopy.FILE).exists()


def test_an_interrupted_pack_resumes_and_writes_the_copy(ckpt, packed, tmp_path):
    out = tmp_path / "trunk"

    def stop(key, written):
        if key == "head":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack_trunk(ckpt, out, progress=False, on_run=stop)
    r = pack_trunk(ckpt, out, progress=False)
    assert "head" in r.skipped
    assert (out / headcopy.FILE).read_bytes() == (packed / headcopy.FILE).read_bytes()


# ---------------------------------------------------------------- plan and run ---------------


def test_fast_logits_read_the_copy_and_exact_never_does(ckpt, packed):
    ids = np.array([1, 2, 3, 4, 5])
    out = {}
    for mode in ("fast", "exact"):
        with Runtime.open(ckpt, RunOptions(budget=10**9, trunk=packed, io="buffered", numerics=mode)) as rt:
            top = rt.engine.stack.head_weights()
            assert (top.q8 is not None) == (mode == "fast")
            out[mode] = rt.session().prefill(ids)
            if mode == "fast":
                assert any("int8 copy" in ln for ln in rt.plan.lines())
                kernels.set_numerics("fast")
                bf16 = kernels.matmul(top.head, np.ones((1, top.head.cols), np.float32))
                q8 = kernels.head.head_logits(top.head, top.q8, np.ones((1, top.head.cols), np.float32))
                assert not np.array_equal(bf16, q8)  # the copy is what fast multiplies
    kernels.set_numerics("exact")
    with Runtime.open(ckpt, RunOptions(budget=10**9, trunk="", io="buffered", numerics="exact")) as rt:
        np.testing.assert_array_equal(rt.session().prefill(ids), out["exact"])  # exact keeps its bits
    err = np.abs(out["fast"] - out["exact"]).max(axis=1) / np.abs(out["exact"]).max(axis=1)
    assert 0 < np.median(err) < 0.05
