"""A device that holds weights and multiplies them: the thread that drives it, the weight
type the kernels dispatch on, and the array-module-generic part of the arithmetic.

Owns: `DeviceThread` (the one thread that makes every device call), `Device` (a thread plus
the ops that run on it), `DeviceQWeight` (a `QWeight` whose arrays live on a device and
which multiplies itself there), `dequant_rows` / `dequant_gemm` (dequantise a block of
rows, then float32 GEMM; written for any numpy-compatible array module, so the numpy
stand-in `HostOps` runs the same code the CUDA backend runs for prefill chunks).

Why one dedicated thread rather than the main thread driving the GPU: the main thread runs
numpy and starts the numba pool, so pinning it to the reserved CPU would put CPU work (and
every thread it later creates) on that CPU. A dedicated thread can be pinned alone; the
main thread then sleeps on an Event (a futex, no spin) while the device works, and the
spinning in `cudaStreamSynchronize` happens on the reserved CPU only. CuPy's current device
and stream are per thread, so one thread for uploads, kernels and copies also removes a
class of cross-thread mistakes. The hand-off costs a few tens of microseconds per call;
bench/gpu_check.py measures it.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..checkpoint import formats
from ..errors import InternalError
from ..kernels import QWeight
from . import affinity

# Rows of a weight dequantised at once in the dequantise-then-GEMM path: bounds the float32
# scratch to about this many bytes (plus the array module's temporaries).
DEQUANT_BLOCK_BYTES = 32 << 20


class DeviceThread:
    """Runs submitted calls one at a time on its own thread, optionally pinned to one CPU."""

    def __init__(self, cpu: int | None = None, name: str = "dsv4-gpu") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self.cpu = cpu
        self.pin_error: str | None = None
        self.native_id: int | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        if self.cpu is not None:
            self.pin_error = affinity.pin_current_thread(self.cpu)
        self._ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job.run()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the device thread; its exception is re-raised here."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        if not self._thread.is_alive():
            raise RuntimeError("the GPU thread has stopped")
        job = _Job(fn, args)
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=10)


class _Job:
    __slots__ = ("args", "done", "error", "fn", "result")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn = fn
        self.args = args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001  re-raised in the caller's thread
            self.error = e
        finally:
            self.done.set()


@dataclass
class DeviceStats:
    calls: int = 0
    fused_calls: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0


class Device:
    """A device thread and the ops bound to it; DeviceQWeights call back into this."""

    def __init__(self, thread: DeviceThread, ops: Any, name: str) -> None:
        self.thread = thread
        self.ops = ops
        self.name = name

    def upload(self, w: QWeight) -> DeviceQWeight:
        kind, data, scale = self.thread.call(self.ops.upload, w)
        return DeviceQWeight(kind, data, scale, w.rows, w.cols, role=w.role, block=w.block, device=self)

    def matmul(self, w: DeviceQWeight, x: np.ndarray) -> np.ndarray:
        """X (T, C) float32 -> (T, R) float32, computed on the device."""
        return self.thread.call(self.ops.matmul, w, x)

    def dense(self, w: DeviceQWeight) -> np.ndarray:
        return self.thread.call(self.ops.dense, w)

    @property
    def stats(self) -> DeviceStats:
        return self.ops.stats

    def close(self) -> None:
        self.thread.close()


@dataclass(frozen=True)
class DeviceQWeight(QWeight):
    """A QWeight whose data (and float32 scale) live on a device.

    `kernels.matvec` / `matmul` see `on_device` and call the methods below instead of a CPU
    backend. FP8 scales are float32 here whatever the checkpoint stored (E8M0 widens exactly),
    one per `block` (128x128 in V4, 32x32 in V4.1) as on the host.
    """

    device: Device | None = field(default=None, compare=False, repr=False)
    on_device: ClassVar[bool] = True

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """x (C,) float32 -> (R,) float32."""
        return self.device.matmul(self, np.asarray(x, dtype=np.float32).reshape(1, -1))[0]

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """X (T, C) float32 -> (T, R) float32."""
        return self.device.matmul(self, x)

    def dense(self) -> np.ndarray:
        """The whole weight as float32 (R, C) on the host: tests only."""
        return self.device.dense(self)


# ---- array-module-generic arithmetic ---------------------------------------------------

E4M3_TABLE = formats.e4m3_to_f32(np.arange(256, dtype=np.uint8))  # (256,) float32, NaN at 0x7F/0xFF


def upload_arrays(xp, w: QWeight) -> tuple[str, Any, Any]:
    """(kind, data, scale) as device arrays: data contiguous, FP8 scale as float32."""
    if w.kind not in ("fp8", "bf16", "f32"):
        raise ValueError(f"a {w.kind} weight cannot go to the device")
    data = xp.asarray(np.ascontiguousarray(w.data))
    scale = None
    if w.kind == "fp8":
        scale = xp.asarray(np.ascontiguousarray(formats.scale_to_f32(w.scale)))
    return w.kind, data, scale


def row_unit(w: QWeight) -> int:
    """Row blocks dequantised at once start at multiples of this: 128, and of the FP8 scale block."""
    return math.lcm(128, w.block[0]) if w.kind == "fp8" else 128


def dequant_rows(xp, w: QWeight, r0: int, r1: int, lut) -> Any:
    """Rows r0:r1 of a device weight as float32 (r1 - r0, C); r0 is a multiple of the scale
    block's rows (`w.block`: 128x128 in V4, 32x32 in V4.1).

    Products of an E4M3 value and its scale are exact in float32 (for E8M0 scales), so
    this equals the CPU reference's dequantisation bit for bit.
    """
    if w.kind == "fp8":
        br, bc = w.block
        if r0 % br:
            raise InternalError(f"FP8 rows from {r0}: a row block starts at a multiple of {br}")
        s = w.scale[r0 // br : -(-r1 // br)]
        full = xp.repeat(xp.repeat(s, br, axis=0), bc, axis=1)[: r1 - r0, : w.cols]
        return xp.take(lut, w.data[r0:r1]) * full
    if w.kind == "bf16":
        return (w.data[r0:r1].astype(xp.uint32) << 16).view(xp.float32)
    return w.data[r0:r1]


def dequant_gemm(xp, w: QWeight, x, lut, block_bytes: int = DEQUANT_BLOCK_BYTES):
    """x (T, C) device float32 -> (T, R): dequantise row blocks, then float32 GEMM each."""
    t = x.shape[0]
    y = xp.empty((t, w.rows), dtype=xp.float32)
    unit = row_unit(w)
    step = max(unit, (block_bytes // (4 * w.cols)) // unit * unit)
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        y[:, r0:r1] = x @ dequant_rows(xp, w, r0, r1, lut).T
    return y


class HostOps:
    """The numpy stand-in for a device: same upload and dequantise-then-GEMM code, arrays in
    host memory. Used by tests, and to check the boundary where there is no GPU."""

    name = "numpy (host stand-in)"

    def __init__(self) -> None:
        self.stats = DeviceStats()
        self.lut = E4M3_TABLE

    def upload(self, w: QWeight) -> tuple[str, Any, Any]:
        kind, data, scale = upload_arrays(np, w)
        self.stats.h2d_bytes += data.nbytes + (0 if scale is None else scale.nbytes)
        return kind, data, scale

    def matmul(self, w: QWeight, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != w.cols:
            raise ValueError(f"activation shape {x.shape} does not fit weight ({w.rows}, {w.cols})")
        self.stats.calls += 1
        return dequant_gemm(np, w, x, self.lut)

    def dense(self, w: QWeight) -> np.ndarray:
        return dequant_rows(np, w, 0, w.rows, self.lut) if w.rows else np.zeros((0, w.cols), np.float32)


def host_device(cpu: int | None = None) -> Device:
    """A Device backed by HostOps on its own thread (tests; no GPU needed)."""
    return Device(DeviceThread(cpu), HostOps(), HostOps.name)
