"""The process-wide numerics of the linears: "exact", "official" or "fast".

- exact: float32 activations into the exact kernels (`fast.py` / `reference.py`): today's bits.
- official: V4's shipped rounding: the input of every FP8 / FP4 weight of `matvec`, `matmul`
  and `matmul_pair` goes through `actquant.qdq_v4` (E4M3, groups of 128, power-of-two scales),
  then the exact kernels; BF16 and float32 weights see float32, and so does `matmul_grouped`
  (wo_a, which V4's reference holds in BF16). That is the set DeepSeek's V4 `inference/model.py`
  quantizes: wq_a, wq_b, wkv, wo_b, the indexer's wq_b, the shared and routed experts; not the
  compressors (float32 there), the indexer's weights_proj and the gate (BF16 / float32), wo_a,
  the head. V4's KV grids (window / compressed KV on E4M3, the indexer's FP4 after a Hadamard
  rotation: `actquant.kv_grid_v4`, `index_grid_v4`) are applied by V4's attention, which reads
  the mode from `kernels.get_numerics`. (V4.1's official grid is applied by its model before the
  linears: run V4.1's official numerics with this switch on "exact".)
- fast: FP4 weights x int8 activations (`q8.py`), FP8 and BF16 weights x BF16 activations
  (`bf16.py`), on the variant `cpu.variant` allows; where the FP8 variant is "avx2" (no BF16
  dot product) a fast engine's resident FP8 trunk is int8 instead ("i8" weights, `trunkq8.py`,
  times int8 activations); a weight no fast kernel takes (float32, a width the kernels do not
  support, a CPU target without AVX2, the numpy reference backend) goes the exact way. An "i8"
  weight exists only under fast: the exact kernels refuse it (an unknown kind).

`kernels.set_numerics` installs a `Router` as what `kernels.matvec` / `matmul` / `matmul_pair`
/ `matmul_grouped` call (the hook `kernels._numerics`); "exact" removes it, so the exact path
is the one that ran before, call for call. The router is handed the exact backend and the
thread count it needs, so this module imports nothing of the package above it. In every mode a row's result does not depend on the
token count of the call, the other tokens in it, or the thread count.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

from . import actquant, bf16, cpu, headq8, q8, trunkq8
from .jit import _apply_threads, _threads

MODES = ("exact", "official", "fast")
# A fast product of a weight below this many bytes, at up to SERIAL_TOKENS tokens, runs on the
# calling thread alone (the exact kernels' `fast.PARALLEL_MIN_BYTES` rule): a parallel region
# costs more than such a product when the other core is busy. flash-experts, 2 threads, load
# 3.8: a fast step's trunk products took 219 ms against exact's 95, every one a region.
SERIAL_BELOW_BYTES = 4 << 20
SERIAL_TOKENS = 4


def alone_if_small(nbytes: int, tokens: int, product: Callable[[], object], threads: int = 0):
    """product() on this thread alone for a weight under SERIAL_BELOW_BYTES at up to SERIAL_TOKENS
    tokens, else with the kernel threads already set (results do not depend on the count).
    threads: the count in effect on this thread where the caller knows it (0: ask numba, about
    1.5 us, on each of a step's ~50 small products)."""
    if tokens <= SERIAL_TOKENS and nbytes < SERIAL_BELOW_BYTES:
        n = threads or numba.get_num_threads()
        if n != 1:
            numba.set_num_threads(1)
            try:
                return product()
            finally:
                numba.set_num_threads(n)
    return product()


def kernel_threads() -> int:
    """Put `jit.set_threads`' count on the calling thread (`jit._apply_threads`) and return the
    count in effect there: the Router's `threads` for the package's numerics."""
    _apply_threads()
    return _threads[0] or numba.get_num_threads()


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"numerics must be one of {', '.join(MODES)}, found {mode!r}")
    return mode


def fast_variant(w, exact) -> str | None:
    """The fast kernel variant weight w runs on in `fast` mode beside the exact backend `exact`
    (a module: `fast` or `reference`), or None (w goes the exact way)."""
    if exact.__name__.endswith(".reference") or w.kind not in ("fp4", "fp8", "bf16", trunkq8.KIND):
        return None
    if w.kind == trunkq8.KIND:
        return headq8.variant()
    v = cpu.variant(w.kind)
    if v is None:
        return None
    ok = q8.supports(w.cols) if w.kind == "fp4" else bf16.supports(w.cols)
    ok = ok and w.data.flags.c_contiguous  # the row kernels step through rows of `cols` values
    return v if ok else None


def _prepare(w, x: np.ndarray, variant: str):
    """The activation form w's fast kernel takes (shared by the weights of a pair)."""
    if w.kind == trunkq8.KIND:
        return x
    if w.kind == "fp4":
        return q8.prepare(x, variant)
    if w.kind == "bf16":
        return bf16.to_bf16(x)
    return x


def _fast(w, x: np.ndarray, variant: str, prepared=None) -> np.ndarray:
    if prepared is None:
        prepared = _prepare(w, x, variant)
    if w.kind == "fp4":
        return q8.multiply(w.data, w.scale, prepared)
    if w.kind == "bf16":
        return bf16.bf16_multiply(w.data, prepared, variant)
    if w.kind == trunkq8.KIND:
        return trunkq8.matmul(w, prepared)
    return bf16.fp8_matmul(w.data, w.scale, w.block, prepared, variant)


