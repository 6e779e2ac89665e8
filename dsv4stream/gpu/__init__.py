"""`--gpu`: trunk matrices in VRAM (CuPy), routed experts still streamed to the CPU.

Owns: the array-module boundary for the dense trunk. A placed matrix becomes a
`DeviceQWeight` (a `QWeight` whose arrays live on the device); `kernels.matvec` / `matmul`
see `on_device` and let it multiply itself there, so the model code is the same with or
without a GPU and runs on numpy when there is none. Importing this package does not import
CuPy; `available()` / `setup(True, ...)` do.

    ctx = gpu.setup(requested, vram_gb, threads)  # never raises for a missing GPU
    print lines from ctx.take_messages()          # to stderr
    ctx.place(cat)                                # plan + upload; None when not enabled
    trunk = CatalogTrunk(ctx.source(cat))         # placed matrices come back as DeviceQWeights
    kernels.set_threads(ctx.threads)              # one fewer when a core is reserved
    ...
    ctx.close()                                   # CPU affinity given back

Modules: `affinity` (reserved core), `plan` (VRAM budget, placement), `device` (device
thread, DeviceQWeight, numpy stand-in), `cuda` (CuPy kernels), `trunk` (candidates, upload,
PlacedSource), `context` (setup, GpuContext).
"""

from __future__ import annotations

from .affinity import AffinitySplit, split_affinity
from .context import GpuContext, available, fallback_line, setup
from .device import Device, DeviceQWeight, DeviceThread, host_device
from .plan import Matrix, Placement, plan_placement, vram_budget
from .trunk import Placed, PlacedSource, candidates, candidates_from_config, place

__all__ = [
    "AffinitySplit",
    "Device",
    "DeviceQWeight",
    "DeviceThread",
    "GpuContext",
    "Matrix",
    "Placed",
    "PlacedSource",
    "Placement",
    "available",
    "candidates",
    "candidates_from_config",
    "fallback_line",
    "host_device",
    "place",
    "plan_placement",
    "setup",
    "split_affinity",
    "vram_budget",
]
