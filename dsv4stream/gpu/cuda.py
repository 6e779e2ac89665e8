"""The CUDA backend (CuPy): fused FP8 / BF16 matrix-vector kernels, pinned staging, and the
dequantise-then-cuBLAS path for longer chunks.

Owns: the kernel source and its compilation, `CudaOps` (upload, matmul, dense; every
method runs on the device thread, whose current stream is ours), the start-up self-test
that checks each kernel against the numpy reference and drops one that disagrees. Only
imported once `--gpu` was asked for and CuPy imported.

Kernels: one warp computes RPW rows for up to MAXT tokens. Each lane loads 16 bytes of a
row at a time (16 FP8 weights inside one 128-column scale block, or 8 BF16 weights),
decodes them exactly to float32, dots them with the activations (read through the cache:
they are reused by every row) and folds in the block scale; a warp shuffle sums the
lanes. E4M3 decodes in hardware (`cvt.rn.f16x2.e4m3x2`, sm_89 and later: two weights per
instruction, exact through f16) or in integer arithmetic elsewhere (the 7 magnitude bits
placed under a float32 exponent then scaled by 2^120, exact for subnormals with
flush-to-zero off). Weights are read once per call, so the loads are streaming (`__ldcs`)
to leave the cache to the activations.

Longer chunks (T > MAXT) go through dequantise-then-SGEMM in row blocks (`device.
dequant_gemm`); cuBLAS is then compute-bound and the extra scratch traffic is cheap. CuPy
uses TF32 only when CUPY_TF32=1; that would break the 1e-5 agreement, so it is refused.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from ..checkpoint import formats
from ..kernels import QWeight, reference
from .device import E4M3_TABLE, DeviceQWeight, DeviceStats, dequant_gemm, dequant_rows, upload_arrays

MAXT = 8
RPW = 2
WARPS_PER_BLOCK = 8
TOLERANCE = 1e-5

KERNEL_SOURCE = r"""
#define MAXT %(maxt)d
#define RPW %(rpw)d
#define THREADS %(threads)d

__device__ __forceinline__ float e4m3_soft(unsigned int b) {
    // sign | exponent+mantissa under a float32 exponent, times 2^120 (0x7B800000): exact,
    // subnormals included (needs flush-to-zero off). 0x7F / 0xFF are NaN in E4M3FN.
    unsigned int mag = b & 0x7Fu;
    float v = __uint_as_float(((b & 0x80u) << 24) | (mag << 20)) * __uint_as_float(0x7B800000u);
    return mag == 0x7Fu ? __uint_as_float(0x7FC00000u) : v;
}