def _fp8_twins(w1, w3) -> bool:
    """Whether `bf16.fp8_matmul_pair` (FP8) or `trunkq8.matmul_pair` (their int8 form) takes w1
    and w3: one kind, shape, block and scale dtype."""
    if w1.kind not in ("fp8", trunkq8.KIND) or w3.kind != w1.kind:
        return False
    if (w1.rows, w1.cols, w1.block) != (w3.rows, w3.cols, w3.block):
        return False
    return w1.scale.dtype == w3.scale.dtype and w3.data.flags.c_contiguous


def _fp8_whole(ws):
    """FP8 row blocks of one weight back to back in memory (the grouped output projection) as
    that one weight, when each group's rows are whole scale blocks; else None."""
    from .fast import _joined  # the exact backend's test of the same layout

    if ws[0].kind not in ("fp8", trunkq8.KIND) or ws[0].rows % ws[0].block[0]:
        return None
    whole = _joined(ws)
    return whole if whole is not None and whole.data.flags.c_contiguous else None


def _official_input(w, x: np.ndarray) -> np.ndarray:
    return actquant.qdq_v4(x) if w.kind in ("fp4", "fp8") else x


class Router:
    """What `kernels` calls while a mode other than exact is on (a backend's four products).

    exact: a callable giving the exact backend (the package's active one, resolved per call so
    `set_backend` still takes effect); threads: called before each fast product, puts the kernel
    thread count `set_threads` asked for on the calling thread (numba's count is per thread; the
    exact kernels do the same, `jit._apply_threads`) and returns the count in effect there."""

    def __init__(self, mode: str, exact: Callable, threads: Callable[[], int]):
        self.mode = check_mode(mode)
        self._exact = exact
        self._threads = threads
        # (exact backend, kind, cols, C-contiguous) -> variant: what `fast_variant` reads of a
        # weight, decided once instead of on each of a token's ~100 products
        self._variants: dict[tuple, str | None] = {}

    def _variant(self, w) -> str | None:
        if self.mode != "fast":
            return None
        exact = self._exact()
        key = (exact, w.kind, w.cols, w.data.flags.c_contiguous)
        v = self._variants.get(key, False)
        if v is False:
            v = self._variants[key] = fast_variant(w, exact)
        return v

    def _go_fast(self, w, t: int, product: Callable[[], object]):
        """product() with the requested kernel threads, or on this thread alone for a small
        weight at a few tokens (the results do not depend on the thread count)."""
        return alone_if_small(w.nbytes, t, product, self._threads())

    def matvec(self, w, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        v = self._variant(w) if x.ndim == 1 else None
        if v:
            return self._go_fast(w, 1, lambda: _fast(w, x[None], v)[0])
        if self.mode == "official":
            x = _official_input(w, x)
        return self._exact().matvec(w, x)

    def matmul(self, w, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        v = self._variant(w) if x.ndim == 2 else None
        if v:
            return self._go_fast(w, x.shape[0], lambda: _fast(w, x, v))
        if self.mode == "official":
            x = _official_input(w, x)
        return self._exact().matmul(w, x)

    def matmul_pair(self, w1, w3, x: np.ndarray):
        x = np.ascontiguousarray(x, dtype=np.float32)
        v1, v3 = self._variant(w1), self._variant(w3)
        if v1 and v3:
            x2 = np.atleast_2d(x)
            if _fp8_twins(w1, w3) and v1 == v3:  # one parallel region for both (a shared expert)
                if w1.kind == trunkq8.KIND:
                    return self._go_fast(w1, x2.shape[0], lambda: trunkq8.matmul_pair(w1, w3, x2))
                return self._go_fast(w1, x2.shape[0], lambda: bf16.fp8_matmul_pair(w1, w3, x2, v1))
            shared = _prepare(w1, x2, v1) if w1.kind == w3.kind and w1.kind in ("fp4", "bf16") else None
            return self._go_fast(w1, x2.shape[0], lambda: (_fast(w1, x2, v1, shared), _fast(w3, x2, v3, shared)))
        if self.mode == "official" and w1.kind == w3.kind:
            x = _official_input(w1, x)
        elif self.mode != "exact":
            return self.matmul(w1, x), self.matmul(w3, x)
        backend = self._exact()
        if hasattr(backend, "matmul_pair"):
            return backend.matmul_pair(w1, w3, x)
        return backend.matmul(w1, x), backend.matmul(w3, x)

    def matmul_grouped(self, ws, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        vs = [self._variant(w) for w in ws]
        whole = _fp8_whole(ws) if all(vs) and len(set(vs)) == 1 else None
        if whole is not None and whole.kind == trunkq8.KIND:
            return self._go_fast(whole, x.shape[0], lambda: trunkq8.matmul_grouped(whole, x))
        if whole is not None:  # the grouped wo_a: one parallel region, not one per group
            return self._go_fast(
                whole, x.shape[0], lambda: bf16.fp8_matmul_grouped(whole.data, whole.scale, whole.block, x, vs[0])
            )
        if all(vs):
            parts = lambda: [
                _fast(w, np.ascontiguousarray(x[:, i]), v) for i, (w, v) in enumerate(zip(ws, vs, strict=True))
            ]
            return np.concatenate(self._go_fast(max(ws, key=lambda w: w.nbytes), x.shape[0], parts), axis=1)
        # official: no activation grid. The one grouped product is V4's wo_a, which DeepSeek's
        # reference dequantizes to BF16 (`convert.py`) and multiplies in float (an einsum of
        # o.float() and wo_a.float()), so its input is never E4M3-rounded there either.
        backend = self._exact()
        if hasattr(backend, "matmul_grouped"):
            return backend.matmul_grouped(ws, x)
        return np.concatenate([backend.matmul(w, x[:, i]) for i, w in enumerate(ws)], axis=1)
