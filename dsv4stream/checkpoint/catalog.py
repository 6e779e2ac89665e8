"""Where every tensor of an official checkpoint lives, read from the shard headers only.

Owns: parsing safetensors headers (8-byte little-endian header length, JSON header, data)
into `TensorEntry` records with absolute file offsets; cross-checking the index file;
validating the catalog against the tensors the config implies (`spec.model_specs`); and
small reads of whole tensors or row ranges for loaders. It never maps whole shards: the
expert store reads its own byte runs.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np

from .. import jsonio
from ..errors import CheckpointError, ReadError, ShortReadError
from ..files import kind_of
from .config import DSPARK, DSPARK_V41, LAYOUTS, PREVIEW, ModelConfig
from .formats import QWeight
from .spec import model_specs
from .spec_v4 import MTP_EXTRAS
from .tensors import ITEMSIZE, MTP, TensorSpec, is_drafter, linear_names

INDEX_NAME = "model.safetensors.index.json"
NP_DTYPE = {
    "F8_E4M3": np.uint8,
    "F8_E8M0": np.uint8,
    "I8": np.uint8,  # FP4 packed pairs: raw bytes
    "U8": np.uint8,
    "BF16": np.uint16,
    "F16": np.float16,
    "F32": np.float32,
    "I32": np.int32,
    "I64": np.int64,
}
_MAX_HEADER = jsonio.HEADER_MAX


@dataclass(frozen=True)
class TensorEntry:
    name: str
    path: str
    offset: int  # absolute byte offset of the data in `path`
    nbytes: int
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def regular_file(path: Path, what: str) -> os.stat_result:
    """stat of `path`, refusing anything but a regular file before it is opened (a FIFO would hang)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: {what} is {kind_of(st.st_mode)}, not a regular file; replace it")
    return st


def _offsets(info: dict) -> tuple[tuple[int, ...], int, int] | None:
    """(shape, begin, end) when shape is a list of non-negative ints and data_offsets two ints."""
    shape, offs = info.get("shape", ()), info.get("data_offsets")
    ints = lambda xs: isinstance(xs, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in xs)
    if not (ints(shape) and ints(offs) and len(offs) == 2) or any(x < 0 for x in shape):
        return None
    return tuple(shape), offs[0], offs[1]


def read_header(path: Path) -> list[TensorEntry]:
    """Parse one shard's header; refuse unknown dtypes, tensors outside the data section, and
    tensors whose bytes overlap (each tensor must own its bytes)."""
    size = regular_file(path, "the shard").st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: file is {size} bytes, too short for a safetensors header; re-download it")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{path}: header length {n} does not fit a {size}-byte file; the shard is truncated or not safetensors"
            )
        header = jsonio.parse_json(
            f.read(n), f"{path}: the safetensors header", CheckpointError, _MAX_HEADER, fix="re-download this shard"
        )
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object; the file is not safetensors — re-download it")
    base = 8 + n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info.get("dtype") if isinstance(info, dict) else None
        if dt not in NP_DTYPE:
            raise CheckpointError(
                f"{path}: tensor '{name}' has unsupported dtype {dt!r}; expected one of {sorted(NP_DTYPE)}"
            )
        got = _offsets(info)
        if got is None:
            raise CheckpointError(
                f"{path}: tensor '{name}' has a malformed shape or data_offsets (need non-negative integers);"
                " re-download this shard"
            )
        shape, b, e = got
        if not 0 <= b <= e:
            raise CheckpointError(
                f"{path}: tensor '{name}' has data_offsets [{b}, {e}]: outside the data section; re-download this shard"
            )
        want = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dt]
        if e - b != want:
            raise CheckpointError(f"{path}: tensor '{name}' spans {e - b} bytes but {dt} {list(shape)} needs {want}")
        if base + e > size:
            raise CheckpointError(
                f"{path}: tensor '{name}' ends at byte {base + e} but the file has {size} bytes — "
                "the shard is truncated; re-download it"
            )
        out.append(TensorEntry(name, str(path), base + b, e - b, dt, shape))
    _check_disjoint(path, out)
    return out


def _check_disjoint(path: Path, entries: list[TensorEntry]) -> None:
    prev = None
    for t in sorted(entries, key=lambda t: (t.offset, t.end)):
        if prev is not None and t.offset < prev.end and t.nbytes and prev.nbytes:
            raise CheckpointError(
                f"{path}: tensors '{prev.name}' (bytes {prev.offset}..{prev.end}) and '{t.name}'"
                f" (bytes {t.offset}..{t.end}) overlap; the header is corrupt — re-download this shard"
            )
        if prev is None or t.end > prev.end:
            prev = t


