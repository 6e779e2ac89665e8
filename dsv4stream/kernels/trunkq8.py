"""The FP8 trunk as int8: `fast` numerics' trunk products on CPUs without a BF16 dot product.

Where `cpu.variant("fp8")` is "avx2" (AVX2 + FMA; also an AVX-512 CPU with VNNI but without
BF16 / VBMI), the FP8 x BF16 kernels (`bf16.py`) decode each E4M3 byte to float32 and FMA it:
about 4 instructions and an FMA per 8 weights, half the core's read rate. llama.cpp's answer on
such CPUs is int8 x int8 (`vpmaddubsw` + `vpmaddwd`, 32 weights in ~5 instructions a token), and
so is this module's: when a `fast` engine loads its trunk (`convert_block`), each FP8 weight
becomes an int8 weight of the same bytes, in place (kind "i8"), multiplied by `headq8`'s row
kernels against int8 activations.

Weights (`quantize`): per FP8 scale block (V4: 128 x 128, V4.1: 32 x 32), E4M3 values v (before
the block's scale S) get u = fl32(m / 127), m the block's largest |v|, and q = rint(fl32(v / u))
(|q| <= 127); the block's factor is k = fl32(S * u) (NaN where S is NaN or infinite: those rows
are NaN, as the BF16 path makes them). One factor per FP8 block and not per row: every row of a
block shares S, so the factor folds into the activations' scales once per row block (below) and
the row kernel is the head's, unchanged; a per-row scale across blocks would cost the blocks with
small S their precision. A weight holding an E4M3 NaN code (0x7F / 0xFF) is left as FP8 (int8
cannot carry the NaN its rows must give; real checkpoints hold none).
Activations: `headq8.prepare` (int8 per 32 columns, d = fl32(absmax / 127)).
Product: for row block rb, dd[t, g] = fl32(d[t, g] * k[rb, g * 32 // bc]) per token and group
(once per row block), then `headq8`'s rows: each group's exact int32 sum times dd, FMA-added in
the head kernel's fixed order, times 1. A row's bits depend only on its row block's factors,
its int8 row and its token's activations: not on the thread count, the token count of the call,
the other tokens, or the work split.
"""

from __future__ import annotations

import os
import types as pytypes
from dataclasses import replace

import numba
import numpy as np
from numba import njit, prange

from ..checkpoint.formats import E4M3, QWeight
from . import cpu, headq8, simd
from .headq8 import GROUP, ROWS
from .q8 import E8M0

KIND = "i8"
_JIT = {"cache": True, "fastmath": False, "error_model": "numpy", "boundscheck": False}


ENV = "DSV4_INT8_TRUNK"  # "1": on (where `possible`); anything else or unset: off


def possible() -> bool:
    """Whether this CPU target could multiply the FP8 trunk as int8 under `fast`: where the FP8
    fast variant is "avx2" (no BF16 dot product) and the int8 rows have a SIMD variant."""
    return cpu.variant("fp8") == "avx2" and headq8.variant() != "plain"


def wanted() -> bool:
    """Whether a `fast` engine converts its trunk: `possible` and asked for (ENV=1). Off by
    default: on one of the 18 oracle-fixture cases (V4 ratio128, step) the int8 trunk agrees with
    the float32 reference's argmax on 16 of 18 clear positions against official's 17 (its median
    error 0.017 against official's 0.091): the rule of issue 44 holds in 17 cases, not all
    (docs/numerics.md)."""
    return os.environ.get(ENV) == "1" and possible()


def takes(w) -> bool:
    """Whether `quantize` takes w: an FP8 host weight in memory, C-contiguous, whole 64-column
    steps and column blocks of whole 32-column groups."""
    if not isinstance(w, QWeight) or w.kind != "fp8" or w.on_device:
        return False
    return headq8.supports(w.cols) and w.block[1] % GROUP == 0 and w.data.flags.c_contiguous


# ---------------------------------------------------------------- weights --------------------


def _tables() -> np.ndarray:
    """(128, 256) int8: row m (a block's largest magnitude code) maps each E4M3 code to
    rint(fl32(v / fl32(v_m / 127))) (NaN codes to 0; m = 0: all zero)."""
    vals = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    vals[np.isnan(vals)] = 0
    out = np.zeros((128, 256), np.int8)
    for m in range(1, 127):
        u = np.float32(vals[m] / np.float32(127))
        out[m] = np.clip(np.rint(vals / u), -127, 127).astype(np.int8)
    return out


TABLES = _tables()
UNITS = np.array(
    [np.float32(v / np.float32(127)) for v in np.arange(128, dtype=np.uint8).view(E4M3).astype(np.float32)],
    np.float32,
)
UNITS[127] = 0  # the NaN code never is a block's largest


