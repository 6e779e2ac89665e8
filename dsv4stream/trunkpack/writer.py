"""One-time packing of the trunk: every tensor that is not a routed expert, in per-layer runs.

Owns: the packer (atomic, resumable, checked for free disk space). The format it writes
(layout, manifest, checksums) is `format`; `reader.TrunkFile` is the matching loader. The expert store
never reads this file; routed experts stay in the official shards.

OUT_DIR is only ever replaced when it is empty or a previous pack (`check_out_dir`). One
packer at a time: an flock on `.<OUT_DIR name>.lock` beside OUT_DIR, held until the staged
pack has been renamed into place and unlinked only then (a lock unlinked earlier let a
second packer delete a finished pack's trunk.bin).

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

import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from .. import jsonio
from ..checkpoint.catalog import Catalog
from ..errors import BudgetError, Dsv4Error, InternalError, ReadError, ShortReadError, UsageError
from ..files import read_regular
from . import headcopy
from .format import (
    ALIGN,
    CHUNK,
    FORMAT,
    JOURNAL,
    MANIFEST,
    TRUNK_FILE,
    UPGRADABLE,
    PlannedRun,
    RunDigest,
    digest_run,
    hash_range,
    manifest_dict,
    new_hash,
    plan_id,
    plan_runs,
    round_up,
)
from .packdir import (
    MANIFEST_LIMIT,
    check_out_dir,
    default_out_dir,
    drop_lock,
    is_pack,
    lock_path,
    old_dir,
    read_manifest,
    staging_dir,
    take_lock,
)


@dataclass(frozen=True)
class PackResult:
    path: Path
    runs: int
    written: tuple[str, ...]  # run keys written by this call
    skipped: tuple[str, ...]  # run keys found already written and verified
    bytes_written: int
    seconds: float
    up_to_date: bool = False  # OUT_DIR already held this pack; nothing done
    head_copy_added: bool = False  # OUT_DIR held this pack without the int8 head copy: added in place


def _read_journal(path: Path, plan: str) -> dict[str, str] | None:
    """key -> checksum of the runs a previous attempt finished; None if it was another plan."""
    try:
        lines = read_regular(path, "the journal", limit=MANIFEST_LIMIT).decode().splitlines()
    except (Dsv4Error, OSError, UnicodeDecodeError):
        return None
    try:
        if jsonio.parse_json(lines[0], "journal").get("plan") != plan:
            return None
    except (IndexError, Dsv4Error, AttributeError):
        return None
    done: dict[str, str] = {}
    for ln in lines[1:]:
        try:
            d = jsonio.parse_json(ln, "journal")
            done[str(d["key"])] = str(d["blake2b"])
        except (Dsv4Error, KeyError, TypeError):
            continue  # a line cut short by the interruption
    return done


def _existing_pack_matches(out_dir: Path, fingerprint: str, layers: int) -> bool:
    m = read_manifest(out_dir)
    try:
        size = (out_dir / str(m["file"])).stat().st_size if m else -1
    except (OSError, KeyError, TypeError):
        return False
    return (
        m is not None
        and m.get("format") == FORMAT
        and m.get("fingerprint") == fingerprint
        and m.get("layers_packed") == layers
        and size == m.get("file_bytes")
    )


def _corrupt_runs(out_dir: Path, progress: bool) -> list[str]:
    """Keys of the runs of an existing pack whose bytes no longer hash to the manifest's sums."""
    from tqdm import tqdm

    m = read_manifest(out_dir) or {}
    runs = m.get("runs", [])
    bad = []
    fd = os.open(out_dir / m["file"], os.O_RDONLY)
    try:
        total = sum(int(r["nbytes"]) for r in runs)
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
            for r in runs:
                try:
                    ok = hash_range(fd, int(r["offset"]), int(r["nbytes"]), bar.update, str(m["file"])) == r["blake2b"]
                except ShortReadError:  # a truncated run fails its check; a disk error is raised
                    ok = False
                if not ok:
                    bad.append(str(r["key"]))
    finally:
        os.close(fd)
    return bad


