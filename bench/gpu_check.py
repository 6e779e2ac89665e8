"""GPU check for `--gpu`: results against the CPU, and the figures that decide whether it pays.

Usage (on a machine with an NVIDIA GPU and CuPy; installs nothing, finishes in < 5 min):
    python bench/gpu_check.py [--quick] [--seconds 280] [--small] [--stand-in]
--small shrinks every size (a smoke run); --stand-in replaces the GPU by the numpy stand-in
device (the boundary, placement and end-to-end code paths run; no CUDA figures). Whatever
it cannot do, it prints and goes on; it exits 0 unless a correctness check failed (exit 1).

Sections, and what each timed window holds:
 1 setup: versions, device, the start-up self-test, the kernels kept, the reserved-core split.
 2 accuracy: Flash-shaped FP8 matrices (E8M0 and F32 scales) and the BF16 head at T = 1, 4,
   8, 64 on each device path (fused with hardware E4M3 decode, fused with integer decode,
   dequantise + cuBLAS): max |gpu - cpu| / max |cpu| against the numpy reference (pass <= 1e-5),
   and against a float64 product (how far each is from exact).
 3 bandwidth: device-to-device copy of 1 GiB (cudaMemcpyAsync; read + write bytes / time,
   CUDA events) = the device's copy bandwidth; each path's GEMV (weight bytes / kernel time,
   activations already on the device) and its ratio to the copy figure; a tokens sweep; the
   per-call cost through `kernels.matmul` (hand-off to the GPU thread, H2D, kernel, D2H,
   wall clock) against the CPU kernels on the same matrix, i.e. where the GPU starts to win.
 4 CPU FP4 kernel throughput on Flash expert matrices (32 of them, 2048x4096, ~134 MB, so
   caches do not hold them; matvec wall clock): GPU idle or busy (the GPU thread looping
   GEMVs and spinning in cudaStreamSynchronize) x all threads or one core reserved.
 5 end to end: a generated checkpoint with Flash-sized attention, indexer, shared expert and
   head (preset flash-experts, 3 layers, 16 routed experts), in-memory providers; greedy
   decode on the CPU, then with the trunk placed in VRAM: token ids and per-step argmax must
   be identical; s/token = median decode step (the first step, which reads the experts from
   disk, excluded).
 6 DeepSeek-V4.1 end to end: a generated V4.1 checkpoint (preset demo-v41: FP8 with E8M0
   scales per 32x32 block, Engram, shared KV; --small: tiny-v41), the same comparison under
   both numerics (official: the FP8 activation grid before every FP8 matmul, applied on the
   host before the device multiplies; fp32). Section 2 also checks V4.1-Flash-shaped FP8
   matrices with 32x32 blocks on activations put on that grid.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4stream import gpu, kernels, synth
from dsv4stream.checkpoint import formats
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.engine.session import Engine
from dsv4stream.engine.stack_v41 import V41Options
from dsv4stream.gpu import affinity
from dsv4stream.gpu.cuda import relative_error
from dsv4stream.gpu.device import DeviceQWeight, dequant_gemm
from dsv4stream.kernels import QWeight, reference
from dsv4stream.model.v41.quant import fp8_qdq
from dsv4stream.weights.providers import CatalogExperts, CatalogTrunk

TOL = 1e-5
FAILED: list[str] = []


def say(*a) -> None:
    print(*a, flush=True)


class Clock:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.t0 = time.monotonic()

    def left(self) -> float:
        return self.end - time.monotonic()


def section(clock: Clock, title: str, need: float, fn, *args) -> None:
    say(f"\n== {title}  (t={time.monotonic() - clock.t0:.0f}s, {clock.left():.0f}s left)")
    if clock.left() < need:
        say(f"  skipped: needs ~{need:.0f}s")
        return
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001  a broken section must not hide the others
        say(f"  SECTION FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        say("  " + "  ".join(traceback.format_exc().splitlines(keepends=True)[-6:]))


# ---- helpers ---------------------------------------------------------------------------------


def fp8_weight(rng, rows: int, cols: int, scale_fmt: str, block: tuple[int, int] = (128, 128)) -> QWeight:
    data = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
    data[(data & 0x7F) == 0x7F] -= 1  # no NaN codes: a checkpoint has none
    shape = formats.fp8_scale_shape(rows, cols, block)
    if scale_fmt == "ue8m0":
        scale = rng.integers(118, 122, size=shape, dtype=np.uint8)  # 2^-9 .. 2^-6
    else:
        scale = rng.uniform(0.002, 0.01, size=shape).astype(np.float32)
    return QWeight("fp8", data, scale, rows, cols, block=block)


def bf16_weight(rng, rows: int, cols: int) -> QWeight:
    bits = np.empty((rows, cols), np.uint16)
    step = max(1, (64 << 20) // (4 * cols))
    for r in range(0, rows, step):
        block = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32) * np.float32(cols**-0.5)
        bits[r : r + block.shape[0]] = formats.f32_to_bf16(block)
    return QWeight("bf16", bits, None, rows, cols)


def fp4_weight(rng, rows: int, cols: int) -> QWeight:
    packed = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    scale = rng.integers(118, 122, size=(rows, cols // 32), dtype=np.uint8)
    return QWeight("fp4", packed, scale, rows, cols)


def install_dispatch_shim() -> bool:
    """Until kernels/__init__.py dispatches on QWeight.on_device, wrap its CPU backend."""
    if getattr(kernels.QWeight, "on_device", None) is False:
        return False

    class Shim:
        def __init__(self, inner) -> None:
            self.inner = inner
            self.__name__ = inner.__name__

        def matvec(self, w, x):
            return w.matvec(x) if getattr(w, "on_device", False) else self.inner.matvec(w, x)

        def matmul(self, w, x):
            return w.matmul(x) if getattr(w, "on_device", False) else self.inner.matmul(w, x)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    kernels._backend = Shim(kernels._backend)
    return True


def cpu_backend() -> str:
    try:
        kernels.set_backend("fast")
        from dsv4stream.kernels import fast  # noqa: F401 (raises where numba is missing)

        took = kernels.warmup()
        return f"fast (numba, warm-up {took:.1f}s)"
    except Exception as e:  # noqa: BLE001
        kernels.set_backend("reference")
        return f"reference (numpy; kernels.fast unusable: {type(e).__name__}: {str(e)[:100]})"


def wall(fn, reps: int) -> float:
    """Median wall seconds of fn() over reps calls (after one warm call)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ---- sections --------------------------------------------------------------------------------


