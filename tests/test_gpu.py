"""`--gpu` without a GPU: availability and the one-line fallback, the reserved-core split,
the VRAM planner, and the device boundary driven by the numpy stand-in device (the same
upload and dequantise-then-GEMM code the CUDA backend runs for prefill chunks)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gpu_fakes import FakeCudaOps

from dsv4stream import gpu, kernels
from dsv4stream.checkpoint import formats
from dsv4stream.engine.session import Engine
from dsv4stream.gpu import affinity, context, cuda, plan
from dsv4stream.gpu.device import DeviceQWeight
from dsv4stream.kernels import QWeight
from dsv4stream.weights.providers import CatalogExperts, CatalogTrunk

FIXTURES = Path(__file__).parent / "fixtures"
MIB = 1 << 20


# ---- availability and the fallback line -------------------------------------------------


def test_importing_the_package_does_not_import_cupy() -> None:
    code = (
        "import sys\n"
        "class Spy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('cupy', 'cupyx'):\n"
        "            raise SystemExit('cupy imported: ' + name)\n"
        "sys.meta_path.insert(0, Spy())\n"
        "import dsv4stream.gpu, dsv4stream.gpu.cuda, dsv4stream.engine.session\n"
        "ctx = dsv4stream.gpu.setup(False, None, 3)\n"
        "assert not ctx.enabled and ctx.threads == 3 and not ctx.take_messages()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr + r.stdout


def test_without_cupy_one_line_and_the_cpu(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ModuleNotFoundError
    ok, reason = gpu.available()
    assert not ok and reason.startswith("CuPy is not installed (pip install 'dsv4stream[gpu]'")
    for threads in (None, 3):
        ctx = gpu.setup(True, 4.0, threads)
        assert not ctx.enabled and ctx.threads == threads
        lines = ctx.take_messages()
        assert len(lines) == 1 and "\n" not in lines[0]
        assert lines[0].startswith("dsv4: --gpu: CuPy is not installed") and lines[0].endswith("; running on the CPU")
        assert ctx.take_messages() == []
        assert ctx.place("catalog") is None and ctx.source("catalog") == "catalog"


def _fake_cupy(count=None, status=None) -> types.ModuleType:
    class CUDARuntimeError(RuntimeError):
        def __init__(self, status: int) -> None:
            super().__init__(f"cudaError {status}")
            self.status = status

    def get_device_count() -> int:
        if status is not None:
            raise CUDARuntimeError(status)
        return count

    m = types.ModuleType("cupy")
    m.__version__ = "13.9.9"
    m.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_device_count))
    return m


@pytest.mark.parametrize(
    "count,status,expect",
    [
        (None, 100, "no CUDA device found"),
        (0, None, "no CUDA device found"),
        (None, 35, "the NVIDIA driver is missing or older than CUDA 12.x"),
        (None, 999, "CUDA is not usable (CUDARuntimeError: cudaError 999)"),
    ],
)
def test_cupy_without_a_device(monkeypatch, count, status, expect) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(count, status))
    ok, reason = gpu.available()
    assert not ok and reason.startswith(expect)
    ctx = gpu.setup(True, None, None)
    assert not ctx.enabled and ctx.take_messages() == [f"dsv4: --gpu: {reason}; running on the CPU"]


def test_cupy_with_a_device_is_available(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(count=2))
    assert gpu.available() == (True, "2 CUDA devices (CuPy 13.9.9)")


# ---- setup with a stand-in device (no CUDA): reserved core, affinity restored ------------


def _two_cpus() -> bool:
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


@pytest.mark.skipif(not _two_cpus(), reason="needs sched_setaffinity and two CPUs")
def test_setup_reserves_a_core_and_close_gives_it_back(monkeypatch) -> None:
    monkeypatch.setattr(context, "available", lambda: (True, "1 CUDA device"))
    monkeypatch.setattr(cuda, "CudaOps", FakeCudaOps)
    before = os.sched_getaffinity(0)
    ctx = gpu.setup(True, None, None)
    try:
        split = affinity.split_affinity(before, None, True, affinity.cpu_siblings(before))
        assert ctx.enabled and ctx.split == split and ctx.threads == split.threads < len(before)
        assert os.sched_getaffinity(0) == set(split.compute)  # the main thread left the reserved CPU
        assert os.sched_getaffinity(ctx.device.thread.native_id) == {split.gpu}
        lines = ctx.take_messages()
        assert lines[0].startswith("dsv4: --gpu: Fake GPU (sm_90, 8.0 GB, 6.0 GB free); VRAM budget")
        assert any("GPU thread on CPU" in line for line in lines)
        ctx.reserve_core(False)
        assert os.sched_getaffinity(0) == before and os.sched_getaffinity(ctx.device.thread.native_id) >= before
        ctx.reserve_core(True)
        assert os.sched_getaffinity(0) == set(split.compute)
        assert os.sched_getaffinity(ctx.device.thread.native_id) == {split.gpu}
    finally:
        ctx.close()
    assert os.sched_getaffinity(0) == before


def test_setup_with_explicit_threads_pins_nothing(monkeypatch) -> None:
    monkeypatch.setattr(context, "available", lambda: (True, "1 CUDA device"))
    monkeypatch.setattr(cuda, "CudaOps", FakeCudaOps)
    before = os.sched_getaffinity(0)
    with gpu.setup(True, 2.0, 1) as ctx:
        assert ctx.enabled and ctx.threads == 1 and ctx.split.gpu is None
        assert ctx.vram_budget == 2 * 10**9
        assert os.sched_getaffinity(0) == before
        assert any("--threads 1 given" in line for line in ctx.take_messages())


def test_setup_falls_back_when_the_device_fails(monkeypatch) -> None:
    def broken(fused: str = "auto"):
        raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure\nmore")

    monkeypatch.setattr(context, "available", lambda: (True, "1 CUDA device"))
    monkeypatch.setattr(cuda, "CudaOps", broken)
    before = os.sched_getaffinity(0)
    ctx = gpu.setup(True, None, None)
    assert not ctx.enabled and ctx.threads is None and os.sched_getaffinity(0) == before
    line = "dsv4: --gpu: the CUDA device is not usable (RuntimeError: cudaErrorLaunchFailure: unspecified launch"
    assert ctx.take_messages() == [line + " failure); running on the CPU"]


# ---- the affinity split (pure) ---------------------------------------------------------


def test_split_without_gpu_uses_every_cpu() -> None:
    s = gpu.split_affinity(range(8), None, False)
    assert s == gpu.AffinitySplit(tuple(range(8)), None, 8, "")
    assert gpu.split_affinity(range(8), 3, False).threads == 3


def test_split_reserves_the_highest_cpu() -> None:
    s = gpu.split_affinity([3, 1, 2, 0], None, True)
    assert (s.compute, s.gpu, s.threads) == ((0, 1, 2), 3, 3)
    assert s.note == "CPU kernels on 3 threads (CPUs 0-2), GPU thread on CPU 3"


def test_split_leaves_the_smt_sibling_idle() -> None:
    sib = {c: ((c + 4) % 8,) for c in range(8)}  # 4 cores x 2 threads, siblings c and c+4
    s = gpu.split_affinity(range(8), None, True, sib)
    assert (s.compute, s.gpu, s.threads) == ((0, 1, 2, 4, 5, 6), 7, 6)
    assert s.note.endswith("GPU thread on CPU 7, its SMT sibling idle")
    two = gpu.split_affinity([0, 1], None, True, {0: (1,), 1: (0,)})  # one core: keep the sibling working
    assert (two.compute, two.gpu, two.threads) == ((0,), 1, 1)


def test_split_respects_explicit_threads_and_one_cpu() -> None:
    s = gpu.split_affinity(range(4), 4, True)
    assert (s.compute, s.gpu, s.threads) == ((0, 1, 2, 3), None, 4) and "--threads 4 given" in s.note
    one = gpu.split_affinity([5], None, True)
    assert (one.compute, one.gpu, one.threads) == ((5,), None, 1)
    with pytest.raises(ValueError):
        gpu.split_affinity([], None, True)
    with pytest.raises(ValueError):
        gpu.split_affinity(range(4), 0, True)


def test_cpu_lists_and_sysfs_siblings(tmp_path: Path) -> None:
    assert affinity.parse_cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    for c, text in ((0, "0,2"), (2, "0,2"), (1, "1")):
        d = tmp_path / f"cpu{c}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    assert affinity.cpu_siblings([0, 1, 2, 3], str(tmp_path)) == {0: (2,), 2: (0,), 1: ()}
    assert affinity._ranges((0, 1, 2, 5, 7, 8)) == "CPUs 0-2,5,7-8"


@pytest.mark.skipif(not _two_cpus(), reason="needs sched_setaffinity and two CPUs")
def test_device_thread_pins_itself_and_others_move() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    t = gpu.DeviceThread(cpu=cpus[-1])
    before = os.sched_getaffinity(0)
    try:
        assert t.pin_error is None and os.sched_getaffinity(t.native_id) == {cpus[-1]}
        masks = affinity.move_threads(cpus[:-1], exclude={t.native_id})
        assert os.sched_getaffinity(0) == set(cpus[:-1])
        assert os.sched_getaffinity(t.native_id) == {cpus[-1]}
        affinity.restore_threads(masks)
        assert os.sched_getaffinity(0) == before
    finally:
        t.close()


# ---- the VRAM planner (pure) -----------------------------------------------------------


def _m(layer, path, kind, rows, cols) -> plan.Matrix:
    per = {"fp8": 1, "bf16": 2, "f32": 4}[kind]
    scale = 4 * -(-rows // 128) * -(-cols // 128) if kind == "fp8" else 0
    host = rows * cols * per + (scale // 4 if kind == "fp8" else 0)
    return plan.Matrix((layer, path), kind, rows, cols, host, plan.device_bytes_of(kind, rows, cols))


def flash_like(n_layers: int = 43) -> list[plan.Matrix]:
    out = []
    for i in range(n_layers):
        out += [
            _m(i, "attn.wq_a", "fp8", 1024, 4096),
            _m(i, "attn.wq_b", "fp8", 32768, 1024),
            _m(i, "attn.wkv", "fp8", 512, 4096),
            *[_m(i, f"attn.wo_a.{g}", "fp8", 1024, 4096) for g in range(8)],
            _m(i, "attn.wo_b", "fp8", 4096, 8192),
            _m(i, "moe.shared.w1", "fp8", 2048, 4096),
            _m(i, "moe.shared.w2", "fp8", 4096, 2048),
            _m(i, "moe.shared.w3", "fp8", 2048, 4096),
            _m(i, "attn.compressor.wkv", "bf16", 1024, 4096),
            _m(i, "moe.gate", "bf16", 256, 4096),
            _m(i, "hc_attn.fn", "f32", 24, 16384),
        ]
    return [*out, _m(None, "head", "bf16", 129280, 4096)]


def test_plan_orders_fp8_then_bf16_then_f32_larger_first() -> None:
    mats = [
        _m(0, "small_fp8", "fp8", 1024, 2048),
        _m(0, "big_bf16", "bf16", 4096, 4096),
        _m(0, "big_fp8", "fp8", 8192, 8192),
        _m(0, "f32", "f32", 512, 1024),
    ]
    everything = sum(m.device_bytes for m in mats)
    p = gpu.plan_placement(mats, everything, min_bytes=0)
    assert p.count == 4 and p.device_bytes == everything and p.host_bytes_left == 0
    fp8_only = mats[2].device_bytes + mats[0].device_bytes
    assert gpu.plan_placement(mats, fp8_only, 0).on_device == {(0, "big_fp8"), (0, "small_fp8")}
    # the big FP8 does not fit: the smaller ones still fill the budget, in order of benefit
    p = gpu.plan_placement(mats, mats[1].device_bytes + mats[0].device_bytes, 0)
    assert p.on_device == {(0, "small_fp8"), (0, "big_bf16")}
    assert gpu.plan_placement(mats, everything, min_bytes=3 * MIB).on_device == {(0, "big_fp8"), (0, "big_bf16")}
    assert gpu.plan_placement(mats, 0, 0).count == 0


def test_plan_for_flash_sizes_puts_the_head_last() -> None:
    mats = flash_like()
    fp8 = sum(m.device_bytes for m in mats if m.kind == "fp8")
    head = next(m for m in mats if m.key == (None, "head"))
    p = gpu.plan_placement(mats, fp8 + head.device_bytes - 1)
    assert all(m.key in p.on_device for m in mats if m.kind == "fp8")
    assert (None, "head") not in p.on_device and "head on the CPU" in p.summary()
    assert all(m.key in p.on_device for m in mats if m.kind == "bf16" and m.key[1] == "attn.compressor.wkv")
    p = gpu.plan_placement(mats, 10**12)
    assert (None, "head") in p.on_device and "head in VRAM" in p.summary()
    assert not any(m.key in p.on_device for m in mats if m.host_bytes < plan.MIN_BYTES)  # hc fn stays
    assert p == gpu.plan_placement(list(reversed(mats)), 10**12)  # deterministic whatever the order


def test_fp4_never_goes_and_device_bytes() -> None:
    fp4 = QWeight("fp4", np.zeros((256, 64), np.uint8), np.zeros((256, 4), np.uint8), 256, 128)
    assert plan.matrix_of((0, "x"), fp4) is None
    assert plan.device_bytes_of("fp8", 300, 256) == 300 * 256 + 4 * 3 * 2
    assert plan.device_bytes_of("bf16", 3, 5) == 30
    with pytest.raises(ValueError):
        plan.device_bytes_of("fp4", 1, 32)


def test_vram_budget() -> None:
    gib = 1 << 30
    budget, note = gpu.vram_budget(20 * gib, 24 * gib, None)
    assert budget == 20 * gib - int(24 * gib) // 20 - plan.WORKSPACE and note == ""
    assert gpu.vram_budget(4 * gib, 8 * gib, None)[0] == 4 * gib - 512 * MIB - plan.WORKSPACE
    assert gpu.vram_budget(20 * gib, 24 * gib, 8.0) == (8 * 10**9, "")
    budget, note = gpu.vram_budget(6 * gib, 24 * gib, 100.0)
    assert budget == 6 * gib - plan.WORKSPACE and note.startswith("--vram 100 is more than")
    assert gpu.vram_budget(100 * MIB, 1 * gib, None)[0] == 0
    with pytest.raises(ValueError):
        gpu.vram_budget(gib, gib, -1.0)


# ---- the boundary on the numpy stand-in device -----------------------------------------


@pytest.fixture(scope="module")
def dev():
    d = gpu.host_device()
    yield d
    d.close()


def _weights(rng: np.random.Generator) -> list[QWeight]:
    w = rng.standard_normal((300, 256), dtype=np.float32) * 0.05
    out = []
    for fmt in ("ue8m0", "float"):
        q, s = formats.quantize_fp8(w, fmt)
        out.append(QWeight("fp8", q.view(np.uint8), s.view(np.uint8) if s.dtype != np.float32 else s, 300, 256))
    out.append(QWeight("bf16", formats.f32_to_bf16(w), None, 300, 256))
    out.append(QWeight("f32", w, None, 300, 256))
    return out


def test_device_weights_match_the_cpu_reference(dev) -> None:
    rng = np.random.default_rng(1)
    for w in _weights(rng):
        dw = dev.upload(w)
        assert isinstance(dw, DeviceQWeight) and dw.on_device and (dw.rows, dw.cols) == (w.rows, w.cols)
        assert dw.scale is None or dw.scale.dtype == np.float32
        np.testing.assert_array_equal(dw.dense(), kernels.dense(w))
        for t in (1, 5):
            x = rng.standard_normal((t, w.cols), dtype=np.float32)
            assert cuda.relative_error(dw.matmul(x), kernels.matmul(w, x)) <= 1e-5
        x = rng.standard_normal(w.cols, dtype=np.float32)
        assert dw.matvec(x).shape == (w.rows,)
        assert cuda.relative_error(dw.matvec(x), kernels.matvec(w, x)) <= 1e-5


def test_cpu_weights_still_go_to_the_cpu_backend(dev) -> None:
    w = _weights(np.random.default_rng(2))[0]
    x = np.random.default_rng(3).standard_normal((3, w.cols), dtype=np.float32)
    calls = dev.stats.calls
    got = kernels.matmul(w, x)  # the CPU backend in use (numba when it loads), not the device
    assert cuda.relative_error(got, kernels.reference.matmul(w, x)) <= 1e-5
    assert dev.stats.calls == calls


def test_kernels_dispatch_device_weights_to_their_device(dev) -> None:
    w = _weights(np.random.default_rng(4))[0]
    dw = dev.upload(w)
    x = np.random.default_rng(5).standard_normal((2, w.cols), dtype=np.float32)
    calls = dev.stats.calls
    assert cuda.relative_error(kernels.matmul(dw, x), kernels.matmul(w, x)) <= 1e-5
    assert cuda.relative_error(kernels.matvec(dw, x[0]), kernels.matvec(w, x[0])) <= 1e-5
    assert dev.stats.calls == calls + 2


def test_device_thread_reraises_and_serves_nested_calls(dev) -> None:
    dw = dev.upload(_weights(np.random.default_rng(6))[0])
    with pytest.raises(ValueError, match="does not fit weight"):
        dw.matmul(np.zeros((1, 7), np.float32))
    assert dev.thread.call(lambda: dev.thread.call(threading.get_native_id)) == dev.thread.native_id
    with pytest.raises(ValueError, match="cannot go to the device"):
        dev.upload(QWeight("fp4", np.zeros((4, 16), np.uint8), np.zeros((4, 1), np.uint8), 4, 32))


def test_integer_e4m3_decode_of_the_kernel_is_exact() -> None:
    b = np.arange(256, dtype=np.uint8)
    got, ref = cuda.e4m3_soft_numpy(b), formats.e4m3_to_f32(b)
    np.testing.assert_array_equal(got, ref)  # NaN at 0x7F / 0xFF compare equal here
    finite = ~np.isnan(ref)
    assert np.array_equal(np.signbit(got[finite]), np.signbit(ref[finite]))
    src = cuda.kernel_source(True)
    assert "#define DSV4_HW_FP8 1" in src and "cvt.rn.f16x2.e4m3x2 %0, %1;" in src and "%%" not in src


# ---- trunk matrices placed on the stand-in device, through the Engine ---------------------


@pytest.fixture(scope="module")
def mixed():
    return Engine.open(FIXTURES / "mixed")


def test_candidates_come_from_the_catalog(mixed) -> None:
    cat = mixed.catalog
    mats = gpu.candidates(cat)
    keys = {m.key for m in mats}
    assert (None, "head") in keys and (0, "layers.0.attn.wq_b") in keys and (1, "layers.1.ffn.gate") in keys
    assert not any(".experts." in k[1] or k[1].startswith(f"layers.{cat.config.n_layers}") for k in keys)
    for m in mats:
        w = cat.entries[m.key[1] + ".weight"]
        assert (m.rows, m.cols) == w.shape and m.kind == {"F8_E4M3": "fp8", "BF16": "bf16", "F32": "f32"}[w.dtype]
        scale = cat.entries.get(m.key[1] + ".scale")
        assert m.host_bytes == w.nbytes + (scale.nbytes if m.kind == "fp8" else 0)


@pytest.mark.parametrize("budget", [10**12, 40_000])
def test_placed_trunk_gives_the_same_tokens(dev, mixed, budget: int) -> None:
    cat = mixed.catalog
    placed = gpu.place(cat, dev, budget, min_bytes=0)
    p = placed.placement
    assert 0 < p.count <= p.total and (p.count == p.total) == (budget == 10**12)
    assert set(placed.weights) == {k[1] for k in p.on_device} and not placed.kept_on_cpu
    assert all(isinstance(w, DeviceQWeight) for w in placed.weights.values())
    source = placed.source(cat)
    engine = Engine(cat.config, CatalogTrunk(source), CatalogExperts(cat), cat)
    ids = np.random.default_rng(7).integers(0, cat.config.vocab_size, 12)
    a = mixed.session(chunk_size=5).prefill(ids)
    b = engine.session(chunk_size=5).prefill(ids)
    assert source.served == set(placed.weights)  # every placed matrix came from the device
    assert cuda.relative_error(b, a) <= 1e-5
    assert np.array_equal(a.argmax(-1), b.argmax(-1))
    assert list(mixed.session().generate(ids[:4], 6)) == list(engine.session().generate(ids[:4], 6))
    for prefix, w in placed.weights.items():
        assert prefix + ".weight" in placed.tensor_names
        assert (prefix + ".scale" in placed.tensor_names) == (w.kind == "fp8")


def test_upload_stops_when_vram_runs_out(mixed) -> None:
    class Tight:
        def __init__(self) -> None:
            self.n = 0
            self.inner = gpu.host_device()

        def upload(self, w: QWeight):
            self.n += 1
            if self.n > 3:
                raise MemoryError("out of memory allocating")
            return self.inner.upload(w)

    d = Tight()
    try:
        placed = gpu.place(mixed.catalog, d, 10**12, min_bytes=0)
    finally:
        d.inner.close()
    assert len(placed.weights) == 3 and len(placed.kept_on_cpu) == placed.placement.count - 3
    assert not set(placed.weights) & set(placed.kept_on_cpu)


def test_placed_source_delegates_everything_else(mixed) -> None:
    cat = mixed.catalog
    src = gpu.PlacedSource(cat, {"head": "device head"})
    assert src.qweight("head") == "device head" and src.served == {"head"}
    assert src.qweight("layers.0.attn.wq_a").kind == cat.qweight("layers.0.attn.wq_a").kind
    assert src.config is cat.config and src.entries is cat.entries


# ---- --gpu through the budgeted runtime (stand-in device): same ids, smaller trunk ---------


@pytest.mark.parametrize("budget_mb", [1000, 1])
def test_runtime_with_gpu_gives_the_same_ids(monkeypatch, mixed, budget_mb: int) -> None:
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime
    from dsv4stream.streaming.layout import trunk_layout

    monkeypatch.setattr(context, "available", lambda: (True, "1 CUDA device"))
    monkeypatch.setattr(cuda, "CudaOps", FakeCudaOps)
    ids = [int(i) for i in np.random.default_rng(11).integers(0, mixed.cfg.vocab_size, 9)]
    cpu_opts = RunOptions(budget=10**9, io="buffered", trunk="")
    with Runtime.open(FIXTURES / "mixed", cpu_opts) as rt:
        want = list(rt.generate(rt.session(), ids, 6))
        full = rt.plan.needs.layer_bytes
    ctx = gpu.setup(True, None, None, min_bytes=0)
    try:
        ctx.vram_budget = budget_mb * 10**6  # 1 MB: only some matrices fit
        with Runtime.open(FIXTURES / "mixed", replace(cpu_opts, gpu=ctx)) as rt:
            got = list(rt.generate(rt.session(), ids, 6))
            placed = ctx.placed
            assert placed is not None and placed.weights
            # what went to VRAM is no longer read into (or budgeted for) the trunk's slots
            assert sum(rt.plan.needs.layer_bytes) < sum(full)
            assert rt.plan.needs.layer_bytes == trunk_layout(rt.cat, None, placed.tensor_names).layer_bytes
    finally:
        ctx.close()
    assert got == want