class Catalog:
    """Read-only map: tensor name -> TensorEntry, for one checkpoint directory."""

    def __init__(self, root: Path, config: ModelConfig, entries: dict[str, TensorEntry]):
        self.root = root
        self.config = config
        self.entries = entries

    @classmethod
    def open(cls, ckpt_dir: str | os.PathLike) -> Catalog:
        root = Path(ckpt_dir)
        if not root.is_dir():
            raise CheckpointError(
                f"{root}: checkpoint directory not found; pass the folder holding config.json and *.safetensors"
            )
        config = ModelConfig.from_json(root / "config.json")
        shards = sorted(root.glob("*.safetensors"))
        index = _read_index(root)
        if not shards:
            raise CheckpointError(f"{root}: no *.safetensors shards; download the checkpoint's shards into this folder")
        if index is not None:
            missing = sorted({f for f in index.values()} - {s.name for s in shards})
            if missing:
                raise CheckpointError(
                    f"{root}: {INDEX_NAME} names {len(missing)} missing shard(s), first {missing[0]}; download them"
                )
        entries: dict[str, TensorEntry] = {}
        for shard in shards:
            for e in read_header(shard):
                if e.name in entries:
                    raise CheckpointError(
                        f"{shard}: tensor '{e.name}' also appears in {entries[e.name].path}; remove the stray shard"
                    )
                entries[e.name] = e
        if index is not None:
            _check_index(root, index, entries)
        return cls(root, config, entries)

    # ---- validation ------------------------------------------------------------
    def problems(self, specs: Iterable[TensorSpec] | None = None) -> list[str]:
        """Every mismatch between the checkpoint and what the config implies."""
        cfg = self.config
        whole = specs is None
        if whole:
            too_many = self._count_problem()
            if too_many:  # listing that many expected names would itself be the runaway
                return [too_many]
        specs = list(model_specs(cfg)) if specs is None else list(specs)
        by_name = {s.name: s for s in specs}
        out: list[str] = self._layout_problems(by_name) if whole else []
        scale_dtype = "F8_E8M0" if cfg.scale_fmt == "ue8m0" else "F32"  # quantization_config.scale_fmt
        for s in specs:
            if s.kind == "scale":
                w = self.entries.get(s.of or "")
                ws = by_name.get(s.of or "")
                want = ws.scale_shape(w.dtype, cfg.fp8_block) if w and ws else None
                e = self.entries.get(s.name)
                if want is None:
                    if e is not None and w is not None:
                        out.append(f"'{s.name}': unexpected scale for a {w.dtype} weight")
                    continue
                if e is None:
                    out.append(f"'{s.name}': missing (needed by {w.dtype} '{s.of}')")
                elif e.dtype != scale_dtype:
                    out.append(
                        f"'{s.name}': dtype {e.dtype}, expected {scale_dtype}"
                        f" (quantization_config.scale_fmt {cfg.scale_fmt if cfg.scale_fmt == 'ue8m0' else 'null'})"
                    )
                elif e.shape != want:
                    out.append(f"'{s.name}': shape {list(e.shape)}, expected {list(want)}")
                continue
            e = self.entries.get(s.name)
            if e is None:
                out.append(f"'{s.name}': missing")
            elif e.dtype not in s.dtypes:
                out.append(f"'{s.name}': dtype {e.dtype}, expected one of {'/'.join(s.dtypes)}")
            elif e.shape != s.stored_shape(e.dtype):
                out.append(f"'{s.name}': shape {list(e.shape)}, expected {list(s.stored_shape(e.dtype))}")
        return out

    def _count_problem(self) -> str | None:
        """Refuse, before listing a single expected name, a config that implies far more tensors
        than the shards hold (e.g. n_routed_experts 4096 against a 256-expert checkpoint)."""
        cfg = self.config
        want = implied_tensor_count(cfg)
        if want <= len(self.entries):
            return None
        return (
            f"config.json implies at least {want:,} tensors ({cfg.n_layers} layers, {cfg.n_routed_experts} routed"
            f" experts each) but the shards hold {len(self.entries):,}"
        )

    def _layout_problems(self, expected: dict[str, TensorSpec]) -> list[str]:
        """The mtp.* layout the shards show against the config's, and tensors nobody expects."""
        out = []
        found, want = tensor_layout(self.entries), self.config.layout
        if found != want:
            out.append(
                f"the shards hold {LAYOUTS.get(found, found)} but config.json describes {LAYOUTS[want]}"
                " (config.json belongs to another release)"
            )
        unexpected = sorted(set(self.entries) - set(expected))
        if unexpected:
            out.append(
                f"{len(unexpected)} tensor(s) that config.json does not describe, first '{unexpected[0]}'"
                f" (expected {LAYOUTS[want]})"
            )
        return out

    def validate(self) -> None:
        p = self.problems()
        if p:
            more = f" (and {len(p) - 5} more)" if len(p) > 5 else ""
            raise CheckpointError(
                f"{self.root}: {len(p)} tensor problem(s) against config.json: "
                + "; ".join(p[:5])
                + more
                + " — check that config.json belongs to these shards (run `dsv4 inspect` for the full list)"
            )

    @cached_property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    @cached_property
    def fingerprint(self) -> str:
        """Identity of the checkpoint from its headers (names, dtypes, shapes, offsets, sizes)."""
        import hashlib

        h = hashlib.sha256()
        for name in sorted(self.entries):
            e = self.entries[name]
            h.update(f"{name}|{Path(e.path).name}|{e.offset}|{e.nbytes}|{e.dtype}|{e.shape}\n".encode())
        return h.hexdigest()[:32]

    # ---- reads ------------------------------------------------------------------
    def entry(self, name: str) -> TensorEntry:
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError(f"{self.root}: tensor '{name}' is missing; the checkpoint is incomplete")
        return e

    def read(self, name: str) -> np.ndarray:
        """The tensor's raw values (see NP_DTYPE); no conversion."""
        return read_entry(self.entry(name))

    def read_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Selected rows of a 2-D tensor, reading only those rows (embedding lookups)."""
        e = self.entry(name)
        dt = np.dtype(NP_DTYPE[e.dtype])
        row_bytes = int(np.prod(e.shape[1:], dtype=np.int64)) * dt.itemsize
        out = np.empty((len(rows),) + e.shape[1:], dtype=dt)
        fd = os.open(e.path, os.O_RDONLY)
        try:
            for i, r in enumerate(np.asarray(rows, dtype=np.int64)):
                if not 0 <= r < e.shape[0]:
                    raise CheckpointError(f"'{name}': row {r} outside 0..{e.shape[0] - 1}")
                try:
                    b = os.pread(fd, row_bytes, e.offset + int(r) * row_bytes)
                except OSError as err:
                    raise ReadError(f"{e.path}: {err.strerror} reading '{name}' row {r}; check the disk") from None
                if len(b) != row_bytes:
                    raise ShortReadError(f"{e.path}: short read of '{name}' row {r}; the shard is truncated")
                out[i] = np.frombuffer(b, dtype=dt).reshape(e.shape[1:])
        finally:
            os.close(fd)
        return out

    def has(self, name: str) -> bool:
        return name in self.entries

    def qweight(self, prefix: str) -> QWeight:
        """A linear weight `prefix.weight` (+ `prefix.scale`) in whatever dtype it ships."""
        return linear_of(self, prefix)

    def f32(self, name: str) -> np.ndarray:
        """A small tensor (norms, mHC, sinks, ape, bias) as float32."""
        return vector_of(self, name)


class TensorSource(Protocol):
    """What building named weights reads (`weights.loading`): the catalog, the views into a
    streamed trunk slot (`streaming.ring.ViewSource`) or a source that serves VRAM copies
    (`gpu.trunk.PlacedSource`). `qweight` / `f32` translate stored tensors; the catalog and the
    slot views do it with `linear_of` / `vector_of`."""

    config: ModelConfig

    def entry(self, name: str) -> TensorEntry: ...

    def read(self, name: str) -> np.ndarray: ...

    def has(self, name: str) -> bool: ...

    def qweight(self, prefix: str) -> QWeight: ...

    def f32(self, name: str) -> np.ndarray: ...


def linear_of(src: TensorSource, prefix: str) -> QWeight:
    """The linear `prefix.weight` (+ `prefix.scale`) of `src` as a QWeight: FP8 (with the config's
    scale block), FP4 (I8 pairs), BF16 or float32, by its stored dtype."""
    weight, scale = linear_names(prefix)
    w = src.entry(weight)
    data = src.read(w.name)
    if w.dtype in ("F8_E4M3", "I8"):
        s = src.entry(scale)
        scale = src.read(s.name)
        if w.dtype == "I8":
            return QWeight("fp4", data, scale, w.shape[0], w.shape[1] * 2)
        return QWeight("fp8", data, scale, w.shape[0], w.shape[1], block=src.config.fp8_block)
    if w.dtype == "BF16":
        return QWeight("bf16", data, None, w.shape[0], w.shape[1])
    return QWeight("f32", data.astype(np.float32, copy=False), None, w.shape[0], w.shape[1])


def vector_of(src: TensorSource, name: str) -> np.ndarray:
    """A small tensor of `src` (norms, mHC, sinks, biases) as float32."""
    from .formats import bf16_to_f32

    e = src.entry(name)
    a = src.read(name)
    return bf16_to_f32(a) if e.dtype == "BF16" else a.astype(np.float32, copy=False)


def implied_tensor_count(cfg: ModelConfig) -> int:
    """A lower bound of the tensors config.json implies, counted without listing the routed
    experts (a bounded listing of the rest, plus six tensors per expert)."""
    n = 0
    for s in model_specs(cfg, with_experts=False):
        n += s.kind != "scale"
    for layer in range(cfg.n_layers + cfg.n_mtp):
        n += 6 * cfg.experts_of(layer)[0]
    if cfg.engram is not None:
        n += 2 * len(cfg.engram.layer_ids)
    return n


# One tensor that only each layout's mtp.* blocks hold (see spec.MTP_EXTRAS, spec_v41.MTP_EXTRAS_V41):
# V4.1's Markov head is `markov_head.embed`/`head` (0731's is `markov_w1`/`markov_w2`), in its last stage.
_LAYOUT_MARKERS = {layout: linear_names(f"{MTP}.0.{MTP_EXTRAS[layout][0][1]}")[0] for layout in (PREVIEW, DSPARK)}
_V41_MARKER = ".markov_head.embed.weight"


def tensor_layout(entries: Iterable[str]) -> str | None:
    """The mtp.* layout the shards themselves show: PREVIEW, DSPARK, DSPARK_V41, None (no mtp.*
    tensor), or "unrecognised mtp.* tensors" when they hold none of them."""
    names = set(entries)
    drafter = [n for n in names if is_drafter(n)]
    if any(n.endswith(_V41_MARKER) for n in drafter):
        return DSPARK_V41
    for layout, marker in _LAYOUT_MARKERS.items():
        if marker in names:
            return layout
    return "unrecognised mtp.* tensors" if drafter else None


def pread_exact(path: str, offset: int, buf, what: str) -> None:
    """Fill `buf` (a writable buffer) with the bytes of `path` from `offset`; a short read is
    a ShortReadError naming `what` (the file is truncated)."""
    view = memoryview(buf).cast("B")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ReadError(f"{path}: cannot open ({e.strerror}) to read {what}") from None
    try:
        got = 0
        while got < len(view):
            try:
                n = os.preadv(fd, [view[got:]], offset + got)
            except OSError as e:
                raise ReadError(f"{path}: {e.strerror} reading {what} at byte {offset + got}; check the disk") from None
            if n <= 0:
                raise ShortReadError(f"{path}: short read of {what} at byte {offset + got}; the file is truncated")
            got += n
    finally:
        os.close(fd)


def read_entry(e: TensorEntry) -> np.ndarray:
    """One whole tensor's raw values (see NP_DTYPE), read with pread."""
    buf = bytearray(e.nbytes)
    pread_exact(e.path, e.offset, buf, f"'{e.name}'")
    return np.frombuffer(buf, dtype=NP_DTYPE[e.dtype]).reshape(e.shape)


def _read_index(root: Path) -> dict[str, str] | None:
    p = root / INDEX_NAME
    if not p.exists() and not p.is_symlink():
        return None
    d = jsonio.read_json(p, "the index", CheckpointError, jsonio.INDEX_MAX, fix="re-download it or delete it")
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(
            f'{p}: not a valid index file (no "weight_map" object of tensor name -> shard file name);'
            " re-download it or delete it"
        )
    return dict(wm)


def _check_index(root: Path, index: dict[str, str], entries: dict[str, TensorEntry]) -> None:
    diffs = []
    for name, shard in index.items():
        e = entries.get(name)
        if e is None:
            diffs.append(f"'{name}' listed in {shard} but found in no shard")
        elif Path(e.path).name != shard:
            diffs.append(f"'{name}' listed in {shard} but found in {Path(e.path).name}")
    extra = [n for n in entries if n not in index]
    if extra:
        diffs.append(f"{len(extra)} tensor(s) in shards but not in the index, first '{extra[0]}'")
    if diffs:
        raise CheckpointError(
            f"{root}: {INDEX_NAME} disagrees with the shard headers: "
            + "; ".join(diffs[:3])
            + (f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else "")
            + " — re-download the index or the shards"
        )
