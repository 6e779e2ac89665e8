"""The process-wide numerics of the linears: "exact", "official" or "fast".

- exact: float32 activations into the exact kernels (`fast.py` / `reference.py`): today's bits.
- official: V4's shipped rounding: the input of every FP8 / FP4 weight of `matvec`, `matmul`
  and `matmul_pair` goes through `actquant.qdq_v4` (E4M3, groups of 128, power-of-two scales),
  then the exact kernels; BF16 and float32 weights see float32, and so does `matmul_grouped`
  (wo_a, which V4's reference holds in BF16). That is the set DeepSeek's V4 `inference/model.py`
  quantizes: wq_a, wq_b, wkv, wo_b, the indexer's wq_b, the shared and routed experts; not the
  compressors (float32 there), the indexer's weights_proj and the gate (BF16 / float32), wo_a,
  the head. (Its KV grids, FP8 window / compressed KV and the indexer's FP4 q / keys after a
  Hadamard rotation, are not applied: `official` here is the linears' activation grid only.) (V4.1's official grid is applied by its model before the
  linears: run V4.1's official numerics with this switch on "exact".)
- fast: FP4 weights x int8 activations (`q8.py`), FP8 and BF16 weights x BF16 activations
  (`bf16.py`), on the variant `cpu.variant` allows; a weight no fast kernel takes (float32, a
  width the kernels do not support, a CPU target without AVX2, the numpy reference backend)
  goes the exact way.

`set_numerics` installs this module as the router `kernels.matvec` / `matmul` / `matmul_pair`
/ `matmul_grouped` call (the hook `kernels._numerics`); "exact" removes it, so the exact path
is the one that ran before, call for call. In every mode a row's result does not depend on the
token count of the call, the other tokens in it, or the thread count.
"""

from __future__ import annotations

import numba
import numpy as np

from . import actquant, bf16, cpu, q8

MODES = ("exact", "official", "fast")
_mode = ["exact"]


def set_numerics(mode: str) -> None:
    """Choose the numerics of every linear in this process from here on."""
    if mode not in MODES:
        raise ValueError(f"numerics must be one of {', '.join(MODES)}, found {mode!r}")
    from dsv4stream import kernels

    _mode[0] = mode
    kernels._numerics = None if mode == "exact" else _Router


def get_numerics() -> str:
    return _mode[0]


def _exact():
    from dsv4stream import kernels

    return kernels._active()


def fast_variant(w) -> str | None:
    """The fast kernel variant weight w runs on in `fast` mode, or None (exact)."""
    if _exact().__name__.endswith(".reference") or w.kind not in ("fp4", "fp8", "bf16"):
        return None
    v = cpu.variant(w.kind)
    if v is None:
        return None
    ok = q8.supports(w.cols) if w.kind == "fp4" else bf16.supports(w.cols)
    ok = ok and w.data.flags.c_contiguous  # the row kernels step through rows of `cols` values
    return v if ok else None


def _threads() -> None:
    from dsv4stream import kernels

    numba.set_num_threads(kernels.get_threads())


def _prepare(w, x: np.ndarray):
    """The activation form w's fast kernel takes (shared by the weights of a pair)."""
    if w.kind == "fp4":
        return q8.prepare(x, fast_variant(w))
    if w.kind == "bf16":
        return bf16.to_bf16(x)
    return x


def _fast(w, x: np.ndarray, prepared=None) -> np.ndarray:
    if prepared is None:
        prepared = _prepare(w, x)
    if w.kind == "fp4":
        return q8.multiply(w.data, w.scale, prepared)
    if w.kind == "bf16":
        return bf16.bf16_multiply(w.data, prepared, fast_variant(w))
    return bf16.fp8_matmul(w.data, w.scale, w.block, prepared, fast_variant(w))


def _official_input(w, x: np.ndarray) -> np.ndarray:
    return actquant.qdq_v4(x) if w.kind in ("fp4", "fp8") else x


class _Router:
    """What `kernels` calls while a mode other than exact is on (a backend's four products)."""

    @staticmethod
    def matvec(w, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if _mode[0] == "fast" and x.ndim == 1 and fast_variant(w):
            _threads()
            return _fast(w, x[None])[0]
        if _mode[0] == "official":
            x = _official_input(w, x)
        return _exact().matvec(w, x)

    @staticmethod
    def matmul(w, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if _mode[0] == "fast" and x.ndim == 2 and fast_variant(w):
            _threads()
            return _fast(w, x)
        if _mode[0] == "official":
            x = _official_input(w, x)
        return _exact().matmul(w, x)

    @staticmethod
    def matmul_pair(w1, w3, x: np.ndarray):
        x = np.ascontiguousarray(x, dtype=np.float32)
        if _mode[0] == "fast" and fast_variant(w1) and fast_variant(w3):
            _threads()
            x2 = np.atleast_2d(x)
            shared = _prepare(w1, x2) if w1.kind == w3.kind and w1.kind != "fp8" else None
            return _fast(w1, x2, shared), _fast(w3, x2, shared)
        if _mode[0] == "official" and w1.kind == w3.kind:
            x = _official_input(w1, x)
        elif _mode[0] != "exact":
            return _Router.matmul(w1, x), _Router.matmul(w3, x)
        backend = _exact()
        if hasattr(backend, "matmul_pair"):
            return backend.matmul_pair(w1, w3, x)
        return backend.matmul(w1, x), backend.matmul(w3, x)

    @staticmethod
    def matmul_grouped(ws, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if _mode[0] == "fast" and all(fast_variant(w) for w in ws):
            _threads()
            return np.concatenate([_fast(w, np.ascontiguousarray(x[:, i])) for i, w in enumerate(ws)], axis=1)
        # official: no activation grid. The one grouped product is V4's wo_a, which DeepSeek's
        # reference dequantizes to BF16 (`convert.py`) and multiplies in float (an einsum of
        # o.float() and wo_a.float()), so its input is never E4M3-rounded there either.
        backend = _exact()
        if hasattr(backend, "matmul_grouped"):
            return backend.matmul_grouped(ws, x)
        return np.concatenate([backend.matmul(w, x[:, i]) for i, w in enumerate(ws)], axis=1)