@njit(parallel=True, **_JIT)
def _block_max(data, br, bc, top):
    """top[rb, cb] = the largest magnitude code (byte & 0x7F, E4M3's order) of each block; a
    NaN code (0x7F / 0xFF) is the largest there is, so top == 0x7F marks a block holding one.
    Column-wise maxima over a block's rows first (a loop of whole rows: vector byte maxima)."""
    R, C = data.shape
    for rb in prange(top.shape[0]):
        m = np.zeros(C, np.uint8)
        for r in range(rb * br, min(R, rb * br + br)):
            row = data[r]
            for c in range(C):
                m[c] = max(m[c], row[c] & np.uint8(0x7F))
        for cb in range(top.shape[1]):
            top[rb, cb] = m[cb * bc : min(C, cb * bc + bc)].max()


@njit(parallel=True, **_JIT)
def _recode(data, br, bc, top, tables, q):
    """q[r, c] = tables[top[block], data[r, c]]; q may be data's own bytes (each byte is read
    before it is written). A table per block's largest code (`TABLES`) and not the arithmetic:
    numba's loop of decode, divide and round ran at 0.3-0.45 GB/s here, the lookups at 0.9-1.0."""
    R, C = data.shape
    for rb in prange(top.shape[0]):
        for r in range(rb * br, min(R, rb * br + br)):
            src = data[r]
            dst = q[r]
            for cb in range(top.shape[1]):
                tab = tables[top[rb, cb]]
                for c in range(cb * bc, min(C, cb * bc + bc)):
                    dst[c] = tab[src[c]]


def _factors(scale: np.ndarray, top: np.ndarray) -> np.ndarray:
    """k = fl32(S * u) per block; NaN where S is not finite."""
    s = E8M0[scale] if scale.dtype == np.uint8 else np.asarray(scale, np.float32)
    k = (s * UNITS[np.minimum(top, 126)]).astype(np.float32)
    k[~np.isfinite(s)] = np.nan
    return k


def quantize(w: QWeight, in_place: bool = False) -> QWeight | None:
    """The int8 form of FP8 weight w (kind "i8": int8 data (R, C), float32 block factors of the
    FP8 scale grid's shape), or None where w holds an E4M3 NaN code. in_place: write the int8
    bytes over w's (w is unusable afterwards; where its bytes are read-only a copy is made)."""
    data = w.data.view(np.uint8)
    br, bc = w.block
    top = np.zeros(w.scale.shape, np.uint8)
    _block_max(data, br, bc, top)
    if (top == 0x7F).any():
        return None
    q = data.view(np.int8) if in_place and data.flags.writeable else np.empty(data.shape, np.int8)
    _recode(data, br, bc, top, TABLES, q)
    return replace(w, kind=KIND, data=q, scale=_factors(np.ascontiguousarray(w.scale), top))


def _row_blocks(ws: tuple, done: dict) -> tuple | None:
    """Row blocks of one FP8 weight back to back (the grouped output projection, `split_rows`)
    converted as that weight, so that their int8 forms are row blocks of one again (one parallel
    region, `trunkq8.matmul_grouped`); None where ws are not such blocks."""
    from .fast import _joined  # the exact backend's test of the same layout

    if not ws or not all(isinstance(w, QWeight) and takes(w) and id(w) not in done for w in ws):
        return None
    whole = _joined(ws)
    if whole is None or ws[0].rows % ws[0].block[0]:
        return None
    q = quantize(whole, in_place=True)
    if q is None:
        return None
    r, rb = ws[0].rows, ws[0].rows // ws[0].block[0]
    out = tuple(
        replace(q, data=q.data[i * r : (i + 1) * r], scale=q.scale[i * rb : (i + 1) * rb], rows=r)
        for i in range(len(ws))
    )
    done.update({id(w): o for w, o in zip(ws, out, strict=True)})
    return out


def convert_block(weights: object, done: dict | None = None) -> object:
    """Replace every FP8 weight `takes` accepts in the weights dataclass `weights` (and those
    nested in it, tuples included) by its int8 form, in place; returns `weights`. done: id of a
    converted QWeight -> its form (a weight reached twice is converted once)."""
    import dataclasses

    done = {} if done is None else done

    def one(v):
        if isinstance(v, QWeight):
            if id(v) not in done:
                done[id(v)] = (quantize(v, in_place=True) or v) if takes(v) else v
            return done[id(v)]
        if isinstance(v, tuple):
            return _row_blocks(v, done) or tuple(one(p) for p in v)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            convert_block(v, done)
        return v

    if dataclasses.is_dataclass(weights) and not isinstance(weights, type):
        for f in dataclasses.fields(weights):
            value = getattr(weights, f.name)
            new = one(value)
            if new is not value:
                object.__setattr__(weights, f.name, new)
    return weights


# ---------------------------------------------------------------- products -------------------

_item = None  # `headq8._item` over the variant's row kernels, bound by `_driver`


