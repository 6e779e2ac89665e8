"""Quantized matrix times vector / matrix: the one interface the model calls for linears.

Owns: the dispatch of `matvec` / `matmul` over a `QWeight` (defined beside the codecs in
`checkpoint.formats`, re-exported here) (and the two grouped forms the model uses per token:
`matmul_pair`, one input times two weights; `matmul_grouped`, g inputs times g row blocks)
and of attention's two products (`attend`, `index_scores`) to a backend, and the time spent
in the linears per weight role (`kernel_seconds`: the per-token profile of `--stats`). The
numpy reference (`reference.py`) is the readable definition; the numba backend (`fast.py`,
`attn.py`) replaces it when available. The numba kernels sum in a fixed order: their results
do not depend on the thread count, nor on which other tokens share a call (numpy's BLAS,
which the reference uses, guarantees neither).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np

from ..checkpoint.formats import QWeight
from . import reference

KINDS = ("fp8", "fp4", "bf16", "f32")


_backend = None  # resolved on first use: the numba backend when it imports, else the reference


def set_backend(name: str) -> None:
    """'reference' (numpy) or 'fast' (numba; falls back to the reference if numba is missing)."""
    global _backend
    if name == "reference":
        _backend = reference
        return
    try:
        from . import fast  # numba import is heavy: only when first needed
    except ImportError:
        _backend = reference
    else:
        _backend = fast


def _active():
    if _backend is None:
        set_backend("fast")
    return _backend


# The numerics hook: `set_numerics` puts a `numerics.Router` here for "official" / "fast" (the
# linears then go through it) and None for "exact" (the backend's own products, as before).
_numerics = None
_numerics_mode = "exact"


def _products():
    return _numerics if _numerics is not None else _active()


def set_numerics(mode: str) -> None:
    """'exact' (float32 activations), 'official' (V4's E4M3 activation grid) or 'fast' (int8 /
    BF16 activations on the CPU's dot-product instructions): see `numerics.py`."""
    global _numerics, _numerics_mode
    from . import numerics

    numerics.check_mode(mode)
    # the Router runs a fast kernel only where the exact backend is the numba one (`fast_variant`),
    # so numba's per-thread count is the one to apply before it: jit's rule (`kernel_threads`)
    _numerics = None if mode == "exact" else numerics.Router(mode, _active, numerics.kernel_threads)
    _numerics_mode = mode


def get_numerics() -> str:
    return _numerics_mode


def fast_variant(w: QWeight) -> str | None:
    """The fast kernel variant w runs on under `fast` numerics, or None (the exact kernels)."""
    from . import numerics

    return numerics.fast_variant(w, _active())


def int8_trunk() -> bool:
    """Whether a `fast` engine converts its resident FP8 trunk to int8 (`trunkq8.py`): the numba
    backend on a CPU target whose FP8 fast variant is "avx2" (no BF16 dot product)."""
    if _active() is reference:
        return False
    from . import trunkq8

    return trunkq8.wanted()


def backend_name() -> str:
    return _active().__name__.rsplit(".", 1)[-1]


def set_threads(n: int) -> None:
    """Thread count for the CPU kernels (numba); the reference ignores it."""
    backend = _active()
    if hasattr(backend, "set_threads"):
        backend.set_threads(n)


def get_threads() -> int:
    """Thread count the CPU kernels run with now (1 for the reference)."""
    backend = _active()
    return backend.get_threads() if hasattr(backend, "get_threads") else 1


def warmup(forms: Iterable[str] | None = None) -> float:
    """Compile (or load from the numba cache) the kernels of `forms` (`warm.FORMS`; None: every
    form); returns the seconds it took.

    A warm-up that ends has put those signatures in numba's cache: it leaves the markers that
    `warm.missing_forms` looks for."""
    if _active() is reference:
        return 0.0
    from . import warm

    return warm.warmup(forms)


# Seconds spent in matvec / matmul per weight role since the process started. Two perf_counter
# calls per product, small beside the product. Updated by whichever
# thread multiplies: concurrent callers may lose an update, which a profile can afford.
_spent: dict[str, float] = {}


def kernel_seconds() -> dict[str, float]:
    """Role -> seconds spent in the products so far (take differences around a window)."""
    return dict(_spent)


def _count(role: str, t0: float) -> None:
    _spent[role] = _spent.get(role, 0.0) + time.perf_counter() - t0


def matvec(w: QWeight, x: np.ndarray) -> np.ndarray:
    """x (C,) float32 -> (R,) float32."""
    t0 = time.perf_counter()
    y = w.matvec(x) if w.on_device else _products().matvec(w, x)
    _count(w.role, t0)
    return y


def matmul(w: QWeight, x: np.ndarray) -> np.ndarray:
    """X (T, C) float32 -> (T, R) float32."""
    t0 = time.perf_counter()
    y = w.matmul(x) if w.on_device else _products().matmul(w, x)
    _count(w.role, t0)
    return y


def matmul_pair(w1: QWeight, w3: QWeight, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(matmul(w1, X), matmul(w3, X)) for two weights of one shape: X (T, C) -> two (T, R).

    Equal to the two separate products bit for bit; one pass over both weights where the
    backend has one (a routed expert's gate and up projections at one token)."""
    backend = _products()
    if w1.on_device or w3.on_device or not hasattr(backend, "matmul_pair"):
        return matmul(w1, x), matmul(w3, x)
    t0 = time.perf_counter()
    y = backend.matmul_pair(w1, w3, x)
    _count(w1.role, t0)
    return y


def q8_expert_variant(e) -> str | None:
    """The `experts_q8` variant a routed expert (w1, w2, w3 QWeights) runs on now: fast numerics,
    FP4 matrices its drivers take; else None (`matmul_pair` and `matmul` as before)."""
    if _numerics_mode != "fast":
        return None
    from . import experts_q8

    return experts_q8.variant_of(e, backend_name(), fast_variant)


def q8_layer(
    variant: str,
    x: np.ndarray,
    experts: np.ndarray,
    weights: np.ndarray,
    glu,
    role: str,
    pre_weight: bool = False,
    limit: float | None = None,
):
    """A layer's routed FP4 experts on `experts_q8`'s drivers (`experts_q8.Layer`): x (T, D), the
    routing experts / weights (T, k), glu(gate, up) the elementwise middle; its driver calls'
    seconds are counted under `role`, as the products'. `pre_weight`: weights before w2 (V4.1).
    `limit`: glu is the MoE's clamped SwiGLU at this limit (the drivers may run it themselves)."""
    from . import experts_q8

    def count(t0: float) -> None:
        _count(role, t0)

    return experts_q8.Layer(variant, x, experts, weights, glu, count=count, pre_weight=pre_weight, limit=limit)


def matmul_grouped(ws: Sequence[QWeight], x: np.ndarray) -> np.ndarray:
    """Group i of X (T, g, C) times ws[i] (R, C), concatenated: -> (T, g * R).

    The grouped low-rank output projection; equal to the per-group products bit for bit."""
    backend = _products()
    if any(w.on_device for w in ws) or not hasattr(backend, "matmul_grouped"):
        return np.concatenate([matmul(w, x[:, i]) for i, w in enumerate(ws)], axis=1)
    t0 = time.perf_counter()
    y = backend.matmul_grouped(ws, x)
    _count(ws[0].role, t0)
    return y


def _attention_backend():
    if _active() is reference:
        return reference
    from . import attn  # numba, like fast

    return attn


def attend(
    q: np.ndarray,
    keys: np.ndarray,
    key_mask: np.ndarray,
    comp: np.ndarray | None,
    comp_mask: np.ndarray | None,
    comp_idx: np.ndarray | None,
    sink: np.ndarray,
) -> np.ndarray:
    """Softmax attention with a sink; one KV vector is both key and value.

    q (T, H, hd); keys (S, hd) with key_mask (T, S) True = visible; compressed rows comp
    (n, hd) seen either densely through comp_mask (T, n) or per query through comp_idx
    (T, K) (-1 = none); sink (H,), which joins the softmax denominator only. Scores are
    scaled by hd^-0.5. Returns (T, H, hd) float32.
    """
    return _attention_backend().attend(q, keys, key_mask, comp, comp_mask, comp_idx, sink)


def index_scores(q: np.ndarray, w: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The lightning indexer's scores: q (T, h, c), head weights w (T, h), keys (n, c) -> (T, n),
    score[t, j] = sum_h w[t, h] * relu(q[t, h] . keys[j]) * c^-0.5."""
    return _attention_backend().index_scores(q, w, keys)


def dense(w: QWeight) -> np.ndarray:
    """The whole weight as float32 (R, C): for tests and small matrices only."""
    if w.on_device:
        return w.dense()
    return reference.dequant(w)
