"""`dsv4 upgrade-trunk`: bring a pack of an older format to the current one, in place.

Owns: adding the int8 head copy to a pack without one (`headcopy.add_in_place`), and upgrading format 1 (blake2b plus a plain sum of 64-bit words, blind to reordered
blocks) to format 2 (blake2b plus xxh3 per run and per tensor). The old manifest is first
checked whole with the runtime's own rules (`TrunkFile.checked`: keys and names once each,
every tensor inside its run, names, dtypes and shapes as in the checkpoint), so what the
upgrade passes the runtime opens. Every run is then read once and its blake2b compared with
the manifest's, and each tensor's xxh3 with the xxh3 of the checkpoint's own bytes for that
name: the new sums describe bytes the strong hash vouched for, bound to their names (a
manifest with two same-shape tensors swapped is refused). One mismatch and nothing is
changed (pack it again). The data file is never written; the manifest is replaced
atomically, under the packer's lock, and only if the data file is still the one hashed.

The checkpoint: `checkpoint` when given, else the folder holding the pack (pack-trunk's
default place, CHECKPOINT_DIR/dsv4-trunk); its fingerprint must be the manifest's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import xxhash

from ..checkpoint.catalog import Catalog
from ..errors import CheckpointError, Dsv4Error, UsageError
from ..files import atomic_write, describe, open_regular, read_regular
from . import headcopy
from .format import CHUNK, FAST_CHECKSUM, FORMAT, MANIFEST, UPGRADABLE, digest_run, valid_file_name
from .packdir import MANIFEST_LIMIT, drop_lock, lock_path, take_lock
from .reader import TrunkFile, _restart, identity


@dataclass(frozen=True)
class UpgradeResult:
    path: Path
    runs: int
    bytes_checked: int
    old_format: str
    up_to_date: bool = False
    head_copy: bool = False  # the int8 head copy was added


def _fail(root: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{root}: {why}; nothing was changed — delete it and run `dsv4 pack-trunk` again")


def upgrade_trunk(
    out_dir: str | os.PathLike,
    on_bytes: Callable[[int], None] | None = None,
    checkpoint: str | os.PathLike | None = None,
) -> UpgradeResult:
    """Upgrade the pack in `out_dir` in place (see the module docstring)."""
    root = Path(out_dir)
    if describe(root) != "a directory":
        raise UsageError(f"{root}: not a folder holding a packed trunk; give the pack's folder (OUT_DIR of pack-trunk)")
    if describe(root / MANIFEST) is None:
        raise UsageError(f"{root}: no manifest.json here; give the pack's folder (OUT_DIR of pack-trunk)")
    lock_fd = take_lock(lock_path(root), root)
    try:
        return _upgrade_locked(root, on_bytes, checkpoint)
    finally:
        drop_lock(lock_path(root), lock_fd)


def _catalog(root: Path, checkpoint: str | os.PathLike | None, fingerprint: object) -> Catalog:
    """The checkpoint the pack was made from (named, or the pack's parent folder)."""
    where = Path(checkpoint) if checkpoint is not None else root.resolve().parent
    try:
        cat = Catalog.open(where)
    except Dsv4Error as e:
        if checkpoint is not None:
            raise
        raise UsageError(
            f"{root}: the upgrade compares every tensor with the checkpoint it was packed from, and {where} is"
            f" not one ({str(e)[:120]}); give it: `dsv4 upgrade-trunk {root} --checkpoint CHECKPOINT_DIR`"
        ) from None
    if cat.fingerprint != fingerprint:
        raise UsageError(
            f"{root}: packed from another checkpoint than {where} (fingerprint {fingerprint!r}, it has"
            f" {cat.fingerprint!r}); give the right one with --checkpoint CHECKPOINT_DIR"
        )
    return cat


def _shard_xxh3(path: str, offset: int, nbytes: int) -> str:
    """xxh3-64 of a tensor's bytes in a checkpoint shard, read in bounded memory."""
    x = xxhash.xxh3_64()
    fd = open_regular(path, "a checkpoint shard", CheckpointError)
    try:
        done = 0
        while done < nbytes:
            b = os.pread(fd, min(CHUNK, nbytes - done), offset + done)
            if not b:
                raise CheckpointError(f"{path}: ends before its tensor at byte {offset + done}; the shard is truncated")
            x.update(b)
            done += len(b)
    finally:
        os.close(fd)
    return x.hexdigest()


def _upgrade_locked(root: Path, on_bytes: Callable[[int], None] | None, checkpoint) -> UpgradeResult:
    mpath = root / MANIFEST
    try:
        m = json.loads(read_regular(mpath, "the manifest", CheckpointError, limit=MANIFEST_LIMIT))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _fail(root, f"manifest.json is unreadable ({type(e).__name__})") from None
    fmt = m.get("format") if isinstance(m, dict) else None
    if fmt == FORMAT:
        return _add_head_copy(root, m, on_bytes, UpgradeResult(root, len(m.get("runs") or ()), 0, fmt, True))
    if fmt not in UPGRADABLE:
        raise _fail(root, f"manifest format {fmt!r} is not one this dsv4stream can upgrade ({', '.join(UPGRADABLE)})")
    m.pop(headcopy.ENTRY, None)  # format 1 predates the int8 head copy: written again below
    name = m.get("file")
    if not valid_file_name(name):
        raise _fail(root, f"the manifest's 'file' {name!r} is not a plain file name inside the pack")
    cat = _catalog(root, checkpoint, m.get("fingerprint"))
    try:  # the old manifest, whole, by the rules the runtime opens a pack with (no sums read yet)
        old = {
            **m,
            "runs": [{**r, "xxh3": "", "tensors": [{**t, "xxh3": ""} for t in r["tensors"]]} for r in m["runs"]],
        }
        TrunkFile.checked(root, old, cat, probe=False)  # bytes: every one below, against the checkpoint's
    except (KeyError, TypeError) as e:
        raise _fail(root, f"manifest.json is malformed ({type(e).__name__}: {e})") from None
    except CheckpointError as e:
        raise _fail(root, f"the old manifest does not hold ({str(e).removesuffix('; ' + _restart(root))})") from None
    data = root / name
    fd = open_regular(data, "the packed trunk's data file", CheckpointError)
    try:
        before = identity(os.fstat(fd))
        if before[2] != m.get("file_bytes"):
            raise _fail(root, f"{name} is {before[2]} bytes, the manifest says {m.get('file_bytes')}")
        checked = 0
        for r in m["runs"]:
            tensors = tuple((str(t["name"]), int(t["offset"]), int(t["nbytes"])) for t in r["tensors"])
            d = digest_run(fd, int(r["offset"]), int(r["nbytes"]), tensors, on_bytes, str(data))
            if d.blake2b != r["blake2b"]:
                raise _fail(root, f"run '{r['key']}' fails its blake2b checksum ({d.blake2b} != {r['blake2b']})")
            r.pop("sum64", None)
            r["xxh3"] = d.xxh3
            for t in r["tensors"]:
                e = cat.entries[str(t["name"])]
                if _shard_xxh3(e.path, e.offset, e.nbytes) != d.tensors[str(t["name"])]:
                    raise _fail(
                        root,
                        f"tensor '{t['name']}' of run '{r['key']}' is not the checkpoint's bytes of that name"
                        " (the manifest puts another tensor there)",
                    )
                t["xxh3"] = d.tensors[str(t["name"])]
            checked += int(r["nbytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(root, f"manifest.json is malformed ({type(e).__name__}: {e})") from None
    finally:
        os.close(fd)
    try:
        after = identity(os.stat(data))
    except OSError:
        after = None
    if after != before:
        raise _fail(root, f"{name} changed while it was being checked")
    m["format"], m["fast_checksum"] = FORMAT, FAST_CHECKSUM
    atomic_write(mpath, json.dumps(m, indent=1) + "\n")
    return _add_head_copy(root, m, on_bytes, UpgradeResult(root, len(m["runs"]), checked, str(fmt)))


def _add_head_copy(root: Path, m: dict, on_bytes, done: UpgradeResult) -> UpgradeResult:
    """A current-format pack without the int8 head copy, or whose copy fails its checks (another
    head's, damaged, missing), gets one (`headcopy.add_in_place`: the packed head's bytes checked
    against their xxh3 first, file then manifest written atomically)."""
    if headcopy.source_tensor(m) is None:
        return done
    if headcopy.ENTRY in m and headcopy.intact(root, m):
        return done
    name = m.get("file")
    if not valid_file_name(name):
        raise _fail(root, f"the manifest's 'file' {name!r} is not a plain file name inside the pack")
    headcopy.add_in_place(root, m, on_bytes)
    return replace(done, up_to_date=False, head_copy=True)
