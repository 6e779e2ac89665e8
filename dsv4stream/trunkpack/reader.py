"""Loader of a packed trunk (written by `pack.pack_trunk`): manifest checks, runs, raw tensors.

Owns: refusing a pack that does not belong to the checkpoint (fingerprint of the shard
headers, plus a byte comparison of one small tensor per run against the shards, which
also tells apart checkpoints with identical shapes such as a base and a chat model); a
pack of an older format (the upgrade command named); checksums: xxh3 on every read
(`read_run`, `check_window` for the runtime's reads, `check_runs`), blake2b on `verify`;
the data file's identity (device, inode, size, mtime) taken at open and compared on every
read, so a trunk.bin replaced or rewritten during a run stops it with one line; raw tensor
arrays by name with the same dtypes as `Catalog.read` (uint8 for F8/I8, uint16 for BF16, ...).

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
from ..errors import CheckpointError, Dsv4Error, ReadError
from ..files import describe, open_regular
from . import headcopy
from .format import ALIGN, FORMAT, MANIFEST, UPGRADABLE, fast_hash, hash_range, plan_runs, valid_file_name
from .packdir import MANIFEST_LIMIT, default_out_dir, staging_dir

CHECK_CHUNK = 16 << 20  # bytes read at a time by check_runs: bounds its memory
PROBE_BYTES = 32 << 10  # per run, compared with the shards at open: cheap, yet tells twins apart
TENSOR_PROBE_BYTES = 4 << 10  # per tensor with --verify: binds each name to its bytes (a swapped manifest)


@dataclass(frozen=True)
class TrunkTensor:
    name: str
    dtype: str  # safetensors dtype string, as in the checkpoint
    shape: tuple[int, ...]
    offset: int  # absolute, in the trunk file
    nbytes: int
    xxh3: str = ""  # of the tensor's own bytes

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
    xxh3: str = ""  # of all nbytes bytes (padding included)

    @property
    def what(self) -> str:
        return f"run '{self.key}'" + (f" (layer {self.layer})" if self.layer is not None else "")


def _restart(root: Path) -> str:
    return f"delete {root} and run `dsv4 pack-trunk` again"


def upgrade_hint(root: Path) -> str:
    return (
        f"upgrade it in place with `dsv4 upgrade-trunk {root}` (checks every run with blake2b, then adds the new sums)"
    )


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What says a file is still the one opened: a rename puts another inode, a rewrite moves mtime."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


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
        self._identity: tuple[int, int, int, int] | None = None  # of the data file, taken at open
        self.checked_reads = 0  # runs or tensors whose xxh3 was checked after a read
        self.head_q8: dict | None = None  # the int8 copy of the head (`headcopy`), when the pack has one

    # ---- opening ---------------------------------------------------------------------
    @classmethod
    def open(cls, out_dir: str | os.PathLike, catalog: Catalog, verify: bool = False) -> TrunkFile:
        """Open OUT_DIR's pack for `catalog`; verify=True also checks every run's blake2b now."""
        root = Path(out_dir)
        mpath = root / MANIFEST
        kind = describe(mpath)
        if kind is None:
            unfinished = staging_dir(root).exists()
            raise CheckpointError(
                f"{root}: no packed trunk here (manifest.json missing"
                + ("; an interrupted pack is in " + str(staging_dir(root)) if unfinished else "")
                + f"); run `dsv4 pack-trunk {catalog.root} {root}`"
            )
        tf = cls.checked(root, read_pack_manifest(root), catalog, every_tensor=verify)
        if verify:
            tf.verify()
        else:
            # the embedding is only ever read row by row, so no later read can check it whole
            tf.check_runs([k for k in ("embed",) if k in tf.runs])
        return tf

    @classmethod
    def checked(
        cls, root: Path, m: dict, catalog: Catalog, every_tensor: bool = False, probe: bool = True
    ) -> TrunkFile:
        """The pack of manifest `m` (its runs' checksums not read yet), refused unless every
        field is consistent: run keys and tensor names once each, runs and tensors placed
        inside the data file as their sizes say, names, dtypes and shapes as in `catalog`, and
        bytes as in the shards (one tensor per run; `every_tensor`: slices of each tensor, so
        two same-shape tensors swapped in the manifest are told apart; `probe=False`: no bytes
        compared). `upgrade-trunk` checks an old manifest with this before it reads the runs."""
        mpath = root / MANIFEST
        try:
            runs = {
                d["key"]: TrunkRun(
                    d["key"],
                    d["layer"],
                    str(root / m["file"]),
                    int(d["offset"]),
                    int(d["nbytes"]),
                    str(d["blake2b"]),
                    tuple(
                        TrunkTensor(
                            t["name"], t["dtype"], tuple(t["shape"]), int(t["offset"]), int(t["nbytes"]), str(t["xxh3"])
                        )
                        for t in d["tensors"]
                    ),
                    str(d["xxh3"]),
                )
                for d in m["runs"]
            }
            names = [t.name for r in runs.values() for t in r.tensors]
            if len(runs) != len(m["runs"]) or len(set(names)) != len(names):
                twice = next((n for n in names if names.count(n) > 1), "a run key")
                raise ValueError(f"{twice!r} is listed twice")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{mpath}: unreadable manifest ({type(e).__name__}: {e}); {_restart(root)}") from None
        if m.get("fingerprint") != catalog.fingerprint:
            raise CheckpointError(
                f"{root}: trunk was packed from a different checkpoint (fingerprint {m.get('fingerprint')},"
                f" {catalog.root} has {catalog.fingerprint}); pack this checkpoint with"
                f" `dsv4 pack-trunk {catalog.root} OUT_DIR` or pass the right --trunk"
            )
        tf = cls(root, m, runs)
        tf._check_runs_planned(catalog)
        tf._check_file()
        tf._check_against(catalog, every_tensor, probe)
        tf.head_q8 = headcopy.checked_entry(root, m)
        return tf

    def _check_runs_planned(self, cat: Catalog) -> None:
        """Each run is one the packer plans for this checkpoint and depth (its key and layer),
        holding only tensors that the plan puts in it: a tensor listed in another run than its
        own is refused here, not when a layer finds its weights missing."""
        planned = {p.key: p for p in plan_runs(cat, self.layers_packed)}
        for r in self.runs.values():
            p = planned.get(r.key)
            if p is None or p.layer != r.layer:
                raise CheckpointError(
                    f"{self.root / MANIFEST}: {r.what} is not a run of this checkpoint's pack; {_restart(self.root)}"
                )
            own = {t.src.name for t in p.tensors}
            stray = next((t.name for t in r.tensors if t.name not in own), None)
            if stray is not None:
                raise CheckpointError(
                    f"{self.root / MANIFEST}: {r.what} lists '{stray}', which is not one of its tensors;"
                    f" {_restart(self.root)}"
                )

    def _check_file(self) -> None:
        fd = open_regular(self.path, "the packed trunk's data file", CheckpointError)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        self._identity = identity(st)
        size = st.st_size
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

    def read_head_q8(self):
        """The pack's int8 head copy as (q int8 (vocab, dim), s float32 (vocab,)), xxh3-checked;
        None when the pack has none (fast numerics then reads the BF16 head)."""
        if self.head_q8 is None:
            return None
        return headcopy.read_copy(self.root, self.head_q8)

    def check_identity(self, path: str | None = None) -> None:
        """Stop, with one line, when the data file is no longer the one opened (replaced by a
        rename, rewritten, truncated); `path` other than the trunk's is ignored."""
        if (path is not None and path != self.path) or self._identity is None:
            return
        try:
            now = identity(os.stat(self.path))
        except OSError as e:
            now = None
            why = f"it can no longer be found ({e.strerror})"
        if now == self._identity:
            return
        if now is not None:
            names = ("device", "inode", "size", "modification time")
            why = (
                "its " + ", ".join(n for n, a, b in zip(names, self._identity, now, strict=True) if a != b) + " changed"
            )
        raise CheckpointError(
            f"{self.path}: the packed trunk was replaced or rewritten during this run ({why}); its bytes can no"
            " longer be trusted — stop whatever rewrites it and start the run again"
        )

    def _check_against(self, cat: Catalog, every_tensor: bool = False, probe: bool = True) -> None:
        """Names, dtypes and shapes as in the shards; and one small tensor per run byte for byte
        (`every_tensor`: a head and a tail slice of each tensor too)."""
        for r in self.runs.values():
            for t in r.tensors:
                e = cat.entries.get(t.name)
                if e is None or (e.dtype, e.shape, e.nbytes) != (t.dtype, t.shape, t.nbytes):
                    raise CheckpointError(
                        f"{self.root}: '{t.name}' in the trunk does not match the checkpoint; {_restart(self.root)}"
                    )
            if not probe:
                continue
            # one small tensor per run (a head and a tail slice of embed/head), compared with the shards
            probes = [(min(r.tensors, key=lambda t: (t.nbytes, t.name)), PROBE_BYTES)]
            if every_tensor:
                probes += [(t, TENSOR_PROBE_BYTES) for t in r.tensors]
            for pt, most in probes:
                e = cat.entries[pt.name]
                n = min(pt.nbytes, most)
                for at in sorted({0, pt.nbytes - n}):
                    if _pread(self.path, pt.offset + at, n).tobytes() != _pread(e.path, e.offset + at, n).tobytes():
                        raise CheckpointError(
                            f"{self.path}: '{pt.name}' of {r.what} differs from {cat.root} — the trunk comes from"
                            " another checkpoint with the same shapes, its manifest puts the tensor at another's"
                            f" place, or the run is corrupted (fails its checksum); {_restart(self.root)}"
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
        """Read-only memory-mapped view of one tensor, its xxh3 checked as it is handed out (the pages
        stay the file's: the runtime reads runs into its own buffers instead, see check_window)."""
        t = self.entry(name)
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        view = self._mm[t.offset : t.offset + t.nbytes]
        self._check_tensor(t, view)
        return view.view(t.np_dtype).reshape(t.shape)

    def read_tensor(self, name: str) -> np.ndarray:
        """One tensor read with pread into its own array, its xxh3 checked."""
        t = self.entry(name)
        buf = _pread(self.path, t.offset, t.nbytes)
        self._check_tensor(t, buf)
        return buf.view(t.np_dtype).reshape(t.shape)

    def read_run(self, key: str, verify: bool = True) -> np.ndarray:
        """A run's bytes in a 4096-aligned uint8 buffer (nbytes,), its xxh3 checked unless verify=False."""
        r = self.run(key)
        buf = _pread(self.path, r.offset, r.nbytes)
        if verify:
            self.check_window(self.path, r.offset, buf)
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
                    raise self._corrupt(r, f"blake2b {got}", f"blake2b {r.checksum}")
        finally:
            os.close(fd)
        e = self.head_q8
        if (
            keys is None
            and e is not None
            and headcopy.file_blake2b(self.root / e["file"], e["file_bytes"]) != e["blake2b"]
        ):
            raise CheckpointError(
                f"{self.root / e['file']}: the int8 head copy fails its blake2b checksum;"
                f" run `dsv4 upgrade-trunk {self.root}` to write it again"
            )
        self.check_identity()

    def check_runs(self, keys: list[str]) -> None:
        """The xxh3 of these runs read from disk now, in bounded memory."""
        import xxhash

        fd = _open(self.path)
        try:
            for key in keys:
                r = self.run(key)
                h = xxhash.xxh3_64()
                for a in range(0, r.nbytes, CHECK_CHUNK):
                    h.update(_pread(self.path, r.offset + a, min(CHECK_CHUNK, r.nbytes - a), fd))
                self._check_run(r, h.hexdigest())
        finally:
            os.close(fd)
        self.check_identity()

    def check_window(self, path: str, offset: int, data: np.ndarray) -> None:
        """Check bytes just read (`data`, from `offset` of `path`): the xxh3 of every run they hold
        whole, else of every tensor they hold whole; then that the file is still the one opened.
        Every read is checked, not only the first: a streamed layer is read again every pass."""
        if path != self.path:
            return
        end = offset + data.nbytes
        for r in self.runs.values():
            if r.offset >= end or r.offset + r.nbytes <= offset:
                continue
            if offset <= r.offset and r.offset + r.nbytes <= end:
                self._check_run(r, fast_hash(data[r.offset - offset : r.offset - offset + r.nbytes]))
                continue
            for t in r.tensors:
                if offset <= t.offset and t.offset + t.nbytes <= end:
                    self._check_tensor(t, data[t.offset - offset : t.offset - offset + t.nbytes], r)
        self.check_identity()

    def _check_run(self, r: TrunkRun, got: str) -> None:
        if got != r.xxh3:
            raise self._corrupt(r, f"xxh3 {got}", f"xxh3 {r.xxh3}")
        self.checked_reads += 1

    def _check_tensor(self, t: TrunkTensor, data: np.ndarray, r: TrunkRun | None = None) -> None:
        got = fast_hash(data)
        if got != t.xxh3:
            r = r or self.runs[self._tensors[t.name][1]]
            raise CheckpointError(
                f"{self.path}: tensor '{t.name}' of {r.what}, bytes {t.offset}..{t.offset + t.nbytes}, fails its"
                f" checksum (xxh3 {got} != {t.xxh3}); the trunk is corrupted — {_restart(self.root)}"
            )
        self.checked_reads += 1

    def _corrupt(self, r: TrunkRun, got: str, want: str) -> CheckpointError:
        return CheckpointError(
            f"{r.path}: {r.what}, bytes {r.offset}..{r.offset + r.nbytes}, fails its checksum"
            f" ({got} != {want}); the trunk is corrupted — {_restart(self.root)}"
        )

    def close(self) -> None:
        self._mm = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open(path: str) -> int:
    try:
        return open_regular(path, "the packed trunk", ReadError)
    except Dsv4Error as e:
        raise ReadError(str(e)) from None


def read_pack_manifest(root: Path) -> dict:
    """The manifest of the pack in `root`, of this format, naming a data file inside `root`;
    CheckpointError otherwise (an older format: with the command that upgrades it)."""
    mpath = root / MANIFEST
    m = jsonio.read_json(mpath, "the manifest", CheckpointError, MANIFEST_LIMIT, fix=_restart(root))
    if not isinstance(m, dict):
        raise CheckpointError(f"{mpath}: not a manifest (a JSON object is expected); {_restart(root)}")
    fmt = m.get("format")
    if fmt in UPGRADABLE:
        raise CheckpointError(
            f"{mpath}: format {fmt!r} has no position-sensitive checksums (this dsv4stream reads {FORMAT!r});"
            f" {upgrade_hint(root)}"
        )
    if fmt != FORMAT:
        raise CheckpointError(f"{mpath}: format {fmt!r}, this dsv4stream reads {FORMAT!r}; {_restart(root)}")
    if not valid_file_name(m.get("file")):
        raise CheckpointError(
            f"{mpath}: its 'file' {m.get('file')!r} is not a plain file name inside {root}; the manifest is"
            f" damaged or not ours — {_restart(root)}"
        )
    return m


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
        if describe(default / MANIFEST) is None:
            return None
        trunk = default
    return TrunkFile.open(trunk, cat, verify=verify)
