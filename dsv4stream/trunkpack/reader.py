"""Loader of a packed trunk (written by `pack.pack_trunk`): manifest checks, runs, raw tensors.

Owns: refusing a pack that does not belong to the checkpoint (fingerprint of the shard
headers, plus a byte comparison of one small tensor per run against the shards, which
also tells apart checkpoints with identical shapes such as a base and a chat model);
checksums of runs (on every `read_run`, or all at once with `verify`); raw tensor arrays
by name with the same dtypes as `Catalog.read` (uint8 for F8/I8, uint16 for BF16, ...).

It does not convert or place weights: the trunk owner turns these arrays into named
weights, and the store may read a layer's run itself (path, offset, nbytes: all multiples
of 4096) with O_DIRECT. A partial pack (`complete` False) holds the model-level runs and
main layers below `layers_packed`; `has(name)` says whether to read a tensor from here or
from the shards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np

from .. import jsonio
from ..checkpoint.catalog import NP_DTYPE, Catalog, pread_exact
from ..errors import CheckpointError, ReadError
from .format import ALIGN, FORMAT, MANIFEST, hash_range, word_sum
from .packdir import default_out_dir, staging_dir

CHECK_CHUNK = 16 << 20  # bytes read at a time by check_words: bounds its memory
PROBE_BYTES = 32 << 10  # per run, compared with the shards at open: cheap, yet tells twins apart


@dataclass(frozen=True)
class TrunkTensor:
    name: str
    dtype: str  # safetensors dtype string, as in the checkpoint
    shape: tuple[int, ...]
    offset: int  # absolute, in the trunk file
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(NP_DTYPE[self.dtype])


@dataclass(frozen=True)
class TrunkRun:
    key: str  # "embed", "layers.L", "model", "head", "mtp.K"
    layer: int | None  # main layer, n_layers + k for MTP block k, None for model-level runs
    path: str
    offset: int  # multiple of 4096
    nbytes: int  # multiple of 4096; the checksum covers all of it
    checksum: str  # blake2b-128 hex
    tensors: tuple[TrunkTensor, ...]
    sum64: str | None = None  # format.word_sum as 16 hex digits; None in packs written before it

    @property
    def what(self) -> str:
        return f"run '{self.key}'" + (f" (layer {self.layer})" if self.layer is not None else "")


def _restart(root: Path) -> str:
    return f"delete {root} and run `dsv4 pack-trunk` again"


class TrunkFile:
    """A packed trunk, checked against the checkpoint it claims to come from."""

    def __init__(self, root: Path, manifest: dict, runs: dict[str, TrunkRun]):
        self.root = root
        self.manifest = manifest
        self.runs = runs
        self.path = str(root / manifest["file"])
        self.complete: bool = bool(manifest["complete"])
        self.layers_packed: int = int(manifest["layers_packed"])
        self._tensors = {t.name: (t, r.key) for r in runs.values() for t in r.tensors}
        self._by_layer = {r.layer: r for r in runs.values() if r.layer is not None}
        self._mm: np.memmap | None = None
        self._checked: set[str] = set()  # runs whose bytes passed a check in this process

    # ---- opening ---------------------------------------------------------------------
    @classmethod
    def open(cls, out_dir: str | os.PathLike, catalog: Catalog, verify: bool = False) -> TrunkFile:
        """Open OUT_DIR's pack for `catalog`; verify=True also checks every run's checksum now."""
        root = Path(out_dir)
        mpath = root / MANIFEST
        if not mpath.is_file():
            unfinished = staging_dir(root).exists()
            raise CheckpointError(
                f"{root}: no packed trunk here (manifest.json missing"
                + ("; an interrupted pack is in " + str(staging_dir(root)) if unfinished else "")
                + f"); run `dsv4 pack-trunk {catalog.root} {root}`"
            )
        m = jsonio.read_json(mpath, "the pack manifest", CheckpointError, jsonio.MANIFEST_MAX, fix=_restart(root))
        try:
            runs = {
                d["key"]: TrunkRun(
                    d["key"],
                    d["layer"],
                    str(root / m["file"]),
                    int(d["offset"]),
                    int(d["nbytes"]),
                    d["blake2b"],
                    tuple(
                        TrunkTensor(t["name"], t["dtype"], tuple(t["shape"]), int(t["offset"]), int(t["nbytes"]))
                        for t in d["tensors"]
                    ),
                    d.get("sum64"),
                )
                for d in m["runs"]
            }
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{mpath}: unreadable manifest ({e}); {_restart(root)}") from None
        if m.get("format") != FORMAT:
            raise CheckpointError(
                f"{mpath}: format {m.get('format')!r}, this dsv4stream reads {FORMAT!r}; {_restart(root)}"
            )
        if m.get("fingerprint") != catalog.fingerprint:
            raise CheckpointError(
                f"{root}: trunk was packed from a different checkpoint (fingerprint {m.get('fingerprint')},"
                f" {catalog.root} has {catalog.fingerprint}); pack this checkpoint with"
                f" `dsv4 pack-trunk {catalog.root} OUT_DIR` or pass the right --trunk"
            )
        tf = cls(root, m, runs)
        tf._check_file()
        tf._check_against(catalog)
        if verify:
            tf.verify()
        else:
            # the embedding is only ever read row by row, so no later read can check it whole
            tf.check_words([k for k in ("embed",) if k in tf.runs])
        return tf

    def _check_file(self) -> None:
        try:
            size = os.stat(self.path).st_size
        except OSError:
            raise CheckpointError(f"{self.path}: trunk file missing; {_restart(self.root)}") from None
        if size != self.manifest.get("file_bytes"):
            raise CheckpointError(
                f"{self.path}: {size} bytes, manifest says {self.manifest.get('file_bytes')} — the trunk is truncated"
                f" or replaced; {_restart(self.root)}"
            )
        end = 0
        for r in sorted(self.runs.values(), key=lambda r: r.offset):
            if r.offset % ALIGN or r.nbytes % ALIGN or r.offset < end or r.offset + r.nbytes > size:
                raise CheckpointError(
                    f"{self.path}: {r.what} is misplaced in the manifest (overlaps another run or lies past"
                    f" the end of the file); {_restart(self.root)}"
                )
            end = r.offset + r.nbytes
            pos = r.offset
            for t in sorted(r.tensors, key=lambda t: t.offset):
                want = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(NP_DTYPE.get(t.dtype, np.uint8)).itemsize
                if t.dtype not in NP_DTYPE or t.offset < pos or t.offset + t.nbytes > end or t.nbytes != want:
                    raise CheckpointError(
                        f"{self.path}: tensor '{t.name}' of {r.what} is misplaced or mis-sized in the manifest;"
                        f" {_restart(self.root)}"
                    )
                pos = t.offset + t.nbytes

    def _check_against(self, cat: Catalog) -> None:
        """Names, dtypes and shapes as in the shards; and one small tensor per run byte for byte."""
        for r in self.runs.values():
            for t in r.tensors:
                e = cat.entries.get(t.name)
                if e is None or (e.dtype, e.shape, e.nbytes) != (t.dtype, t.shape, t.nbytes):
                    raise CheckpointError(
                        f"{self.root}: '{t.name}' in the trunk does not match the checkpoint; {_restart(self.root)}"
                    )
            # one small tensor per run (a head and a tail slice of embed/head), compared with the shards
            probe = min(r.tensors, key=lambda t: (t.nbytes, t.name))
            e = cat.entries[probe.name]
            n = min(probe.nbytes, PROBE_BYTES)
            for at in sorted({0, probe.nbytes - n}):
                if _pread(self.path, probe.offset + at, n).tobytes() != _pread(e.path, e.offset + at, n).tobytes():
                    raise CheckpointError(
                        f"{self.path}: '{probe.name}' of {r.what} differs from {cat.root} — the trunk comes from"
                        f" another checkpoint with the same shapes, or the run is corrupted (fails its checksum);"
                        f" {_restart(self.root)}"
                    )

    # ---- queries ------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._tensors

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def entry(self, name: str) -> TrunkTensor:
        got = self._tensors.get(name)
        if got is None:
            raise CheckpointError(
                f"{self.root}: tensor '{name}' is not in this trunk (packed {self.layers_packed} layers); read it from the shards"
            )
        return got[0]

    def run(self, key: str) -> TrunkRun:
        if key not in self.runs:
            raise CheckpointError(f"{self.root}: no run '{key}' in this trunk; runs are {', '.join(self.runs)}")
        return self.runs[key]

    def layer_run(self, layer: int) -> TrunkRun | None:
        """The run of main layer `layer` (or MTP block at n_layers + k); None if not packed."""
        return self._by_layer.get(layer)

    # ---- reads --------------------------------------------------------------------------
    def tensor(self, name: str) -> np.ndarray:
        """Read-only memory-mapped view of one tensor (no checksum: use read_run/verify for that)."""
        t = self.entry(name)
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm[t.offset : t.offset + t.nbytes].view(t.np_dtype).reshape(t.shape)

    def read_tensor(self, name: str) -> np.ndarray:
        """One tensor read with pread into its own array (no checksum)."""
        t = self.entry(name)
        buf = _pread(self.path, t.offset, t.nbytes)
        return buf.view(t.np_dtype).reshape(t.shape)

    def read_run(self, key: str, verify: bool = True) -> np.ndarray:
        """A run's bytes in a 4096-aligned uint8 buffer (nbytes,), checksum checked unless verify=False."""
        r = self.run(key)
        buf = _pread(self.path, r.offset, r.nbytes)
        if verify:
            import hashlib

            got = hashlib.blake2b(buf, digest_size=16).hexdigest()
            if got != r.checksum:
                raise self._corrupt(r, got)
        return buf

    def arrays(self, key: str, verify: bool = True) -> dict[str, np.ndarray]:
        """name -> raw array, views into one freshly read (and checked) run buffer."""
        r = self.run(key)
        buf = self.read_run(key, verify)
        return {
            t.name: buf[t.offset - r.offset : t.offset - r.offset + t.nbytes].view(t.np_dtype).reshape(t.shape)
            for t in r.tensors
        }

    def verify(self, keys: list[str] | None = None) -> None:
        """Re-hash runs from disk (all by default) with blake2b; CheckpointError on the first mismatch."""
        fd = _open(self.path)
        try:
            for key in keys or list(self.runs):
                r = self.run(key)
                got = hash_range(fd, r.offset, r.nbytes, path=self.path)
                if got != r.checksum:
                    raise self._corrupt(r, got)
                self._checked.add(r.key)
        finally:
            os.close(fd)

    def check_words(self, keys: list[str]) -> None:
        """The cheap check of these runs read from disk now (word sums, at memory speed)."""
        fd = _open(self.path)
        try:
            for key in keys:
                r = self.run(key)
                if r.sum64 is None or r.key in self._checked:
                    continue
                got = 0
                for a in range(0, r.nbytes, CHECK_CHUNK):
                    n = min(CHECK_CHUNK, r.nbytes - a)
                    got += word_sum(_pread(self.path, r.offset + a, n, fd))
                self._check_sum(r, got)
        finally:
            os.close(fd)

    def check_window(self, path: str, offset: int, data: np.ndarray) -> None:
        """The cheap check of every run that `data` (bytes of `path` from `offset`) holds whole,
        the first time each is read in this process (a streamed layer is read again every pass)."""
        if path != self.path:
            return
        for r in self.runs.values():
            if r.key in self._checked or r.sum64 is None:
                continue
            if offset <= r.offset and r.offset + r.nbytes <= offset + data.nbytes:
                self._check_sum(r, word_sum(data[r.offset - offset : r.offset - offset + r.nbytes]))

    def _check_sum(self, r: TrunkRun, got: int) -> None:
        if f"{got % (1 << 64):016x}" != r.sum64:
            raise self._corrupt(r, f"word sum {got % (1 << 64):016x}", f"word sum {r.sum64}")
        self._checked.add(r.key)

    def _corrupt(self, r: TrunkRun, got: str, want: str | None = None) -> CheckpointError:
        return CheckpointError(
            f"{r.path}: {r.what}, bytes {r.offset}..{r.offset + r.nbytes}, fails its checksum"
            f" ({got} != {want or r.checksum}); the trunk is corrupted — {_restart(self.root)}"
        )

    def close(self) -> None:
        self._mm = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ReadError(f"{path}: cannot open the packed trunk ({e.strerror})") from None


def _pread(path: str, offset: int, nbytes: int, fd: int | None = None) -> np.ndarray:
    """nbytes from offset into a fresh 4096-aligned uint8 array (what O_DIRECT would need)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    buf = raw[start : start + nbytes]
    if fd is None:
        pread_exact(path, offset, buf, "the packed trunk")
        return buf
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as e:
            raise ReadError(f"{path}: {e.strerror} at byte {offset + got}; check the disk") from None
        if n <= 0:
            raise CheckpointError(
                f"{path}: the packed trunk ends at byte {offset + got}, before its manifest says; {_restart(Path(path).parent)}"
            )
        got += n
    return buf


def open_trunk_file(cat: Catalog, trunk: str | os.PathLike | None, verify: bool = False) -> TrunkFile | None:
    """The packed trunk to read from: the one named, else the default one if packed, else None."""
    if trunk == "":
        return None
    if trunk is None:
        default = default_out_dir(cat.root)
        if not (default / MANIFEST).is_file():
            return None
        trunk = default
    return TrunkFile.open(trunk, cat, verify=verify)