class State:
    def __init__(self) -> None:
        self.ctx = None
        self.ops: dict = {}  # path label -> ops object on the GPU thread
        self.cp = None
        self.n_cpu = len(affinity.usable_cpus())


def s1_setup(st: State, args) -> None:
    import psutil

    v = psutil.virtual_memory()
    vm = f", RAM {v.total / 1e9:.0f} GB ({v.available / 1e9:.0f} available)"
    say(f"  python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")
    say(f"  CPUs usable {st.n_cpu} of {os.cpu_count()}, load {os.getloadavg()[0]:.2f}{vm}")
    say(f"  CPU kernels: {cpu_backend()}")
    if install_dispatch_shim():
        say("  NOTE: kernels/__init__.py does not dispatch on QWeight.on_device yet: a shim wraps its backend here")
    if args.stand_in:
        st.ctx = gpu.GpuContext(True, st.n_cpu, device=gpu.host_device(), vram_budget=10**12, min_bytes=0)
        st.ops["stand-in"] = st.ctx.device.ops
        say("  --stand-in: numpy stand-in device, no CUDA")
        return
    ok, reason = gpu.available()
    say(f"  gpu.available(): {ok}, {reason}")
    if not ok:
        return
    import cupy

    st.cp = cupy
    rt, dr = cupy.cuda.runtime.runtimeGetVersion(), cupy.cuda.runtime.driverGetVersion()
    say(
        f"  CuPy {cupy.__version__}, CUDA runtime {rt // 1000}.{rt % 1000 // 10}, driver API {dr // 1000}.{dr % 1000 // 10}"
    )
    t0 = time.perf_counter()
    st.ctx = gpu.setup(True, None, None)
    say(
        f"  gpu.setup: {time.perf_counter() - t0:.1f}s (CUDA context, NVRTC compile, self-tests), RSS +{st.ctx.host_bytes / 1e6:.0f} MB"
    )
    for line in st.ctx.take_messages():
        say("  " + line)
    if st.ctx.enabled:
        st.ops["auto"] = st.ctx.device.ops
    else:
        st.cp = None