def _open_read(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ReadError(f"{path}: cannot open ({e.strerror}); check the file and its permissions") from None


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

    def __init__(self, out_fd: int, out_path: str, on_bytes: Callable[[int], None]):
        self.out_fd = out_fd
        self.out_path = out_path
        self.on_bytes = on_bytes
        self.src: dict[str, int] = {}

    def close(self) -> None:
        for fd in self.src.values():
            os.close(fd)
        self.src.clear()

    def _zeros(self, h: _Both, pos: int, n: int) -> None:
        if n:
            z = bytes(n)
            h.update(z)
            os.pwrite(self.out_fd, z, pos)

    def write_run(self, run: PlannedRun) -> RunDigest:
        """The checksums of the run as written (every byte, padding included, hashed as it goes
        to the file, so the sums describe what is on disk, not what was meant to be)."""
        h = _Both(new_hash(), xxhash.xxh3_64())
        tensor_sums: dict[str, str] = {}
        pos = run.offset
        for t in run.tensors:
            self._zeros(h, pos, t.offset - pos)  # padding is written too: it may hold old garbage
            e = t.src
            fd = self.src.get(e.path)
            if fd is None:
                fd = self.src[e.path] = _open_read(e.path)
            th = xxhash.xxh3_64()
            done = 0
            while done < e.nbytes:
                try:
                    b = os.pread(fd, min(CHUNK, e.nbytes - done), e.offset + done)
                except OSError as err:
                    raise ReadError(
                        f"{e.path}: {err.strerror} reading '{e.name}' at byte {e.offset + done}; check the disk"
                    ) from None
                if not b:
                    raise ShortReadError(
                        f"{e.path}: short read of '{e.name}' at byte {e.offset + done}; the shard is truncated"
                    )
                h.update(b)
                th.update(b)
                os.pwrite(self.out_fd, b, t.offset + done)
                done += len(b)
                self.on_bytes(len(b))
            tensor_sums[e.name] = th.hexdigest()
            pos = t.offset + e.nbytes
        end = run.offset + run.nbytes
        self._zeros(h, pos, end - pos)
        self.on_bytes(run.nbytes - sum(t.src.nbytes for t in run.tensors))
        return RunDigest(h.a.hexdigest(), h.b.hexdigest(), tensor_sums)


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

    layers: pack only main layers 0..layers-1. force: replace an OUT_DIR holding another pack
    (only a pack: anything else is refused). on_run(key, written) is called after each run is
    journaled (written=True) or found verified (written=False); tests use it to interrupt the
    packer at a known point.
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
    plan = plan_id(cat, runs)
    check_out_dir(Path(ckpt_dir), out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_fd = take_lock(lock_path(out), out)
    try:
        check_out_dir(Path(ckpt_dir), out, force)  # again, now that no other packer can change it
        replace = force
        if _existing_pack_matches(out, cat.fingerprint, n):
            bad = _corrupt_runs(out, progress)
            if not bad:
                m = read_manifest(out) or {}
                added = headcopy.ENTRY not in m and headcopy.add_in_place(out, m)  # a pack from before the copy
                if added:
                    _say(f"{out}: added the int8 head copy ({headcopy.FILE})", progress)
                skipped = tuple(r.key for r in runs)
                return PackResult(out, len(runs), (), skipped, 0, time.perf_counter() - t0, not added, added)
            _say(f"{out}: run(s) {', '.join(bad)} fail their checksum; packing again", progress)
            replace = True  # a damaged copy of this very pack: replacing it loses nothing
        elif out.is_dir() and any(out.iterdir()) and not force:
            old_format = (read_manifest(out) or {}).get("format")
            if old_format in UPGRADABLE:
                raise UsageError(
                    f"{out}: holds a pack of the older format {old_format!r}; `dsv4 upgrade-trunk {out}` upgrades it"
                    " in place (checks blake2b, then adds the new sums), or pass --force to pack it again"
                )
            raise UsageError(
                f"{out}: holds another pack (not this checkpoint with {n} layers);"
                " remove it, choose another OUT_DIR, or pass --force to replace it"
            )
        return _pack_locked(cat, runs, plan, n, out, replace, progress, on_run, t0)
    finally:
        drop_lock(lock_path(out), lock_fd)


def _stage_manifest_sums(stage: Path, plan: str) -> dict[str, str] | None:
    """Run checksums of a staged pack that was killed after writing its manifest (same plan)."""
    m = read_manifest(stage)
    if m is None or m.get("plan") != plan:
        return None
    try:
        return {str(r["key"]): str(r["blake2b"]) for r in m["runs"]}
    except (KeyError, TypeError):
        return None


def _meta_bytes(cat: Catalog, runs: list[PlannedRun], n: int) -> int:
    """Disk the manifest (written last) and the journal take, in whole pages."""
    manifest = json.dumps(
        manifest_dict(cat, runs, {r.key: _placeholder(r) for r in runs}, n, "0" * 32),
        indent=1,
    )
    journal = 200 + 100 * len(runs)
    copy = headcopy.copy_bytes(
        {
            "runs": [
                {
                    "key": r.key,
                    "tensors": [
                        {"name": t.src.name, "dtype": t.src.dtype, "shape": list(t.src.shape)} for t in r.tensors
                    ],
                }
                for r in runs
            ]
        }
    )
    return round_up(len(manifest) + 1, ALIGN) * 2 + round_up(journal, ALIGN) + copy  # tmp + final manifest


def _disk_full(stage: Path, data: Path, total: int, meta: int) -> BudgetError:
    try:
        allocated = data.stat().st_blocks * 512
    except OSError:
        allocated = 0
    need = max(0, total - allocated) + meta
    free = shutil.disk_usage(stage).free
    return BudgetError(
        f"{stage}: no space left on device; finishing the pack needs {_size(need)} and {_size(free)} is free —"
        f" free {_size(max(need - free, 0))} more and run pack-trunk again (it resumes)"
    )


def _pack_locked(cat, runs, plan, n, out, replace, progress, on_run, t0) -> PackResult:
    total = runs[-1].offset + runs[-1].nbytes
    stage = staging_dir(out)
    stage.mkdir(exist_ok=True)
    (stage / "lock").unlink(missing_ok=True)  # left by an older dsv4stream
    data, journal = stage / TRUNK_FILE, stage / JOURNAL
    done = _read_journal(journal, plan) if data.exists() else None
    if done is None and data.exists():
        done = _stage_manifest_sums(stage, plan)  # killed between its manifest and the rename
        if done is not None:
            _say(f"finishing the pack in {stage} (interrupted after its manifest)", progress)
            journal.write_text(
                json.dumps({"plan": plan, "fingerprint": cat.fingerprint, "layers": n})
                + "\n"
                + "".join(json.dumps({"key": k, "blake2b": v}) + "\n" for k, v in done.items())
            )
    if done is None and (data.exists() or journal.exists()):
        _say(f"discarding an unfinished pack in {stage}: it was for another checkpoint or --layers", progress)
    if done is None:
        data.unlink(missing_ok=True)
        journal.write_text(json.dumps({"plan": plan, "fingerprint": cat.fingerprint, "layers": n}) + "\n")
        done = {}
    meta = _meta_bytes(cat, runs, n)

    fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o644)
    copier = _Copier(fd, str(data), lambda k: None)
    try:
        size = os.fstat(fd).st_size
        digests, skipped = _keep_verified(fd, runs, done, size, progress)
        todo = [r for r in runs if r.key not in digests]
        # blocks already on disk (kept runs, and whatever a run cut short by a full disk wrote)
        # are reused in place: only the rest, plus the manifest and journal, needs free space
        need = max(0, total - os.fstat(fd).st_blocks * 512) + meta
        free = shutil.disk_usage(stage).free
        if need > free:
            if not done:
                os.close(fd)
                fd = -1
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
            tqdm_bar(sum(r.nbytes for r in todo), "pack-trunk", progress) as bar,
        ):
            copier.on_bytes = bar.update
            for r in todo:
                try:
                    digests[r.key] = copier.write_run(r)
                    os.fdatasync(fd)
                    jf.write(json.dumps({"key": r.key, "blake2b": digests[r.key].blake2b}) + "\n")
                    jf.flush()
                    os.fsync(jf.fileno())
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise _disk_full(stage, data, total, meta) from None
                    raise Dsv4Error(f"{data}: {e.strerror} while writing run '{r.key}'; check the disk") from None
                written.append(r.key)
                if on_run:
                    on_run(r.key, True)
    finally:
        copier.close()
        if fd >= 0:
            os.close(fd)

    manifest = manifest_dict(cat, runs, digests, n, plan)
    try:
        copy = _head_copy(stage, data, journal, manifest, done, progress)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _disk_full(stage, data, total, meta) from None
        raise Dsv4Error(f"{stage}: {e.strerror} while writing the int8 head copy; check the disk") from None
    if copy is not None:
        manifest[headcopy.ENTRY] = copy
    tmp_manifest = stage / (MANIFEST + ".tmp")
    try:
        tmp_manifest.write_text(json.dumps(manifest, indent=1) + "\n")
        with open(tmp_manifest, "rb+") as f:
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _disk_full(stage, data, total, meta) from None
        raise
    os.replace(tmp_manifest, stage / MANIFEST)
    journal.unlink()
    _fsync_dir(stage)
    old = None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not (replace and is_pack(out)):  # refused before any work otherwise
            raise InternalError(f"{out}: about to replace what is not a pack of ours")
        old = old_dir(out)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    elif out.is_dir():
        out.rmdir()  # empty: os.replace of a folder onto an empty one works, but say what we mean
    os.replace(stage, out)
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    nbytes = sum(r.nbytes for r in runs if r.key in written)
    return PackResult(out, len(runs), tuple(written), tuple(skipped), nbytes, time.perf_counter() - t0)


