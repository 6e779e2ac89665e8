"""One-time packing of the trunk: every tensor that is not a routed expert, in per-layer runs.

Owns: the packed-trunk layout, the manifest, and the packer (atomic, resumable, checked
for free disk space). `trunkfile.TrunkFile` is the matching loader. The expert store
never reads this file; routed experts stay in the official shards.

Layout of `OUT_DIR/trunk.bin` (OUT_DIR defaults to `CHECKPOINT_DIR/dsv4-trunk`):
- One run per group, in model order: `embed` (embed.weight), `layers.L` for each packed
  main layer (all its dense tensors: norms, mHC, attention, compressor, indexer, gate,
  shared expert), `model` (norm, hc_head_*), `head` (head.weight). The mtp.* blocks (the
  preview's MTP block, 0731's DSpark drafter) are not packed: nothing runs them yet.
- Every run starts at a multiple of 4096 and its length is padded with zeros to a multiple
  of 4096, so one O_DIRECT read of (offset, nbytes) fetches it into an aligned buffer.
- Tensors inside a run start at multiples of 64 (zero padding between), so views into an
  aligned run buffer are aligned for any dtype and for SIMD loads.
- Bytes are copied unchanged from the shards (FP8, FP4-in-I8, E8M0, BF16, F32, I64): the
  pack is a relayout, never a conversion.

`manifest.json`: format, the source checkpoint's fingerprint (`Catalog.fingerprint`), and per
run: key, layer (main index, n_layers + k for MTP block k, null for model-level runs),
offset, nbytes (padded), blake2b-128 of all nbytes bytes, and its tensors (name, dtype,
shape, absolute offset in trunk.bin, nbytes).

Atomicity and resume: everything is written into a staging directory
`.<OUT_DIR name>.partial` beside OUT_DIR, holding `trunk.bin` and `journal.jsonl` (one
line per run written and flushed, with its checksum). The manifest is written last, then
the staging directory is renamed to OUT_DIR in one step, so a half-written pack is never
loaded. A re-run with the same checkpoint and `--layers` re-reads each journaled run,
keeps those whose checksum still matches, and writes the rest.

Partial packs (`--layers N`): the model-level runs plus main layers 0..N-1. The manifest says `complete: false`; a runner takes what
the pack holds and reads every other trunk tensor straight from the shards.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .catalog import Catalog, TensorEntry
from .errors import BudgetError, CheckpointError, Dsv4Error, UsageError
from .spec import TensorSpec, layer_prefix, model_specs

FORMAT = "dsv4-trunk/1"
ALIGN = 4096
TENSOR_ALIGN = 64
TRUNK_FILE = "trunk.bin"
MANIFEST = "manifest.json"
JOURNAL = "journal.jsonl"
DEFAULT_DIRNAME = "dsv4-trunk"
CHECKSUM = "blake2b-128"
CHUNK = 16 << 20  # copy granularity: bounds the packer's memory whatever the tensor size


def _round_up(n: int, a: int) -> int:
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


@dataclass(frozen=True)
class PackResult:
    path: Path
    runs: int
    written: tuple[str, ...]  # run keys written by this call
    skipped: tuple[str, ...]  # run keys found already written and verified
    bytes_written: int
    seconds: float
    up_to_date: bool = False  # OUT_DIR already held this pack; nothing done


def default_out_dir(ckpt_dir: str | os.PathLike) -> Path:
    return Path(ckpt_dir) / DEFAULT_DIRNAME


def staging_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.partial"


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
        if s.name not in cat.entries:
            continue  # a scale that this weight's dtype does not have (validated before)
        k = _run_key(cat, s)
        groups.setdefault(k, []).append(s)
        layer_of[k] = s.layer
    runs, pos = [], 0
    for key, specs in groups.items():
        tensors, rel = [], 0
        for s in specs:
            rel = _round_up(rel, TENSOR_ALIGN)
            e = cat.entries[s.name]
            tensors.append(PlannedTensor(e, pos + rel))
            rel += e.nbytes
        size = _round_up(max(rel, 1), ALIGN)
        runs.append(PlannedRun(key, layer_of[key], pos, size, tuple(tensors)))
        pos += size
    return runs


def _plan_id(cat: Catalog, runs: list[PlannedRun]) -> str:
    h = hashlib.sha256(f"{FORMAT}|{cat.fingerprint}".encode())
    for r in runs:
        h.update(f"{r.key}|{r.offset}|{r.nbytes}|".encode())
        for t in r.tensors:
            h.update(f"{t.src.name}|{t.offset}|{t.src.nbytes}|".encode())
    return h.hexdigest()[:32]


def manifest_dict(cat: Catalog, runs: list[PlannedRun], sums: dict[str, str], layers: int) -> dict:
    cfg = cat.config
    return {
        "format": FORMAT,
        "fingerprint": cat.fingerprint,
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
                "tensors": [
                    {"name": t.src.name, "dtype": t.src.dtype, "shape": list(t.src.shape), "offset": t.offset,
                     "nbytes": t.src.nbytes}
                    for t in r.tensors
                ],
            }
            for r in runs
        ],
    }  # fmt: skip


def hash_range(fd: int, offset: int, nbytes: int, on_bytes: Callable[[int], None] | None = None) -> str:
    """blake2b-128 of nbytes of an open file from offset; a short file is an error."""
    h = new_hash()
    done = 0
    while done < nbytes:
        b = os.pread(fd, min(CHUNK, nbytes - done), offset + done)
        if not b:
            raise CheckpointError(f"short read at byte {offset + done}: the file ends before the run does")
        h.update(b)
        done += len(b)
        if on_bytes:
            on_bytes(len(b))
    return h.hexdigest()


def _read_journal(path: Path, plan: str) -> dict[str, str] | None:
    """key -> checksum of the runs a previous attempt finished; None if it was another plan."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    try:
        if json.loads(lines[0]).get("plan") != plan:
            return None
    except (IndexError, ValueError, AttributeError):
        return None
    done: dict[str, str] = {}
    for ln in lines[1:]:
        try:
            d = json.loads(ln)
            done[str(d["key"])] = str(d["blake2b"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by the interruption
    return done


def _existing_pack_matches(out_dir: Path, fingerprint: str, layers: int) -> bool:
    try:
        m = json.loads((out_dir / MANIFEST).read_text())
        size = (out_dir / m["file"]).stat().st_size
        return (
            m.get("format") == FORMAT
            and m.get("fingerprint") == fingerprint
            and m.get("layers_packed") == layers
            and size == m.get("file_bytes")
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB ({n:,} bytes)"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _say(msg: str, progress: bool) -> None:
    if progress:
        from tqdm import tqdm

        tqdm.write(f"pack-trunk: {msg}")


class _Copier:
    """Writes planned runs into trunk.bin, hashing exactly the bytes it writes."""

    def __init__(self, out_fd: int, on_bytes: Callable[[int], None]):
        self.out_fd = out_fd
        self.on_bytes = on_bytes
        self.src: dict[str, int] = {}

    def close(self) -> None:
        for fd in self.src.values():
            os.close(fd)
        self.src.clear()

    def _zeros(self, h: hashlib.blake2b, pos: int, n: int) -> None:
        if n:
            z = bytes(n)
            h.update(z)
            os.pwrite(self.out_fd, z, pos)

    def write_run(self, run: PlannedRun) -> str:
        h = new_hash()
        pos = run.offset
        for t in run.tensors:
            self._zeros(h, pos, t.offset - pos)  # padding is written too: it may hold old garbage
            e = t.src
            fd = self.src.get(e.path)
            if fd is None:
                fd = self.src[e.path] = os.open(e.path, os.O_RDONLY)
            done = 0
            while done < e.nbytes:
                b = os.pread(fd, min(CHUNK, e.nbytes - done), e.offset + done)
                if not b:
                    raise CheckpointError(
                        f"{e.path}: short read of '{e.name}' at byte {e.offset + done}; the shard is truncated"
                    )
                h.update(b)
                os.pwrite(self.out_fd, b, t.offset + done)
                done += len(b)
                self.on_bytes(len(b))
            pos = t.offset + e.nbytes
        end = run.offset + run.nbytes
        self._zeros(h, pos, end - pos)
        self.on_bytes(run.nbytes - sum(t.src.nbytes for t in run.tensors))
        return h.hexdigest()


def pack_trunk(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    layers: int | None = None,
    *,
    force: bool = False,
    progress: bool = True,
    on_run: Callable[[str, bool], None] | None = None,
) -> PackResult:
    """Pack every non-expert tensor of the checkpoint into OUT_DIR (see the module docstring).

    layers: pack only main layers 0..layers-1. force: replace an OUT_DIR holding another pack.
    on_run(key, written) is called after each run is journaled (written=True) or found
    verified (written=False); tests use it to interrupt the packer at a known point.
    """
    t0 = time.perf_counter()
    cat = Catalog.open(ckpt_dir)
    cat.validate()
    cfg = cat.config
    n = cfg.n_layers if layers is None else layers
    if not 0 <= n <= cfg.n_layers:
        raise UsageError(f"--layers {layers}: the checkpoint has {cfg.n_layers} main layers; pass 0..{cfg.n_layers}")
    out = Path(out_dir) if out_dir is not None else default_out_dir(ckpt_dir)
    runs = plan_runs(cat, n)
    plan = _plan_id(cat, runs)
    total = runs[-1].offset + runs[-1].nbytes

    if _existing_pack_matches(out, cat.fingerprint, n):
        return PackResult(out, len(runs), (), tuple(r.key for r in runs), 0, time.perf_counter() - t0, True)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise UsageError(
            f"{out}: exists and holds something other than a pack of this checkpoint with {n} layers;"
            " remove it, choose another OUT_DIR, or pass --force to replace it"
        )

    stage = staging_dir(out)
    stage.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(stage / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Dsv4Error(f"{stage}: another pack-trunk is writing here; wait for it or stop it") from None
        return _pack_locked(cat, runs, plan, total, n, out, stage, force, progress, on_run, t0)
    finally:
        os.close(lock_fd)


def _pack_locked(cat, runs, plan, total, n, out, stage, force, progress, on_run, t0) -> PackResult:
    from tqdm import tqdm

    data, journal = stage / TRUNK_FILE, stage / JOURNAL
    done = _read_journal(journal, plan) if data.exists() else None
    if done is None and (data.exists() or journal.exists()):
        _say(f"discarding an unfinished pack of another checkpoint or --layers in {stage}", progress)
    if done is None:
        data.unlink(missing_ok=True)
        journal.write_text(json.dumps({"plan": plan, "fingerprint": cat.fingerprint, "layers": n}) + "\n")
        done = {}

    fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o644)
    copier = _Copier(fd, lambda k: None)
    try:
        size = os.fstat(fd).st_size
        sums: dict[str, str] = {}
        skipped: list[str] = []
        # runs a previous attempt journaled: keep each one whose bytes still hash the same
        to_check = [r for r in runs if r.key in done and r.offset + r.nbytes <= size]
        if to_check:
            vbytes = sum(r.nbytes for r in to_check)
            with tqdm(total=vbytes, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
                for r in to_check:
                    if hash_range(fd, r.offset, r.nbytes, bar.update) == done[r.key]:
                        sums[r.key] = done[r.key]
                        skipped.append(r.key)
            _say(f"resuming: {len(skipped)} of {len(runs)} runs already written and verified", progress)
        todo = [r for r in runs if r.key not in sums]
        need = sum(r.nbytes for r in todo)
        free = shutil.disk_usage(stage).free
        if need > free:
            if not done:
                shutil.rmtree(stage, ignore_errors=True)  # nothing worth resuming
            raise BudgetError(
                f"{stage}: packing needs {_size(need)} more disk space but {_size(free)} is free;"
                " free some space or pass another OUT_DIR"
            )
        if size != total:
            os.ftruncate(fd, total)
        for key in skipped:
            if on_run:
                on_run(key, False)
        written: list[str] = []
        with (
            open(journal, "a") as jf,
            tqdm(total=need, unit="B", unit_scale=True, desc="pack-trunk", disable=not progress) as bar,
        ):
            copier.on_bytes = bar.update
            for r in todo:
                sums[r.key] = copier.write_run(r)
                os.fdatasync(fd)
                jf.write(json.dumps({"key": r.key, "blake2b": sums[r.key]}) + "\n")
                jf.flush()
                os.fsync(jf.fileno())
                written.append(r.key)
                if on_run:
                    on_run(r.key, True)
    finally:
        copier.close()
        os.close(fd)

    tmp_manifest = stage / (MANIFEST + ".tmp")
    tmp_manifest.write_text(json.dumps(manifest_dict(cat, runs, sums, n), indent=1) + "\n")
    with open(tmp_manifest, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp_manifest, stage / MANIFEST)
    journal.unlink()
    (stage / "lock").unlink()
    _fsync_dir(stage)
    old = None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        assert force  # refused before any work otherwise
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(stage, out)
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    nbytes = sum(r.nbytes for r in runs if r.key in written)
    return PackResult(out, len(runs), tuple(written), tuple(skipped), nbytes, time.perf_counter() - t0)
