"""What `--gpu` sets up, and the one-line fallback when it cannot.

Owns: `available()` (imports CuPy, so only called when `--gpu` was asked for), `setup()`
(device thread, CUDA ops, self-test, VRAM budget, reserved core) and the `GpuContext` the
CLI keeps for the run: the thread count for the CPU kernels, `place()` for the trunk, the
lines to print, and `close()`, which gives the CPU affinity back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Self

from . import affinity
from .affinity import AffinitySplit
from .device import Device, DeviceThread
from .plan import MIN_BYTES, vram_budget
from .trunk import Placed, place

INSTALL_HINT = "pip install 'dsv4stream[gpu]'; it needs an NVIDIA driver for CUDA 12.x"
# cudaError_t values CuPy reports in CUDARuntimeError.status
_CUDA_ERRORS = {
    34: "the CUDA driver library found is a stub (install the NVIDIA driver)",
    35: "the NVIDIA driver is missing or older than CUDA 12.x (install or update the driver)",
    100: "no CUDA device found",
}


def available() -> tuple[bool, str]:
    """(True, what was found) or (False, why not, in a few words). Imports CuPy."""
    try:
        import cupy  # only when --gpu is asked for
    except ModuleNotFoundError as e:
        if (e.name or "cupy").split(".")[0] in ("cupy", "cupyx", "cupy_backends"):
            return False, f"CuPy is not installed ({INSTALL_HINT})"
        return False, f"CuPy failed to import ({_first_line(e)})"
    except Exception as e:  # noqa: BLE001  a broken CuPy install must not stop a CPU run
        return False, f"CuPy failed to import ({_first_line(e)})"
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001
        status = getattr(e, "status", None)
        return False, _CUDA_ERRORS.get(status, f"CUDA is not usable ({_first_line(e)})")
    if n < 1:
        return False, _CUDA_ERRORS[100]
    return True, f"{n} CUDA device{'s' if n > 1 else ''} (CuPy {getattr(cupy, '__version__', '?')})"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__


def fallback_line(reason: str) -> str:
    return f"dsv4: --gpu: {reason}; running on the CPU"


@dataclass
class GpuContext:
    """The outcome of `setup`: enabled or not, and what the run must use."""

    enabled: bool
    threads: int | None  # CPU kernel threads: pass to Engine.open(threads=...) (None: its default)
    split: AffinitySplit | None = None
    device: Device | None = None
    vram_budget: int = 0
    min_bytes: int = MIN_BYTES
    placed: Placed | None = None
    host_bytes: int = 0  # RSS that setup added (CUDA context, CuPy, cuBLAS); pinned buffers come on top
    messages: list[str] = field(default_factory=list)
    _masks: Mapping[int, frozenset[int]] = field(default_factory=dict, repr=False)
    _gpu_tids: frozenset[int] = field(default_factory=frozenset, repr=False)  # GPU thread + CUDA's own

    def take_messages(self) -> list[str]:
        """Lines to print (to stderr) since the last call."""
        out, self.messages = self.messages, []
        return out

    def place(self, cat) -> Placed | None:
        """Choose and upload the trunk matrices that go to VRAM (None when not enabled).

        Build the trunk's weights from `placed.source(cat)` (or leave `placed.tensor_names`
        out of a streamed trunk's groups and wrap its views with `placed.source`)."""
        if not self.enabled:
            return None
        self.placed = place(cat, self.device, self.vram_budget, self.min_bytes)
        line = f"dsv4: --gpu: {self.placed.placement.summary()}"
        if self.placed.kept_on_cpu:
            line += f"; VRAM ran short while uploading: {len(self.placed.kept_on_cpu)} planned matrices kept on the CPU"
        self.messages.append(line)
        return self.placed

    def source(self, cat):
        """What to build trunk weights from: `cat` itself, or a view that serves placed matrices."""
        return cat if self.placed is None else self.placed.source(cat)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory held now for activations."""
        ops = self.device.ops if self.device else None
        return int(getattr(ops, "pinned_bytes", 0))

    def staging_bytes(self, max_rows: int, max_cols: int, chunk: int) -> int:
        """Pinned host memory a run will hold: one chunk in, one out of the widest matrix."""
        return 4 * chunk * (max_rows + max_cols) if self.enabled else 0

    def stats_line(self) -> str:
        if not self.enabled:
            return "gpu: off"
        s = self.device.stats
        return (
            f"gpu: {s.calls} device calls ({s.fused_calls} fused), {s.h2d_bytes / 1e6:.1f} MB to the device,"
            f" {s.d2h_bytes / 1e6:.1f} MB back"
        )

    def reserve_core(self, on: bool) -> None:
        """Apply (on) or undo the reserved-core split for the whole process: benches compare both."""
        if self.split is None or self.split.gpu is None or self.device is None:
            return
        if self._masks:
            affinity.restore_threads(self._masks)
            self._masks = {}
        every = set(affinity.usable_cpus()) | set(self.split.compute) | {self.split.gpu}
        self.device.thread.call(affinity.set_current_thread, {self.split.gpu} if on else every)
        if on:
            self._masks = affinity.move_threads(self.split.compute, exclude=self._gpu_tids)

    def close(self) -> None:
        """Stop the device thread and give the other threads their CPU masks back."""
        if self._masks:
            affinity.restore_threads(self._masks)
            self._masks = {}
        if self.device is not None:
            self.device.close()
        self.enabled = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def setup(
    requested: bool,
    vram_gb: float | None = None,
    threads: int | None = None,
    *,
    min_bytes: int = MIN_BYTES,
    fused: str = "auto",
) -> GpuContext:
    """Set up `--gpu` (or nothing); never raises for a missing GPU, it says so in one line.

    vram_gb: `--vram` (None: free memory less a margin); threads: `--threads` as given
    (None: not given, so with a GPU one CPU is reserved and the kernels get one thread
    fewer). fused: "auto" | "hw" | "soft" | "off" (the fused kernel variant; bench use).
    """
    if not requested:
        return GpuContext(False, threads)
    ok, reason = available()
    if not ok:
        return GpuContext(False, threads, messages=[fallback_line(reason)])

    from .cuda import CudaOps  # imports CuPy

    rss0 = _rss()
    cpus = affinity.usable_cpus()
    split = affinity.split_affinity(cpus, threads, True, affinity.cpu_siblings(cpus))
    before = set(affinity.thread_ids())
    thread = DeviceThread(split.gpu)
    try:
        ops = thread.call(CudaOps, fused)
        free, total = thread.call(ops.memory)
    except Exception as e:  # noqa: BLE001  any CUDA failure means: run on the CPU
        thread.close()
        return GpuContext(False, threads, messages=[fallback_line(f"the CUDA device is not usable ({_first_line(e)})")])

    budget, budget_note = vram_budget(free, total, vram_gb)
    # threads born while the device initialised are CUDA's (they inherited the GPU thread's CPU): they stay
    gpu_tids = frozenset(set(affinity.thread_ids()) - before) | {thread.native_id}
    masks = affinity.move_threads(split.compute, exclude=gpu_tids) if split.gpu is not None else {}
    kernels = f"fused FP8/BF16 kernels ({ops.fp8_decode})" if ops.kernels else "dequantise + cuBLAS only"
    head = (
        f"dsv4: --gpu: {ops.name} (sm_{ops.cc}, {total / 1e9:.1f} GB, {free / 1e9:.1f} GB free);"
        f" VRAM budget {budget / 1e9:.1f} GB; {kernels}"
    )
    lines = [head]
    lines += [f"dsv4: --gpu: {n}" for n in (split.note, thread.pin_error, budget_note, *ops.notes) if n]
    device = Device(thread, ops, ops.name)
    ctx = GpuContext(
        True, split.threads, split, device, budget, min_bytes, messages=lines, _masks=masks, _gpu_tids=gpu_tids
    )
    ctx.host_bytes = max(0, _rss() - rss0)
    return ctx


def _rss() -> int:
    try:
        import psutil  # a dependency of the package; imported here to keep `import gpu` light

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001  a missing figure only weakens the budget estimate
        return 0