def _head_copy(stage: Path, data: Path, journal: Path, manifest: dict, done: dict, progress: bool) -> dict | None:
    """The int8 head copy in the staging folder (kept when a previous attempt journaled it and its
    blake2b still matches, else written from the staged head) and its manifest entry; None where
    the head takes none."""
    src = headcopy.source_tensor(manifest)
    if src is None:
        return None
    path = stage / headcopy.FILE
    rows, cols = map(int, src["shape"])
    entry = _journaled_copy(journal) if headcopy.JOURNAL_KEY in done else None
    if (
        entry is not None
        and entry.get("source_xxh3") == src["xxh3"]
        and headcopy.file_blake2b(path, headcopy.layout(rows, cols)[1]) == entry.get("blake2b")
    ):
        return entry
    fd = os.open(data, os.O_RDONLY)
    try:
        with tqdm_bar(rows * cols * 2, "int8 head", progress) as bar:
            entry = headcopy.write_copy(fd, str(data), src, path, bar.update)
    finally:
        os.close(fd)
    with open(journal, "a") as jf:
        jf.write(json.dumps({"key": headcopy.JOURNAL_KEY, "blake2b": entry["blake2b"], "entry": entry}) + "\n")
        jf.flush()
        os.fsync(jf.fileno())
    return entry