def _variants(st: State) -> None:
    """One CudaOps per path, all on the GPU thread (they share its device)."""
    if st.cp is None or len(st.ops) > 1:
        return
    from dsv4stream.gpu.cuda import CudaOps

    call = st.ctx.device.thread.call
    cc = st.ctx.device.ops.cc
    for label, fused in (("fused-hw", "hw"), ("fused-int", "soft"), ("dequant+cuBLAS", "off")):
        if fused == "hw" and cc < 89:
            say(f"  {label}: not on sm_{cc} (needs sm_89+)")
            continue
        try:
            ops = call(CudaOps, fused)
        except Exception as e:  # noqa: BLE001
            say(f"  {label}: unusable ({type(e).__name__}: {str(e)[:120]})")
            continue
        if fused != "off" and not ops.kernels:
            say(f"  {label}: dropped by its self-test: {'; '.join(ops.notes)}")
            continue
        st.ops[label] = ops


def s2_accuracy(st: State, args) -> None:
    _variants(st)
    if not st.ops:
        say("  no device paths to check")
        return
    rng = np.random.default_rng(0)
    shapes = [
        ("attn.wq_b", 32768, 1024),
        ("attn.wo_b", 4096, 8192),
        ("shared.w1", 2048, 4096),
        ("indexer.wq_b", 8192, 1024),
    ]
    if args.quick:
        shapes = shapes[:2]
    if args.small:
        shapes = [("small", 384, 512)]
    tokens = (1, 4, 8, 64)
    call = st.ctx.device.thread.call
    up = next(iter(st.ops.values()))
    for name, rows, cols in shapes:
        x = rng.standard_normal((max(tokens), cols), dtype=np.float32)
        for fmt in ("ue8m0", "float"):
            w = fp8_weight(rng, rows, cols, fmt)
            _check_paths(st, call, up, f"FP8 {name} ({rows}x{cols}, {fmt} scales)", w, x, tokens)
    # V4.1-Flash: 32x32 scale blocks, inputs on the FP8 activation grid (per 32, UE8M0 scales)
    v41 = [("v41 attn.wq_b", 32768, 1280), ("v41 attn.wo_a", 8192, 4096), ("v41 engram.wkv", 25600, 6144)]
    if args.quick:
        v41 = v41[:1]
    if args.small:
        v41 = [("v41 small", 416, 320)]
    for name, rows, cols in v41:
        x = fp8_qdq(rng.standard_normal((max(tokens), cols), dtype=np.float32), 32)
        w = fp8_weight(rng, rows, cols, "ue8m0", (32, 32))
        _check_paths(st, call, up, f"FP8 {name} ({rows}x{cols}, 32x32 blocks, QDQ'd input)", w, x, tokens)
    if not args.quick:
        rows = 1024 if args.small else 129280
        w = bf16_weight(rng, rows, 4096)
        x = rng.standard_normal((8, 4096), dtype=np.float32)
        _check_paths(st, call, up, f"BF16 head ({rows}x4096)", w, x, (1, 8), exact=False)


