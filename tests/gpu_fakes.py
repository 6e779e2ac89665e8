"""The stand-in CUDA backend the `--gpu` tests share (V4 and V4.1): `gpu.setup` on numpy."""

from __future__ import annotations

from dsv4stream.gpu.device import HostOps


class FakeCudaOps(HostOps):
    """What gpu.setup needs from CudaOps, on the numpy stand-in."""

    def __init__(self, fused: str = "auto") -> None:
        super().__init__()
        self.name, self.cc, self.kernels, self.fp8_decode = "Fake GPU", 90, {"fp8": 1}, "integer decode"
        self.notes = []

    def memory(self) -> tuple[int, int]:
        return 6 * 10**9, 8 * 10**9
