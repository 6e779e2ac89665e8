"""The packed trunk's format, shared by its writer (`writer`) and its readers (`reader`, the runtime).

Owns: the constants (format marker, file names, alignments, checksum), the placement of
runs and tensors in trunk.bin (`plan_runs`), the manifest's fields (`manifest_dict`) and the
run checksums (`word_sum`, `digest_range`). It writes nothing; `pack` does the packing.

Layout of `OUT_DIR/trunk.bin` (OUT_DIR defaults to `CHECKPOINT_DIR/dsv4-trunk`):
- One run per group, in model order: `embed` (embed.weight), `layers.L` for each packed
  main layer (all its dense tensors: norms, mHC, attention, compressor, indexer, gate,
  shared expert; V4.1's Engram wkv and q/k weights), `model` (norm, hc_head_* in V4), `head`
  (head.weight). Not packed, because nothing runs them: the mtp.* blocks (the preview's MTP
  block, the DSpark drafters of 0731 and V4.1) and V4.1's vision tower. Not packed because
  they are read by pieces: routed experts and V4.1's Engram tables (rows).
- Every run starts at a multiple of 4096 and its length is padded with zeros to a multiple
  of 4096, so one O_DIRECT read of (offset, nbytes) fetches it into an aligned buffer.
- Tensors inside a run start at multiples of 64 (zero padding between), so views into an
  aligned run buffer are aligned for any dtype and for SIMD loads.
- Bytes are copied unchanged from the shards (FP8, FP4-in-I8, E8M0, BF16, F32, I64): the
  pack is a relayout, never a conversion.

`manifest.json`: format (the `dsv4-trunk/` marker that tells a pack of ours from anything
else), the source checkpoint's fingerprint (`Catalog.fingerprint`), the plan id, and per
run: key, layer (main index, n_layers + k for MTP block k, null for model-level runs),
offset, nbytes (padded), blake2b-128 of all nbytes bytes, `sum64` (`word_sum`, the cheap
check run on every open), and its tensors (name, dtype, shape, absolute offset in
trunk.bin, nbytes).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..checkpoint.catalog import Catalog, TensorEntry
from ..checkpoint.spec import TensorSpec, layer_prefix, model_specs
from ..errors import ReadError, ShortReadError
from ..store.directio import ALIGN  # runs are read with O_DIRECT: its alignment, defined once

FORMAT_FAMILY = "dsv4-trunk/"  # the marker that says a folder is a pack of ours, any version
FORMAT = FORMAT_FAMILY + "1"
TRUNK_FILE = "trunk.bin"
MANIFEST = "manifest.json"
JOURNAL = "journal.jsonl"  # the staging folder's record of verified runs (resume)
TENSOR_ALIGN = 64
CHECKSUM = "blake2b-128"
CHUNK = 16 << 20  # read / copy granularity: bounds memory whatever the tensor size


def round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def new_hash() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=16)


@dataclass(frozen=True)
class PlannedTensor:
    src: TensorEntry
    offset: int  # absolute, in trunk.bin


@dataclass(frozen=True)
class PlannedRun:
    key: str
    layer: int | None
    offset: int
    nbytes: int  # padded to ALIGN
    tensors: tuple[PlannedTensor, ...]


def _run_key(cat: Catalog, s: TensorSpec) -> str:
    if s.layer is not None:
        return layer_prefix(cat.config, s.layer).rstrip(".")
    return s.role if s.role in ("embed", "head") else "model"


def plan_runs(cat: Catalog, layers: int | None = None) -> list[PlannedRun]:
    """The runs of a pack of `cat` with main layers 0..layers-1 (all when None), in file order."""
    cfg = cat.config
    n = cfg.n_layers if layers is None else layers
    groups: dict[str, list[TensorSpec]] = {}
    layer_of: dict[str, int | None] = {}
    for s in model_specs(cfg, with_experts=False):
        if s.layer is not None and s.layer >= min(n, cfg.n_layers):
            continue  # past the packed depth, or an mtp.* block (not run)
        if s.role == "vision":
            continue  # V4.1's vision tower: not run
        if s.name not in cat.entries:
            continue  # a scale that this weight's dtype does not have (validated before)
        k = _run_key(cat, s)
        groups.setdefault(k, []).append(s)
        layer_of[k] = s.layer
    runs, pos = [], 0
    for key, specs in groups.items():
        tensors, rel = [], 0
        for s in specs:
            rel = round_up(rel, TENSOR_ALIGN)
            e = cat.entries[s.name]
            tensors.append(PlannedTensor(e, pos + rel))
            rel += e.nbytes
        size = round_up(max(rel, 1), ALIGN)
        runs.append(PlannedRun(key, layer_of[key], pos, size, tuple(tensors)))
        pos += size
    return runs


def plan_id(cat: Catalog, runs: list[PlannedRun]) -> str:
    h = hashlib.sha256(f"{FORMAT}|{cat.fingerprint}".encode())
    for r in runs:
        h.update(f"{r.key}|{r.offset}|{r.nbytes}|".encode())
        for t in r.tensors:
            h.update(f"{t.src.name}|{t.offset}|{t.src.nbytes}|".encode())
    return h.hexdigest()[:32]


def manifest_dict(
    cat: Catalog, runs: list[PlannedRun], sums: dict[str, str], layers: int, plan: str, words: dict[str, str]
) -> dict:
    cfg = cat.config
    return {
        "format": FORMAT,
        "fingerprint": cat.fingerprint,
        "plan": plan,
        "source": str(cat.root.resolve()),
        "file": TRUNK_FILE,
        "file_bytes": runs[-1].offset + runs[-1].nbytes if runs else 0,
        "align": ALIGN,
        "tensor_align": TENSOR_ALIGN,
        "checksum": CHECKSUM,
        "n_layers": cfg.n_layers,
        "n_mtp": cfg.n_mtp,
        "layers_packed": layers,
        "complete": layers == cfg.n_layers,
        "runs": [
            {
                "key": r.key,
                "layer": r.layer,
                "offset": r.offset,
                "nbytes": r.nbytes,
                "blake2b": sums[r.key],
                "sum64": words[r.key],
                "tensors": [
                    {"name": t.src.name, "dtype": t.src.dtype, "shape": list(t.src.shape), "offset": t.offset,
                     "nbytes": t.src.nbytes}
                    for t in r.tensors
                ],
            }
            for r in runs
        ],
    }  # fmt: skip


def word_sum(b) -> int:
    """Sum of the little-endian uint64 words of `b` (zero-padded to 8 bytes), modulo 2**64.

    The cheap check run on every open: any single changed byte changes it, and numpy does it
    at memory speed (blake2b runs at a fraction of a GB/s per core)."""
    view = memoryview(b).cast("B")
    whole = len(view) // 8 * 8
    total = int(np.add.reduce(np.frombuffer(view[:whole], dtype="<u8"), dtype=np.uint64)) if whole else 0
    if whole < len(view):
        total += int.from_bytes(bytes(view[whole:]).ljust(8, b"\0"), "little")
    return total % (1 << 64)


def hash_range(
    fd: int, offset: int, nbytes: int, on_bytes: Callable[[int], None] | None = None, path: str = "trunk file"
) -> str:
    """blake2b-128 of nbytes of an open file from offset; a short file is an error."""
    return digest_range(fd, offset, nbytes, on_bytes, path)[0]


def digest_range(
    fd: int, offset: int, nbytes: int, on_bytes: Callable[[int], None] | None = None, path: str = "trunk file"
) -> tuple[str, str]:
    """(blake2b-128, word_sum as 16 hex digits) of nbytes from offset (a multiple of 8)."""
    h = new_hash()
    words = 0
    done = 0
    while done < nbytes:
        try:
            b = os.pread(fd, min(CHUNK, nbytes - done), offset + done)
        except OSError as e:
            raise ReadError(f"{path}: {e.strerror} at byte {offset + done}; check the disk") from None
        if not b:
            raise ShortReadError(f"{path}: short read at byte {offset + done}: the file ends before the run does")
        h.update(b)
        words += word_sum(b)
        done += len(b)
        if on_bytes:
            on_bytes(len(b))
    return h.hexdigest(), f"{words % (1 << 64):016x}"