def _check_paths(st, call, up, label: str, w: QWeight, x: np.ndarray, tokens, exact: bool = True) -> None:
    dense = reference.dequant(w)
    refs = {t: x[:t] @ dense.T for t in tokens}
    ex = {}
    if exact:
        d64 = dense.astype(np.float64)
        ex = {t: x[:t].astype(np.float64) @ d64.T for t in tokens if t <= 8}
        del d64
    del dense
    dw = DeviceQWeight(*call(up.upload, w), w.rows, w.cols, block=w.block, device=st.ctx.device)
    cpu_ex = max((relative_error(refs[t], ex[t]) for t in ex), default=None)
    say(f"  {label}: CPU float32 vs float64 " + ("-" if cpu_ex is None else f"{cpu_ex:.1e}"))
    for path, ops in st.ops.items():
        worst, worst_ex = 0.0, 0.0
        for t in tokens:
            y = call(ops.matmul, dw, x[:t])
            worst = max(worst, relative_error(y, refs[t]))
            if t in ex:
                worst_ex = max(worst_ex, relative_error(y, ex[t]))
        ok = worst <= TOL
        if not ok:
            FAILED.append(f"{label} {path}")
        vs64 = f"{worst_ex:.1e}" if ex else "-"
        say(f"    {path:15s} vs CPU {worst:.1e}  vs float64 {vs64}  {'PASS' if ok else 'FAIL'}")


def s3_bandwidth(st: State, args) -> None:
    if st.cp is None:
        say("  no CUDA device: skipped")
        return
    _variants(st)
    call = st.ctx.device.thread.call
    cp = st.cp
    n = (64 if args.small else 1024) << 20

    def copy_rate() -> float:
        src, dst = cp.empty(n, cp.uint8), cp.empty(n, cp.uint8)
        src.fill(1)
        s = cp.cuda.get_current_stream()
        return _events(cp, lambda: dst.data.copy_from_device_async(src.data, n, s), 10) ** -1 * 2 * n

    copy = call(copy_rate)
    say(f"  device copy: {copy / 1e9:.0f} GB/s (read + write, {n >> 20} MiB)")
    rng = np.random.default_rng(1)
    mats = [
        ("attn.wq_b FP8", fp8_weight(rng, 32768, 1024, "ue8m0")),
        ("attn.wo_b FP8", fp8_weight(rng, 4096, 8192, "ue8m0")),
        ("shared.w1 FP8", fp8_weight(rng, 2048, 4096, "ue8m0")),
        ("16384^2 FP8", fp8_weight(rng, 16384, 16384, "ue8m0")),
        ("head BF16", bf16_weight(rng, 129280, 4096)),
    ]
    if args.quick:
        mats = mats[1:2] + mats[3:]
    if args.small:
        mats = [("small FP8", fp8_weight(rng, 1024, 1024, "ue8m0")), ("small BF16", bf16_weight(rng, 1024, 1024))]
    up = next(iter(st.ops.values()))
    for label, w in mats:
        dw = DeviceQWeight(*call(up.upload, w), w.rows, w.cols)
        nbytes = dw.data.nbytes + (0 if dw.scale is None else dw.scale.nbytes)
        parts = []
        for path, ops in st.ops.items():

            def one(ops=ops, dw=dw) -> float:
                xd = cp.asarray(rng.standard_normal((1, dw.cols), dtype=np.float32))
                return _events(cp, lambda: ops.compute(dw, xd), 20)

            sec = call(one)
            parts.append(f"{path} {nbytes / sec / 1e9:.0f} GB/s ({nbytes / sec / copy:.0%}, {sec * 1e6:.0f} us)")
        say(f"  GEMV {label} {nbytes / 1e6:.0f} MB: " + "; ".join(parts))
        del dw
    _token_sweep(st, call, cp, rng, args)
    _call_cost(st, call, rng, args)


def _events(cp, fn, reps: int) -> float:
    """Seconds per fn() on the current stream, timed with CUDA events after one warm call."""
    fn()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / 1e3 / reps


