"""What the generators of both families share: random weights in the release dtypes, and
safetensors files whose routed experts may be sparse-file holes.

Owns: the generator options (`GENERATOR_OPTIONS`), the real vocabulary's size (`REAL_VOCAB`:
a preset with it gets the real tokenizer), `RandomWeights` (random values for each
`TensorSpec`, stored with the release dtype or the chosen override; FP8 / FP4 codes drawn
directly so a full-size dense trunk is quick to write), `Hole` (a tensor left as a sparse-file
hole: it reads as zeros and takes no disk) and `save_sparse` (a safetensors file written in
the library's order, or in the order given, with its holes unwritten).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint import formats
from ..checkpoint.config import ModelConfig
from ..checkpoint.formats import fp4_scale_shape
from ..checkpoint.tensors import ITEMSIZE, TensorSpec

REAL_VOCAB = 129280
GENERATOR_OPTIONS = (
    "scale_fmt",
    "dense_dtype",
    "compressor_dtype",
    "route_skew",
    "tokenizer",
    "expert_gain",
    "sparse_experts",
    "output_gain_log2",
)
# The projections whose outputs are added to the residual streams (`output_gain_log2` scales them).
OUTPUT_PROJECTIONS = (".attn.wo_b.weight", ".w2.weight", ".engram.wkv.weight")


@dataclass(frozen=True)
class Hole:
    """A tensor written as a sparse-file hole: it reads as zeros and takes no disk."""

    dtype: str  # safetensors dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


# safetensors writes tensors by dtype (this order) then by name; matching it keeps the
# release's layout (an expert's scales in one run, its weights in another far away).
_ST_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E8M0", "F8_E4M3", "I8", "U8")
_ST_DTYPE = {
    np.dtype(np.int64): "I64",
    np.dtype(np.float32): "F32",
    np.dtype(np.int32): "I32",
    np.dtype(formats.BF16): "BF16",
    np.dtype(formats.E8M0): "F8_E8M0",
    np.dtype(formats.E4M3): "F8_E4M3",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
}


def save_sparse(tensors: dict[str, np.ndarray | Hole], path: Path, keep_order: bool = False) -> None:
    """A safetensors file whose Hole tensors are left unwritten (sparse), the rest as the library
    would (by dtype, then name), or in the order given (keep_order)."""
    meta = {
        k: (v.dtype if isinstance(v, Hole) else _ST_DTYPE[v.dtype], tuple(v.shape), v.nbytes)
        for k, v in tensors.items()
    }
    order = list(meta) if keep_order else sorted(meta, key=lambda k: (_ST_ORDER.index(meta[k][0]), k))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for k in order:
        dt, shape, nb = meta[k]
        header[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + nb]}
        pos += nb
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for k in order:
            v = tensors[k]
            if isinstance(v, Hole):
                f.seek(v.nbytes, os.SEEK_CUR)
            else:
                f.write(memoryview(np.ascontiguousarray(v).view(np.uint8)).cast("B"))
        f.truncate(8 + len(raw) + pos)


class RandomWeights:
    """Random values for each spec, stored with the release dtype (or the chosen override)."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator, opts: dict[str, Any], codes: bool = False):
        self.cfg = cfg
        self.rng = rng
        # codes: large FP8 and BF16 tensors drawn as codes of a normal's quantiles (one byte of
        # randomness per value, no float pass): what makes a 10 GB dense trunk quick to write.
        self.codes = codes
        self.scale_fmt = opts["scale_fmt"] or "ue8m0"
        self.dense = opts["dense_dtype"] or "fp8"
        self.comp = opts["compressor_dtype"] or "bf16"
        self.skew = float(opts["route_skew"] or 0.0)
        self.expert_gain = float(opts["expert_gain"] or 1.0)
        self.sparse = bool(opts["sparse_experts"])
        self.output_shift = int(opts["output_gain_log2"] or 0)
        self._pending_scale: dict[str, np.ndarray] = {}
        e = cfg.n_routed_experts
        # Expert popularity ranks, fixed per checkpoint so every layer has its favourites.
        self.popularity = -self.skew * np.log1p(rng.permutation(e)).astype(np.float32)
        self._popularity = {e: self.popularity}

    def tensor(self, s: TensorSpec) -> np.ndarray | Hole | None:
        if s.kind == "scale":
            sc = self._pending_scale.pop(s.of, None)
            if self.output_shift and sc is not None and not isinstance(sc, Hole) and s.of.endswith(OUTPUT_PROJECTIONS):
                sc = _times_pow2(sc, self.output_shift)
            return sc
        if s.kind == "expert":
            return self._expert(s)
        if s.kind == "linear":
            return (
                self._codes_fp8(s) if self.codes and self.dense == "fp8" and s.dtypes[0] != "BF16" else self._linear(s)
            )
        if s.kind == "table":
            return self._table(s)
        return self._plain(s)

    def popularity_of(self, n: int) -> np.ndarray:
        """Popularity of `n` experts (the DSpark stages of V4.1 have their own count)."""
        if n not in self._popularity:
            self._popularity[n] = -self.skew * np.log1p(self.rng.permutation(n)).astype(np.float32)
        return self._popularity[n]

    def _table(self, s: TensorSpec) -> np.ndarray | Hole:
        """An Engram table: FP8 rows with an E8M0 (or F32) scale per 32 columns."""
        rows, cols = s.shape
        sdt = "F8_E8M0" if self.scale_fmt == "ue8m0" else "F32"
        if self.sparse:
            self._pending_scale[s.name] = Hole(sdt, fp4_scale_shape(rows, cols))  # type: ignore[assignment]
            return Hole("F8_E4M3", (rows, cols))
        w = self.rng.standard_normal((rows, cols), dtype=np.float32)
        q, sc = formats.quantize_fp8(w.reshape(rows * cols // 32, 32), self.scale_fmt, (1, 32))
        self._pending_scale[s.name] = _as_scale(sc.reshape(rows, cols // 32))
        return q.reshape(rows, cols).view(formats.E4M3)

    def _codes_fp8(self, s: TensorSpec) -> np.ndarray:
        """FP8 codes of N(0, 1) quantiles x 16 with 32x32 power-of-two scales near std / 16."""
        rows, cols = s.shape
        out = np.empty((rows, cols), np.uint8)
        for a in range(0, rows, 4096):
            b = min(rows, a + 4096)
            out[a:b] = _E4M3_NORMAL[self.rng.integers(0, 256, size=(b - a, cols), dtype=np.uint8)]
        br, bc = self.cfg.fp8_block
        shape = (-(-rows // br), -(-cols // bc))
        e = np.round(np.log2(self._std(cols) / 16)) + self.rng.integers(-1, 2, size=shape)
        if self.scale_fmt == "ue8m0":
            sc = (np.clip(e, -127, 127) + 127).astype(np.uint8).view(formats.E8M0)
        else:
            sc = np.exp2(e).astype(np.float32)
        self._pending_scale[s.name] = sc
        return out.view(formats.E4M3)

    def _std(self, cols: int) -> float:
        return 1.0 / math.sqrt(cols)

    def _linear(self, s: TensorSpec) -> np.ndarray:
        rows, cols = s.shape
        bf16_default = s.dtypes[0] == "BF16"
        kind = self.comp if bf16_default else self.dense
        if bf16_default and kind == "bf16":
            kind = "bf16"
        w = self.rng.standard_normal((rows, cols), dtype=np.float32) * self._std(cols)
        if kind == "fp8":
            q, sc = formats.quantize_fp8(w, self.scale_fmt, self.cfg.fp8_block)
            self._pending_scale[s.name] = _as_scale(sc)
            return q.view(formats.E4M3)
        if kind == "f32":
            return w
        return w.astype(formats.BF16)

    def _expert(self, s: TensorSpec) -> np.ndarray | Hole:
        rows, cols = s.shape
        if self.sparse and self.cfg.expert_dtype == "fp4":
            scale = Hole("F8_E8M0" if self.scale_fmt == "ue8m0" else "F32", fp4_scale_shape(rows, cols))
            self._pending_scale[s.name] = scale  # type: ignore[assignment]
            return Hole("I8", (rows, cols // 2))
        std = self._std(cols) * self.expert_gain
        if self.cfg.expert_dtype == "fp8":
            w = self.rng.standard_normal((rows, cols), dtype=np.float32) * std
            q, sc = formats.quantize_fp8(w, self.scale_fmt, self.cfg.fp8_block)
            self._pending_scale[s.name] = _as_scale(sc)
            return q.view(formats.E4M3)
        # Random E2M1 codes directly (all 16 are valid): cheap at Flash size. Uniform codes
        # have rms 2.93, so per-block scales around std / 2.93, jittered by one binade.
        packed = self.rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
        nb = cols // formats.FP4_BLOCK
        base = std / 2.93
        if self.scale_fmt == "ue8m0":
            e = np.round(np.log2(base)) + self.rng.integers(-1, 2, size=(rows, nb))
            sc = (np.clip(e, -127, 127) + 127).astype(np.uint8).view(formats.E8M0)
        else:
            sc = (base * np.exp2(self.rng.uniform(-1, 1, size=(rows, nb)))).astype(np.float32)
        self._pending_scale[s.name] = sc
        return packed.view(np.int8)

    def _plain(self, s: TensorSpec) -> np.ndarray:
        name, shape, rng = s.name, s.shape, self.rng
        if name.endswith("tid2eid"):
            return self._tid2eid(shape)
        if name.endswith(("gate.bias", "gate.bias_vl")):
            v = self.popularity_of(shape[0]) + rng.standard_normal(shape, dtype=np.float32) * 0.01
        elif name.endswith(("norm.weight", "engram.q_weight", "engram.k_weight")):
            v = 1.0 + rng.standard_normal(shape, dtype=np.float32) * 0.1
        elif "hc_" in name and name.endswith("_fn"):
            v = rng.standard_normal(shape, dtype=np.float32) * (0.5 / math.sqrt(shape[1]))
        elif "hc_" in name and name.endswith("_scale"):
            v = 0.5 + rng.random(shape, dtype=np.float32)
        elif "hc_" in name and name.endswith("_base"):
            v = rng.standard_normal(shape, dtype=np.float32) * 0.5
        elif name.endswith("attn_sink"):
            v = rng.standard_normal(shape, dtype=np.float32)
        elif name.endswith("ape"):
            v = rng.standard_normal(shape, dtype=np.float32) * 0.5
        elif name.endswith("gate.weight"):
            v = rng.standard_normal(shape, dtype=np.float32) * self._std(shape[1]) * 2.0
        else:  # embed, head, Markov head, vision: row blocks bound the float32 temporary at full size
            std = 1.0 if name == "embed.weight" else self._std(shape[-1])
            out = np.empty(shape, formats.BF16 if s.dtypes[0] == "BF16" else np.float32)
            for a in range(0, shape[0], 8192):
                b = min(shape[0], a + 8192)
                if self.codes and out.dtype == formats.BF16:
                    idx = rng.integers(0, 256, size=(b - a, *shape[1:]), dtype=np.uint8)
                    out[a:b] = (_NORMAL_QUANTILES * std).astype(formats.BF16)[idx]
                else:
                    out[a:b] = rng.standard_normal((b - a, *shape[1:]), dtype=np.float32) * std
            return out
        return v.astype(formats.BF16) if s.dtypes[0] == "BF16" else v.astype(np.float32)

    def _tid2eid(self, shape: tuple[int, ...]) -> np.ndarray:
        """Distinct experts per token, drawn with the same popularity skew (Gumbel top-k)."""
        vocab, k = shape
        e = self.cfg.n_routed_experts
        out = np.empty((vocab, k), dtype=np.int64)
        step = max(1, (1 << 22) // e)
        for a in range(0, vocab, step):
            b = min(vocab, a + step)
            keys = self.popularity[None, :] + self.rng.gumbel(size=(b - a, e)).astype(np.float32)
            out[a:b] = np.argsort(-keys, axis=1, kind="stable")[:, :k]
        return out


# 256 quantiles of N(0, 1) (midpoints of 256 equal-probability bins), and their E4M3 codes at x16.
_NORMAL_QUANTILES = np.sort(np.random.default_rng(0).standard_normal(1 << 16, dtype=np.float32))[128::256]
_E4M3_NORMAL = (_NORMAL_QUANTILES * 16).astype(formats.E4M3).view(np.uint8)


def _times_pow2(sc: np.ndarray, k: int) -> np.ndarray:
    """A scale array times 2^k, exactly: E8M0 exponents moved by k (kept finite), F32 multiplied."""
    if sc.dtype == formats.E8M0:
        e = sc.view(np.uint8).astype(np.int32) + k
        return np.clip(e, 0, 254).astype(np.uint8).view(formats.E8M0)
    return (sc * np.float32(2.0**k)).astype(np.float32)


def _as_scale(sc: np.ndarray) -> np.ndarray:
    return sc.view(formats.E8M0) if sc.dtype == np.uint8 else sc
