"""Which trunk matrices go to VRAM: pure arithmetic on sizes and a VRAM budget.

Owns: the VRAM budget (free memory less a safety margin and the device workspace, or the
user's `--vram`), the greedy placement of matrices by benefit, and the generic walk over
the model's frozen weight dataclasses that finds their `QWeight`s and swaps them.

Benefit: every trunk matrix is read once per token, so each byte placed in VRAM saves one
byte of RAM traffic per token; what differs is the CPU time per byte. The CPU kernels are
bound by decode work per weight as much as by bytes, and an FP8 byte is one weight while
a BF16 weight takes two bytes and an F32 weight four. So FP8 matrices come first, then
BF16 (the head among them), then F32; inside a kind, larger first (fewer calls per byte:
each device call costs tens of microseconds of fixed overhead), ties broken by key so the
plan is deterministic. Matrices below `min_bytes` stay on the CPU: there the fixed cost of
a device call exceeds what the CPU spends on them. FP4 (routed experts) never goes: the
experts stream to the CPU.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..checkpoint.tensors import MODEL
from ..kernels import QWeight

GIB = 1 << 30
MIB = 1 << 20
# Device memory kept free beyond the weights: dequantise scratch and cuBLAS temporaries for
# prefill chunks, activation buffers (a 64-token chunk through the head is 33 MB each way),
# the CUDA pool's rounding. Measured use stays well below this; see bench/gpu_check.py.
WORKSPACE = 512 * MIB
MIN_BYTES = 1 * MIB
PARAMS_PER_BYTE = {"fp8": 1.0, "bf16": 0.5, "f32": 0.25}

Key = tuple[int | None, str]  # (layer index or None for the head, tensor prefix such as "layers.3.attn.wq_b")


@dataclass(frozen=True)
class Matrix:
    key: Key
    kind: str
    rows: int
    cols: int
    host_bytes: int  # as held in RAM (weights + scales)
    device_bytes: int  # as held in VRAM (FP8 scales widened to float32)


@dataclass(frozen=True)
class Placement:
    on_device: frozenset[Key]
    device_bytes: int  # VRAM the placed matrices take
    host_bytes_moved: int  # RAM the placed matrices no longer take
    host_bytes_left: int  # trunk RAM that stays on the CPU
    count: int  # matrices placed
    total: int  # candidate matrices
    budget: int

    def summary(self) -> str:
        gb = 1e9
        head = "head in VRAM" if (None, MODEL["head"]) in self.on_device else "head on the CPU"
        return (
            f"{self.count} of {self.total} trunk matrices in VRAM ({self.host_bytes_moved / gb:.2f} GB;"
            f" {self.host_bytes_left / gb:.2f} GB stay in RAM; {head}; VRAM used {self.device_bytes / gb:.2f}"
            f" of {self.budget / gb:.2f} GB budget)"
        )


def device_bytes_of(kind: str, rows: int, cols: int, block: tuple[int, int] = (128, 128)) -> int:
    """VRAM a matrix takes once uploaded: FP8 scales (one per `block`: 128x128 in V4, 32x32 in
    V4.1) are widened to float32 on upload."""
    if kind == "fp8":
        return rows * cols + 4 * math.ceil(rows / block[0]) * math.ceil(cols / block[1])
    if kind == "bf16":
        return 2 * rows * cols
    if kind == "f32":
        return 4 * rows * cols
    raise ValueError(f"weight kind {kind!r} cannot go to the device")


def matrix_of(key: Key, w: QWeight) -> Matrix | None:
    """A placement candidate for one weight, or None for kinds that stay on the CPU."""
    if w.kind not in PARAMS_PER_BYTE:
        return None
    return Matrix(key, w.kind, w.rows, w.cols, w.nbytes, device_bytes_of(w.kind, w.rows, w.cols, w.block))


def plan_placement(mats: Sequence[Matrix], budget: int, min_bytes: int = MIN_BYTES) -> Placement:
    """Greedy by benefit until the budget is used; a matrix that does not fit is skipped
    and smaller ones are still tried, so the budget fills up."""
    order = sorted(mats, key=lambda m: (-PARAMS_PER_BYTE[m.kind], -m.host_bytes, _sort_key(m.key)))
    used = moved = 0
    chosen: set[Key] = set()
    for m in order:
        if m.host_bytes < min_bytes or used + m.device_bytes > budget:
            continue
        chosen.add(m.key)
        used += m.device_bytes
        moved += m.host_bytes
    total_host = sum(m.host_bytes for m in mats)
    return Placement(frozenset(chosen), used, moved, total_host - moved, len(chosen), len(mats), budget)


def moved_bytes(mats: Sequence[Matrix], placement: Placement) -> tuple[dict[int, int], int]:
    """RAM the placement frees: host bytes per main layer, and the head's."""
    per_layer: dict[int, int] = {}
    head = 0
    for m in mats:
        if m.key not in placement.on_device:
            continue
        layer = m.key[0]
        if layer is None:
            head += m.host_bytes
        else:
            per_layer[layer] = per_layer.get(layer, 0) + m.host_bytes
    return per_layer, head


def _sort_key(key: Key) -> tuple[int, str]:
    layer, path = key
    return (-1 if layer is None else layer, path)


def vram_budget(free: int, total: int, requested_gb: float | None) -> tuple[int, str]:
    """Bytes of VRAM the weights may take, and a note when the request was cut.

    Default: free memory less a safety margin (5% of the device, at least 512 MiB, for
    other processes and the driver) and the workspace. `--vram GB` (decimal GB, like
    `--budget`) is taken as is up to free memory less the workspace.
    """
    ceiling = max(0, free - WORKSPACE)
    if requested_gb is None:
        margin = max(512 * MIB, total // 20)
        return max(0, free - margin - WORKSPACE), ""
    want = int(requested_gb * 1e9)
    if want < 0:
        raise ValueError(f"--vram must be at least 0, found {requested_gb}")
    if want > ceiling:
        return ceiling, (
            f"--vram {requested_gb:g} is more than the {ceiling / 1e9:.1f} GB free after the"
            f" {WORKSPACE / MIB:.0f} MiB workspace; using {ceiling / 1e9:.1f} GB"
        )
    return want, ""


# ---- walking the model's weight dataclasses ---------------------------------------------


def iter_qweights(obj: object, prefix: str = "") -> Iterator[tuple[str, QWeight]]:
    """(path, QWeight) for every QWeight inside nested frozen dataclasses and tuples."""
    if isinstance(obj, QWeight):
        yield prefix, obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_qweights(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    elif isinstance(obj, tuple):
        for i, v in enumerate(obj):
            yield from iter_qweights(v, f"{prefix}.{i}")