def _token_sweep(st, call, cp, rng, args) -> None:
    w = fp8_weight(rng, 1024 if args.small else 4096, 1024 if args.small else 8192, "ue8m0")
    fused = st.ops.get("fused-hw") or st.ops.get("fused-int")
    if fused is None:
        say("  tokens sweep: no fused kernel")
        return
    dw = DeviceQWeight(*call(fused.upload, w), w.rows, w.cols)
    cells = []
    for t in (1, 2, 4, 8, 16, 32, 64):

        def one(t=t) -> tuple[float, float]:
            xd = cp.asarray(rng.standard_normal((t, w.cols), dtype=np.float32))
            return _events(cp, lambda: fused._fused(dw, xd), 10), _events(
                cp, lambda: dequant_gemm(cp, dw, xd, fused.lut), 5
            )

        f, d = call(one)
        cells.append(f"T={t}: {f * 1e6:.0f}/{d * 1e6:.0f}")
    say(f"  tokens sweep (wo_b-sized FP8, fused/dequant+cuBLAS us): {', '.join(cells)}  [fused used for T <= 8]")


def _call_cost(st, call, rng, args) -> None:
    for label, w in (
        ("gate 256x4096 BF16", bf16_weight(rng, 256, 4096)),
        ("wq_a 1024x4096 FP8", fp8_weight(rng, 1024, 4096, "ue8m0")),
        ("shared.w1 2048x4096 FP8", fp8_weight(rng, 2048, 4096, "ue8m0")),
        ("wo_b 4096x8192 FP8", fp8_weight(rng, 4096, 8192, "ue8m0")),
    ):
        dw = st.ctx.device.upload(w)
        x = rng.standard_normal((1, w.cols), dtype=np.float32)
        boundary = wall(lambda dw=dw, x=x: kernels.matmul(dw, x), 200)
        inside = call(lambda dw=dw, x=x: wall(lambda: st.ctx.device.ops.matmul(dw, x), 200))
        cpu = wall(lambda w=w, x=x: kernels.matmul(w, x), 50)
        say(
            f"  per call {label} ({w.nbytes / 1e6:.1f} MB): through kernels.matmul {boundary * 1e6:.0f} us"
            f" (hand-off {max(0.0, boundary - inside) * 1e6:.0f} us), CPU kernels {cpu * 1e6:.0f} us"
            f" [{'GPU' if boundary < cpu else 'CPU'} faster]"
        )


def s4_fp4(st: State, args) -> None:
    rng = np.random.default_rng(2)
    n = 4 if args.small else 32
    ws = [fp4_weight(rng, 2048, 4096) for _ in range(n)]
    x = rng.standard_normal(4096, dtype=np.float32)
    nbytes = sum(w.nbytes for w in ws)
    secs = 0.5 if args.small else 1.5

    def rate() -> float:
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < secs:
            for w in ws:
                kernels.matvec(w, x)
            done += 1
        return done * nbytes / (time.perf_counter() - t0)

    ctx = st.ctx if (st.ctx is not None and st.cp is not None) else None
    full, reserved = st.n_cpu, max(1, st.n_cpu - 1)
    say(f"  FP4 matvec over {n} matrices 2048x4096 ({nbytes / 1e6:.0f} MB), backend {kernels.backend_name()}")
    rows = []
    for busy in (False, True) if ctx else (False,):
        for keep in (False, True):
            if ctx is not None:
                ctx.reserve_core(keep)
            else:
                masks = affinity.move_threads(affinity.usable_cpus()[:-1]) if keep and st.n_cpu > 1 else {}
            kernels.set_threads(reserved if keep else full)
            stop, launches = threading.Event(), [0]
            loop = None
            if busy:
                loop = threading.Thread(target=ctx.device.thread.call, args=(_busy_gpu, st, stop, launches))
                loop.start()
                time.sleep(0.2)
            r = rate()
            if loop is not None:
                stop.set()
                loop.join()
            if ctx is None and masks:
                affinity.restore_threads(masks)
            gpu_note = f", GPU {launches[0] / secs:.0f} GEMV/s" if busy else ""
            rows.append((busy, keep, r))
            say(
                f"    GPU {'busy' if busy else 'idle'}, {'one core reserved' if keep else 'all cores'}"
                f" ({reserved if keep else full} kernel threads): {r / 1e9:.2f} GB/s{gpu_note}"
            )
    if ctx is not None:
        ctx.reserve_core(True)
        base = rows[0][2]
        say("    relative to idle/all cores: " + ", ".join(f"{r / base:.2f}" for _, _, r in rows))