def _journaled_copy(journal: Path) -> dict | None:
    """The head copy's manifest entry a previous attempt journaled (its last line), if any."""
    found = None
    try:
        lines = read_regular(journal, "the journal", limit=MANIFEST_LIMIT).decode().splitlines()
    except (Dsv4Error, OSError, UnicodeDecodeError):
        return None
    for ln in lines[1:]:
        try:
            d = jsonio.parse_json(ln, "journal")
            if d.get("key") == headcopy.JOURNAL_KEY and isinstance(d.get("entry"), dict):
                found = d["entry"]
        except (Dsv4Error, AttributeError):
            continue
    return found


def tqdm_bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress)


def _keep_verified(fd: int, runs: list[PlannedRun], done: dict[str, str], size: int, progress: bool):
    """Runs a previous attempt journaled: keep each one whose bytes still hash the same (blake2b),
    with its checksums computed afresh from the bytes on disk."""
    digests: dict[str, RunDigest] = {}
    skipped: list[str] = []
    to_check = [r for r in runs if r.key in done and r.offset + r.nbytes <= size]
    if to_check:
        with tqdm_bar(sum(r.nbytes for r in to_check), "verify", progress) as bar:
            for r in to_check:
                d = digest_run(fd, r.offset, r.nbytes, _tensor_ranges(r), bar.update)
                if d.blake2b == done[r.key]:
                    digests[r.key] = d
                    skipped.append(r.key)
        _say(f"resuming: {len(skipped)} of {len(runs)} runs already written and verified", progress)
    return digests, skipped


def _tensor_ranges(r: PlannedRun) -> tuple[tuple[str, int, int], ...]:
    return tuple((t.src.name, t.offset, t.src.nbytes) for t in r.tensors)


def _placeholder(r: PlannedRun) -> RunDigest:
    return RunDigest("0" * 32, "0" * 16, {t.src.name: "0" * 16 for t in r.tensors})


class _Both:
    """Two hashes fed the same bytes."""

    def __init__(self, a, b) -> None:
        self.a, self.b = a, b

    def update(self, data) -> None:
        self.a.update(data)
        self.b.update(data)
