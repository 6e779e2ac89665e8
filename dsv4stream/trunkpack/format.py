"""The packed trunk's format, shared by its writer (`writer`) and its readers (`reader`, the runtime).

Owns: the constants (format marker, file names, alignments, checksum), the placement of
runs and tensors in trunk.bin (`plan_runs`), the manifest's fields (`manifest_dict`) and the
run checksums (`digest_run`, `fast_hash`). It writes nothing; `pack` does the packing.

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
else), the source checkpoint's fingerprint (`Catalog.fingerprint`), the plan id, `file` (the
plain name of the data file inside the pack folder, never a path), and per run: key, layer
(main index, null for model-level runs), offset, nbytes (padded), `blake2b` (blake2b-128 of all
nbytes bytes), `xxh3` (xxh3-64 of the same bytes), and its tensors (name, dtype, shape,
absolute offset in trunk.bin, nbytes, `xxh3` of the tensor's own bytes).

What each checksum is for (docs/security.md says what each proves): blake2b is cryptographic,
run by packing, `--verify`, `dsv4 inspect` and `dsv4 upgrade-trunk`; xxh3 is position-sensitive
and runs at memory speed, so every read of a run in every run is checked with it (a run read
whole against the run's sum; a run read in part, when --gpu keeps some of its matrices in
VRAM, against the sums of the tensors read). Format 1 had a plain sum of 64-bit words instead
of xxh3, blind to reordered blocks: such a pack is refused with the upgrade command.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from ..checkpoint.catalog import Catalog, TensorEntry
from ..checkpoint.spec import model_specs
from ..checkpoint.tensors import TensorSpec, layer_prefix
from ..errors import ReadError, ShortReadError
from ..store.directio import ALIGN  # runs are read with O_DIRECT: its alignment, defined once

FORMAT_FAMILY = "dsv4-trunk/"  # the marker that says a folder is a pack of ours, any version
FORMAT = FORMAT_FAMILY + "2"
UPGRADABLE = (FORMAT_FAMILY + "1",)  # older formats `dsv4 upgrade-trunk` rewrites in place
TRUNK_FILE = "trunk.bin"
HEAD_Q8_FILE = "head-q8.bin"  # the int8 head copy (`headcopy`), beside trunk.bin
MANIFEST = "manifest.json"
JOURNAL = "journal.jsonl"  # the staging folder's record of verified runs (resume)
TENSOR_ALIGN = 64
CHECKSUM = "blake2b-128"
FAST_CHECKSUM = "xxh3-64"
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


@dataclass(frozen=True)
class RunDigest:
    """The checksums of one run: blake2b-128 and xxh3-64 of all its bytes, xxh3-64 of each tensor."""

    blake2b: str
    xxh3: str
    tensors: dict[str, str]


def fast_hash(b) -> str:
    """xxh3-64 of a buffer, as 16 hex digits: the check run on every read."""
    return xxhash.xxh3_64_hexdigest(memoryview(b).cast("B"))


def plan_id(cat: Catalog, runs: list[PlannedRun]) -> str:
    h = hashlib.sha256(f"{FORMAT}|{cat.fingerprint}".encode())
    for r in runs:
        h.update(f"{r.key}|{r.offset}|{r.nbytes}|".encode())
        for t in r.tensors:
            h.update(f"{t.src.name}|{t.offset}|{t.src.nbytes}|".encode())
    return h.hexdigest()[:32]


def manifest_dict(cat: Catalog, runs: list[PlannedRun], digests: dict[str, RunDigest], layers: int, plan: str) -> dict:
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
        "fast_checksum": FAST_CHECKSUM,
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
                "blake2b": digests[r.key].blake2b,
                "xxh3": digests[r.key].xxh3,
                "tensors": [
                    {"name": t.src.name, "dtype": t.src.dtype, "shape": list(t.src.shape), "offset": t.offset,
                     "nbytes": t.src.nbytes, "xxh3": digests[r.key].tensors[t.src.name]}
                    for t in r.tensors
                ],
            }
            for r in runs
        ],
    }  # fmt: skip


def hash_range(
    fd: int, offset: int, nbytes: int, on_bytes: Callable[[int], None] | None = None, path: str = "trunk file"
) -> str:
    """blake2b-128 of nbytes of an open file from offset; a short file is an error."""
    return digest_run(fd, offset, nbytes, (), on_bytes, path).blake2b


def digest_run(
    fd: int,
    offset: int,
    nbytes: int,
    tensors: tuple[tuple[str, int, int], ...],
    on_bytes: Callable[[int], None] | None = None,
    path: str = "trunk file",
) -> RunDigest:
    """The checksums of nbytes of an open file from offset, in one pass of bounded memory;
    `tensors` are (name, absolute offset, nbytes) inside that range."""
    h, x = new_hash(), xxhash.xxh3_64()
    th = {name: xxhash.xxh3_64() for name, _, _ in tensors}
    done = 0
    while done < nbytes:
        try:
            b = os.pread(fd, min(CHUNK, nbytes - done), offset + done)
        except OSError as e:
            raise ReadError(f"{path}: {e.strerror} at byte {offset + done}; check the disk") from None
        if not b:
            raise ShortReadError(f"{path}: short read at byte {offset + done}: the file ends before the run does")
        a, z = offset + done, offset + done + len(b)
        h.update(b)
        x.update(b)
        for name, t0, tn in tensors:
            lo, hi = max(a, t0), min(z, t0 + tn)
            if lo < hi:
                th[name].update(memoryview(b)[lo - a : hi - a])
        done += len(b)
        if on_bytes:
            on_bytes(len(b))
    return RunDigest(h.hexdigest(), x.hexdigest(), {k: v.hexdigest() for k, v in th.items()})


def valid_file_name(name: object) -> bool:
    """The manifest's `file`: a plain file name (no folder part), so the data file is inside the pack."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and os.path.basename(name) == name
    )