def _busy_gpu(st, stop: threading.Event, launches: list) -> None:
    """(GPU thread) queue 20 GEMVs on a 32 MB FP8 matrix, synchronise (spinning), repeat."""
    cp, ops = st.cp, st.ctx.device.ops
    w = fp8_weight(np.random.default_rng(3), 4096, 8192, "ue8m0")
    dw = DeviceQWeight(*ops.upload(w), w.rows, w.cols)
    xd = cp.ones((1, w.cols), cp.float32)
    with ops.stream:
        while not stop.is_set():
            for _ in range(20):
                ops.compute(dw, xd)
            ops.stream.synchronize()
            launches[0] += 20


def s5_end_to_end(st: State, args, clock: Clock) -> None:
    if st.ctx is None or not st.ctx.enabled:
        say("  no device: skipped")
        return
    # V4-Flash's attention, indexer, shared expert and head shapes; 3 layers, 16 routed experts
    over = {
        "num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0], "num_attention_heads": 64, "head_dim": 512,
        "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
        "n_routed_experts": 16, "tokenizer": False,
    }  # fmt: skip
    if args.small:
        over.update(num_attention_heads=8, head_dim=128, hidden_size=1024, vocab_size=8192, moe_intermediate_size=512)
    with tempfile.TemporaryDirectory(prefix="dsv4-gpucheck-") as tmp:
        t0 = time.perf_counter()
        path = synth.make_checkpoint(Path(tmp) / "ckpt", "flash-experts", seed=0, **over)
        size = sum(f.stat().st_size for f in path.iterdir())
        say(f"  generated {size / 1e9:.2f} GB checkpoint in {time.perf_counter() - t0:.0f}s ({over})")
        _cpu_vs_gpu(st, Catalog.open(path), 4 if clock.left() < 90 else 8, "end-to-end")


def s6_v41(st: State, args, clock: Clock) -> None:
    if st.ctx is None or not st.ctx.enabled:
        say("  no device: skipped")
        return
    preset = "tiny-v41" if args.small else "demo-v41"
    with tempfile.TemporaryDirectory(prefix="dsv4-gpucheck-v41-") as tmp:
        t0 = time.perf_counter()
        path = synth.make_checkpoint(Path(tmp) / "ckpt", preset, seed=0)
        size = sum(f.stat().st_size for f in path.iterdir())
        say(f"  generated {size / 1e9:.2f} GB V4.1 checkpoint (preset {preset}) in {time.perf_counter() - t0:.0f}s")
        cat = Catalog.open(path)
        placed = None
        for numerics in ("official", "fp32"):
            placed = _cpu_vs_gpu(
                st, cat, 4 if clock.left() < 60 else 8, f"V4.1 {numerics}", V41Options(numerics), placed
            )