@njit(inline="always", **_JIT)
def _block_scales(da, k, rb, bc):
    """The tokens' activation scales per 32 columns (T, G) times row block rb's column-block
    factors: the scales `_item` multiplies that block's int32 sums by."""
    T, G = da.shape
    dd = np.empty((T, G), np.float32)
    for t in range(T):
        for g in range(G):
            dd[t, g] = da[t, g] * k[rb, g * GROUP // bc]
    return dd


def _blocks(w, ones, br, bc, xq, xc, da, k, rpg, out):
    """Row blocks of the factor grid in prange; row r meets token rows xq[r // rpg] (one weight:
    rpg = R; the grouped output projection's groups, rpg a multiple of br, in one region)."""
    R = w.shape[0]
    for rb in prange((R + br - 1) // br):
        gi = rb * br // rpg
        dd = _block_scales(da[gi], k, rb, bc)
        end = min(R, rb * br + br)
        for r0 in range(rb * br, end, ROWS):
            _item(w, ones, r0, min(end, r0 + ROWS), xq[gi], xc[gi], dd, out)


def _pair_blocks(w1, k1, w3, k3, ones, br, bc, xq, xc, da, out1, out3):
    """Two weights of one shape (a shared expert's w1 and w3) in one region, blocks alternating."""
    R = w1.shape[0]
    nb = (R + br - 1) // br
    for i in prange(2 * nb):
        rb = i // 2
        k = k1 if i % 2 == 0 else k3
        w = w1 if i % 2 == 0 else w3
        out = out1 if i % 2 == 0 else out3
        dd = _block_scales(da[0], k, rb, bc)
        end = min(R, rb * br + br)
        for r0 in range(rb * br, end, ROWS):
            _item(w, ones, r0, min(end, r0 + ROWS), xq[0], xc[0], dd, out)


def _driver(name: str, variant: str):
    """`_blocks` / `_pair_blocks` over `variant`'s head rows: a function object of its own named
    after the variant and simd.py's hash (numba's cache keys entries by name; `q8._driver`)."""
    g = dict(globals())
    headq8.bind_rows(variant, g)
    body = {"one": _blocks, "pair": _pair_blocks}[name]
    f = pytypes.FunctionType(body.__code__, g, f"trunkq8_{name}_{variant}_{simd.STAMP}")
    f.__qualname__ = f.__name__
    return njit(parallel=True, **_JIT)(f)


_DRIVERS: dict[tuple[str, str], object] = {}
_ONES: dict[int, np.ndarray] = {}


def _drive(name: str):
    v = headq8.variant()
    if v == "plain":
        raise RuntimeError("no int8 row kernel for this CPU target (headq8.variant() is 'plain')")
    if (name, v) not in _DRIVERS:
        _DRIVERS[(name, v)] = _driver(name, v)
    return _DRIVERS[(name, v)]


def _ones(rows: int) -> np.ndarray:
    """The head kernel's per-row scale, all 1 (x * 1 = x: no rounding)."""
    a = _ONES.get(rows)
    if a is None:
        a = _ONES[rows] = np.ones(rows, np.float32)
    return a


def _prepare(x: np.ndarray):
    """X (G, T, C) -> int8 (G, T, C), int32 (G, T, C/4), scales (G, T, C/32) (`headq8.prepare`)."""
    g, t, c = x.shape
    qa, da, xc = headq8.prepare(x.reshape(g * t, c))
    return qa.reshape(g, t, c), xc.reshape(g, t, c // 4), da.reshape(g, t, c // GROUP)


def matmul(w: QWeight, x: np.ndarray) -> np.ndarray:
    """X (T, C) float32 times an "i8" weight -> (T, R) float32."""
    x = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)
    qa, xc, da = _prepare(x[None])
    out = np.empty((x.shape[0], w.rows), np.float32)
    _drive("one")(w.data, _ones(w.rows), w.block[0], w.block[1], qa, xc, da, w.scale, w.rows, out)
    return out


def matmul_pair(w1: QWeight, w3: QWeight, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`matmul` of two "i8" weights of one shape and block, one parallel region, same bits."""
    x = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)
    qa, xc, da = _prepare(x[None])
    y1 = np.empty((x.shape[0], w1.rows), np.float32)
    y3 = np.empty((x.shape[0], w3.rows), np.float32)
    br, bc = w1.block
    _drive("pair")(w1.data, w1.scale, w3.data, w3.scale, _ones(w1.rows), br, bc, qa, xc, da, y1, y3)
    return y1, y3


def matmul_grouped(w: QWeight, x: np.ndarray) -> np.ndarray:
    """X (T, G, C): group i times rows i * R/G .. of one "i8" weight -> (T, R), one region; R/G a
    multiple of the block's rows. Each group's columns equal its own `matmul` bit for bit."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rpg = w.rows // x.shape[1]
    if rpg * x.shape[1] != w.rows or rpg % w.block[0]:
        raise ValueError(f"{x.shape[1]} groups of an int8 weight of {w.rows} rows, blocks {w.block}")
    qa, xc, da = _prepare(np.ascontiguousarray(x.transpose(1, 0, 2)))
    out = np.empty((x.shape[0], w.rows), np.float32)
    _drive("one")(w.data, _ones(w.rows), w.block[0], w.block[1], qa, xc, da, w.scale, rpg, out)
    return out


def set_threads(n: int) -> None:
    numba.set_num_threads(n)