__device__ __forceinline__ void e4m3x4(unsigned int q, float* f) {
#if DSV4_HW_FP8
    unsigned int h01, h23;
    unsigned short lo = (unsigned short)(q & 0xFFFFu), hi = (unsigned short)(q >> 16);
    asm("cvt.rn.f16x2.e4m3x2 %%0, %%1;" : "=r"(h01) : "h"(lo));
    asm("cvt.rn.f16x2.e4m3x2 %%0, %%1;" : "=r"(h23) : "h"(hi));
    asm("{ .reg .b16 a, b; mov.b32 {a, b}, %%2; cvt.f32.f16 %%0, a; cvt.f32.f16 %%1, b; }"
        : "=f"(f[0]), "=f"(f[1]) : "r"(h01));
    asm("{ .reg .b16 a, b; mov.b32 {a, b}, %%2; cvt.f32.f16 %%0, a; cvt.f32.f16 %%1, b; }"
        : "=f"(f[2]), "=f"(f[3]) : "r"(h23));
#else
    f[0] = e4m3_soft(q & 0xFFu);
    f[1] = e4m3_soft((q >> 8) & 0xFFu);
    f[2] = e4m3_soft((q >> 16) & 0xFFu);
    f[3] = e4m3_soft(q >> 24);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

// y (T, R) = x (T, C) @ W^T; W (R, C) E4M3 bytes, scale (ceil(R/BR), SC) float32 with one scale
// per BR x BC block, BR = 1 << BRS, BC = 1 << BCS (128x128 in V4, 32x32 in V4.1). C %% 16 == 0
// and BC >= 16: a lane's 16 weights share one scale.
extern "C" __global__ void __launch_bounds__(THREADS, 3) fp8_gemv(const uint4* __restrict__ w, const float* __restrict__ scale,
                                    const float* __restrict__ x, float* __restrict__ y,
                                    int R, int C, int T, int SC, int BRS, int BCS) {
    const int lane = threadIdx.x & 31;
    const int r0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * RPW;
    if (r0 >= R) return;
    const int nvec = C >> 4;
    const uint4* wr[RPW];
    const float* sr[RPW];
    #pragma unroll
    for (int k = 0; k < RPW; ++k) {
        int r = min(r0 + k, R - 1);
        wr[k] = w + (size_t)r * nvec;
        sr[k] = scale + (size_t)(r >> BRS) * SC;
    }
    float acc[RPW][MAXT];
    #pragma unroll
    for (int k = 0; k < RPW; ++k)
        #pragma unroll
        for (int t = 0; t < MAXT; ++t) acc[k][t] = 0.0f;

    for (int v = lane; v < nvec; v += 32) {
        float wf[RPW][16];
        float s[RPW];
        #pragma unroll
        for (int k = 0; k < RPW; ++k) {
            uint4 q = __ldcs(wr[k] + v);
            e4m3x4(q.x, wf[k]);
            e4m3x4(q.y, wf[k] + 4);
            e4m3x4(q.z, wf[k] + 8);
            e4m3x4(q.w, wf[k] + 12);
            s[k] = __ldg(sr[k] + ((v << 4) >> BCS));
        }
        const int c0 = v << 4;
        #pragma unroll
        for (int t = 0; t < MAXT; ++t) {
            if (t < T) {
                const float4* xp = reinterpret_cast<const float4*>(x + (size_t)t * C + c0);
                float4 a[4] = {__ldg(xp), __ldg(xp + 1), __ldg(xp + 2), __ldg(xp + 3)};
                #pragma unroll
                for (int k = 0; k < RPW; ++k) {
                    float p = 0.0f;
                    #pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        p = fmaf(wf[k][4 * j + 0], a[j].x, p);
                        p = fmaf(wf[k][4 * j + 1], a[j].y, p);
                        p = fmaf(wf[k][4 * j + 2], a[j].z, p);
                        p = fmaf(wf[k][4 * j + 3], a[j].w, p);
                    }
                    acc[k][t] = fmaf(p, s[k], acc[k][t]);
                }
            }
        }
    }
    #pragma unroll
    for (int k = 0; k < RPW; ++k)
        #pragma unroll
        for (int t = 0; t < MAXT; ++t)
            if (t < T) {
                float v = warp_sum(acc[k][t]);
                if (lane == 0 && r0 + k < R) y[(size_t)t * R + r0 + k] = v;
            }
}