def _cpu_vs_gpu(st: State, cat, steps: int, label: str, v41: V41Options | None = None, placed=None):
    """Greedy decode on the CPU, then with the trunk in VRAM (placed once per checkpoint): ids,
    per-step argmax and logits compared; s/token of each."""
    cfg = cat.config
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, 16)
    if st.cp is not None:
        st.ctx.reserve_core(False)
    kernels.set_threads(st.n_cpu)
    cpu = _decode(Engine(cfg, CatalogTrunk(cat), CatalogExperts(cat), cat, v41=v41), ids, steps)
    say(
        f"  {label}: CPU ({st.n_cpu} threads): {cpu['s_token']:.3f} s/token (prefill of {len(ids)} tokens,"
        f" first reads included, {cpu['prefill']:.2f}s)"
    )
    if st.cp is not None:
        st.ctx.reserve_core(True)
    kernels.set_threads(st.ctx.threads or st.n_cpu)
    if placed is None:
        t0 = time.perf_counter()
        placed = st.ctx.place(cat)
        say(f"  placed in {time.perf_counter() - t0:.1f}s: " + " ".join(st.ctx.take_messages()))
    eng = Engine(cfg, CatalogTrunk(placed.source(cat)), CatalogExperts(cat), cat, v41=v41)
    dev = _decode(eng, ids, steps)
    say(
        f"  {label}: --gpu ({st.ctx.threads} CPU threads): {dev['s_token']:.3f} s/token (prefill {dev['prefill']:.2f}s);"
        f" speed-up {cpu['s_token'] / dev['s_token']:.2f}x; {st.ctx.stats_line()}"
    )
    same_ids = cpu["ids"] == dev["ids"]
    same_arg = cpu["argmax"] == dev["argmax"]
    worst = max(relative_error(a, b) for a, b in zip(dev["logits"], cpu["logits"], strict=True))
    say(f"  ids identical: {same_ids}; per-step argmax identical: {same_arg}; logits max rel diff {worst:.1e}")
    say(f"  ids CPU {cpu['ids']}\n  ids GPU {dev['ids']}")
    if not (same_ids and same_arg):
        FAILED.append(f"{label} ids/argmax")
    return placed


def _decode(engine: Engine, ids: np.ndarray, steps: int) -> dict:
    s = engine.session(chunk_size=64)
    t0 = time.perf_counter()
    logits = s.prefill(ids, last_only=True)
    prefill = time.perf_counter() - t0
    out, arg, all_logits, times = [], [], [logits], []
    for _ in range(steps):
        tok = int(np.argmax(logits))
        out.append(tok)
        arg.append(tok)
        t0 = time.perf_counter()
        logits = s.step(tok)
        times.append(time.perf_counter() - t0)
        all_logits.append(logits)
    arg.append(int(np.argmax(logits)))
    s_token = statistics.median(times[1:] or times)
    return {"ids": out, "argmax": arg, "logits": all_logits, "prefill": prefill, "s_token": s_token}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and no BF16 head accuracy check")
    ap.add_argument("--small", action="store_true", help="small sizes everywhere (a smoke run)")
    ap.add_argument("--stand-in", action="store_true", help="numpy stand-in device instead of CUDA")
    ap.add_argument("--seconds", type=float, default=280.0, help="stop starting sections after this")
    args = ap.parse_args()
    clock = Clock(args.seconds)
    st = State()
    say("dsv4stream GPU check (bench/gpu_check.py)")
    section(clock, "1 setup", 0, s1_setup, st, args)
    section(clock, "2 accuracy: device vs CPU reference", 40, s2_accuracy, st, args)
    section(clock, "3 bandwidth and call cost", 30, s3_bandwidth, st, args)
    section(clock, "4 CPU FP4 throughput, busy GPU, reserved core", 15, s4_fp4, st, args)
    section(clock, "5 end to end: CPU vs --gpu", 60, s5_end_to_end, st, args, clock)
    if st.ctx is not None and st.ctx.enabled:
        st.ctx.placed = None  # section 5's checkpoint is gone; its matrices are dropped with it
    section(clock, "6 DeepSeek-V4.1 end to end: CPU vs --gpu", 40, s6_v41, st, args, clock)
    if st.ctx is not None:
        st.ctx.close()
    say(f"\n== done in {time.monotonic() - clock.t0:.0f}s; " + (f"FAILED: {FAILED}" if FAILED else "all checks passed"))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