// y (T, R) = x (T, C) @ W^T; W (R, C) BF16 bits. C %% 8 == 0.
extern "C" __global__ void __launch_bounds__(THREADS, 3) bf16_gemv(const uint4* __restrict__ w, const float* __restrict__ x,
                                     float* __restrict__ y, int R, int C, int T) {
    const int lane = threadIdx.x & 31;
    const int r0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * RPW;
    if (r0 >= R) return;
    const int nvec = C >> 3;
    const uint4* wr[RPW];
    #pragma unroll
    for (int k = 0; k < RPW; ++k) wr[k] = w + (size_t)min(r0 + k, R - 1) * nvec;
    float acc[RPW][MAXT];
    #pragma unroll
    for (int k = 0; k < RPW; ++k)
        #pragma unroll
        for (int t = 0; t < MAXT; ++t) acc[k][t] = 0.0f;

    for (int v = lane; v < nvec; v += 32) {
        float wf[RPW][8];
        #pragma unroll
        for (int k = 0; k < RPW; ++k) {
            uint4 q = __ldcs(wr[k] + v);
            unsigned int u[4] = {q.x, q.y, q.z, q.w};
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                wf[k][2 * j] = __uint_as_float(u[j] << 16);
                wf[k][2 * j + 1] = __uint_as_float(u[j] & 0xFFFF0000u);
            }
        }
        const int c0 = v << 3;
        #pragma unroll
        for (int t = 0; t < MAXT; ++t) {
            if (t < T) {
                const float4* xp = reinterpret_cast<const float4*>(x + (size_t)t * C + c0);
                float4 a0 = __ldg(xp), a1 = __ldg(xp + 1);
                #pragma unroll
                for (int k = 0; k < RPW; ++k) {
                    float p = wf[k][0] * a0.x;
                    p = fmaf(wf[k][1], a0.y, p);
                    p = fmaf(wf[k][2], a0.z, p);
                    p = fmaf(wf[k][3], a0.w, p);
                    p = fmaf(wf[k][4], a1.x, p);
                    p = fmaf(wf[k][5], a1.y, p);
                    p = fmaf(wf[k][6], a1.z, p);
                    p = fmaf(wf[k][7], a1.w, p);
                    acc[k][t] += p;
                }
            }
        }
    }
    #pragma unroll
    for (int k = 0; k < RPW; ++k)
        #pragma unroll
        for (int t = 0; t < MAXT; ++t)
            if (t < T) {
                float v = warp_sum(acc[k][t]);
                if (lane == 0 && r0 + k < R) y[(size_t)t * R + r0 + k] = v;
            }
}
"""


# (rows, cols, scale format, FP8 scale block) of the self-test's matrices: V4's 128x128 blocks
# with edge rows, both scale types, a one-row matrix, and V4.1's 32x32 blocks with edge rows.
SELFTEST_SHAPES = (
    (259, 384, "ue8m0", (128, 128)),
    (128, 256, "float", (128, 128)),
    (1, 16, "ue8m0", (128, 128)),
    (77, 96, "ue8m0", (32, 32)),
)


def fused_block(block: tuple[int, int]) -> bool:
    """Whether the fused FP8 kernel handles this scale block: powers of two, at least 16
    columns wide (a lane's 16 consecutive weights must share one scale)."""
    br, bc = block
    return br > 0 and bc >= 16 and br & (br - 1) == 0 and bc & (bc - 1) == 0


def kernel_source(hw_fp8: bool) -> str:
    return f"#define DSV4_HW_FP8 {int(hw_fp8)}\n" + KERNEL_SOURCE % {
        "maxt": MAXT,
        "rpw": RPW,
        "threads": 32 * WARPS_PER_BLOCK,
    }


def e4m3_soft_numpy(b: np.ndarray) -> np.ndarray:
    """numpy twin of the kernel's integer decode `e4m3_soft` (uint8 -> float32), for tests."""
    b = np.asarray(b, dtype=np.uint32)
    mag = b & 0x7F
    v = (((b & 0x80) << 24) | (mag << 20)).astype(np.uint32).view(np.float32) * np.float32(2.0**120)
    return np.where(mag == 0x7F, np.float32(np.nan), v).astype(np.float32)


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref|: the norm-wise error (element-wise relative error is
    meaningless where a sum cancels to near zero)."""
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    diff = float(np.max(np.abs(got.astype(np.float64) - ref))) if ref.size else 0.0
    return diff / scale if scale > 0 else diff


class CudaOps:
    """Device arithmetic on the current CUDA device; construct and call on the device thread."""

    def __init__(self, fused: str = "auto", fused_max_t: int = MAXT) -> None:
        import cupy  # only with --gpu

        if os.environ.get("CUPY_TF32") == "1":
            raise RuntimeError("CUPY_TF32=1 makes cuBLAS round float32 inputs to TF32; unset it for --gpu")
        self.cp = cupy
        self.dev = cupy.cuda.Device()
        self.dev.use()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()  # also entered around every call: kernels and CuPy ops go on the current stream
        props = cupy.cuda.runtime.getDeviceProperties(self.dev.id)
        self.name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.cc = int(self.dev.compute_capability)
        self.stats = DeviceStats()
        self.lut = cupy.asarray(E4M3_TABLE)
        self.fused_max_t = fused_max_t
        self._pin_in = self._pin_out = None
        self.notes: list[str] = []
        self.kernels: dict[str, Any] = {}
        self.fp8_decode = "none"
        err = self.selftest((MAXT + 3,))  # dequantise + cuBLAS: the path every longer chunk takes
        if err > TOLERANCE:
            raise RuntimeError(f"dequantise + cuBLAS disagrees with the CPU reference ({err:.1e})")
        if fused != "off":
            self._compile(prefer_hw=fused in ("auto", "hw") and self.cc >= 89, allow_soft=fused != "hw")

    # ---- set-up ---------------------------------------------------------------
    def _compile(self, prefer_hw: bool, allow_soft: bool) -> None:
        """Compile the fused kernels, keep the first variant that passes the self-test."""
        variants = ([True] if prefer_hw else []) + ([False] if allow_soft else [])
        for hw in variants:
            label = "hardware cvt" if hw else "integer decode"
            try:
                mod = self.cp.RawModule(code=kernel_source(hw), options=("-ftz=false",))
                self.kernels = {"fp8": mod.get_function("fp8_gemv"), "bf16": mod.get_function("bf16_gemv")}
                err = self.selftest((1, 3, MAXT))
            except Exception as e:  # noqa: BLE001  a compile or launch failure disables the fused path
                self.kernels = {}
                self.notes.append(
                    f"fused kernels ({label}) unusable: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                )
                continue
            if err <= TOLERANCE:
                self.fp8_decode = label
                return
            self.kernels = {}
            self.notes.append(f"fused kernels ({label}) disagree with the CPU reference ({err:.1e}); not used")

    def selftest(self, tokens: tuple[int, ...], seed: int = 0) -> float:
        """Worst relative error of the device path against the numpy reference on small
        matrices that cover every finite E4M3 byte, edge row counts and both scale types."""
        rng = np.random.default_rng(seed)
        worst = 0.0
        finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
        for rows, cols, scale_fmt, blk in SELFTEST_SHAPES:
            data = rng.choice(finite, size=(rows, cols)).astype(np.uint8)
            data.ravel()[: min(data.size, finite.size)] = finite[: min(data.size, finite.size)]
            shape = formats.fp8_scale_shape(rows, cols, blk)
            if scale_fmt == "ue8m0":
                scale = rng.integers(110, 135, size=shape, dtype=np.uint8)
            else:
                scale = rng.uniform(0.001, 0.1, size=shape).astype(np.float32)
            bits = formats.f32_to_bf16(rng.standard_normal((rows, cols), dtype=np.float32))
            for w in (QWeight("fp8", data, scale, rows, cols, block=blk), QWeight("bf16", bits, None, rows, cols)):
                dw = DeviceQWeight(*self.upload(w), rows, cols, block=w.block)
                for t in tokens:
                    x = rng.standard_normal((t, cols), dtype=np.float32)
                    ref = reference.matmul(w, x)
                    worst = max(worst, relative_error(self.matmul(dw, x), ref))
        return worst

    # ---- the three calls ---------------------------------------------------------
    def upload(self, w: QWeight) -> tuple[str, Any, Any]:
        with self.stream:
            kind, data, scale = upload_arrays(self.cp, w)
        self.stream.synchronize()
        self.stats.h2d_bytes += data.nbytes + (0 if scale is None else scale.nbytes)
        return kind, data, scale

    def matmul(self, w: QWeight, x: np.ndarray) -> np.ndarray:
        """X (T, C) float32 (host) -> (T, R) float32 (host)."""
        cp = self.cp
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != w.cols:
            raise ValueError(f"activation shape {x.shape} does not fit weight ({w.rows}, {w.cols})")
        t = x.shape[0]
        n_in, n_out = t * w.cols, t * w.rows
        pin_in, pin_out = self._pinned(n_in, n_out)
        pin_in[:n_in] = x.ravel()
        with self.stream:  # kernels and CuPy ops go on the current stream: make it ours
            xd = cp.empty((t, w.cols), dtype=cp.float32)
            xd.data.copy_from_host_async(ctypes.c_void_p(pin_in.ctypes.data), 4 * n_in, self.stream)
            yd = self.compute(w, xd)
            yd.data.copy_to_host_async(ctypes.c_void_p(pin_out.ctypes.data), 4 * n_out, self.stream)
        self.stream.synchronize()
        self.stats.calls += 1
        self.stats.h2d_bytes += 4 * n_in
        self.stats.d2h_bytes += 4 * n_out
        return pin_out[:n_out].reshape(t, w.rows).copy()

    def dense(self, w: QWeight) -> np.ndarray:
        with self.stream:
            out = self.cp.asnumpy(dequant_rows(self.cp, w, 0, w.rows, self.lut))
        return out

    def compute(self, w: QWeight, xd):
        """xd (T, C) device float32 -> (T, R) device float32, queued on the current stream:
        the fused kernel for short chunks, dequantise + cuBLAS otherwise."""
        if self._fusable(w, xd.shape[0]):
            self.stats.fused_calls += 1
            return self._fused(w, xd)
        return dequant_gemm(self.cp, w, xd, self.lut)

    # ---- internals -----------------------------------------------------------------
    def _fusable(self, w: QWeight, t: int) -> bool:
        if not self.kernels or t > self.fused_max_t or w.kind not in self.kernels:
            return False
        return w.cols % (16 if w.kind == "fp8" else 8) == 0 and (w.kind != "fp8" or fused_block(w.block))

    def _fused(self, w: QWeight, xd):
        """Fused kernel over chunks of up to MAXT tokens; xd (T, C) device -> (T, R) device."""
        cp = self.cp
        t = xd.shape[0]
        yd = cp.empty((t, w.rows), dtype=cp.float32)
        rows_per_block = WARPS_PER_BLOCK * RPW
        grid = ((w.rows + rows_per_block - 1) // rows_per_block,)
        block = (32 * WARPS_PER_BLOCK,)
        r, c = np.int32(w.rows), np.int32(w.cols)
        for a in range(0, t, MAXT):
            xs, ys = xd[a : a + MAXT], yd[a : a + MAXT]
            n = np.int32(xs.shape[0])
            if w.kind == "fp8":
                sc = np.int32(w.scale.shape[1])
                brs, bcs = (np.int32(b.bit_length() - 1) for b in w.block)
                self.kernels["fp8"](grid, block, (w.data, w.scale, xs, ys, r, c, n, sc, brs, bcs))
            else:
                self.kernels["bf16"](grid, block, (w.data, xs, ys, r, c, n))
        return yd

    def _pinned(self, n_in: int, n_out: int):
        """Page-locked host buffers for activations, grown on demand (async copies need them)."""
        import cupyx

        if self._pin_in is None or self._pin_in.size < n_in:
            self._pin_in = cupyx.empty_pinned((max(n_in, 1 << 16),), dtype=np.float32)
        if self._pin_out is None or self._pin_out.size < n_out:
            self._pin_out = cupyx.empty_pinned((max(n_out, 1 << 16),), dtype=np.float32)
        return self._pin_in, self._pin_out

    @property
    def pinned_bytes(self) -> int:
        return sum(0 if b is None else b.nbytes for b in (self._pin_in, self._pin_out))

    def memory(self) -> tuple[int, int]:
        """(free, total) device bytes."""
        free, total = self.cp.cuda.runtime.memGetInfo()
        return int(free), int(total)
