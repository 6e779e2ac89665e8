"""`dsv4 upgrade-trunk`: bring a pack of an older format to the current one, in place.

Owns: upgrading format 1 (blake2b plus a plain sum of 64-bit words, blind to reordered
blocks) to format 2 (blake2b plus xxh3 per run and per tensor). Every run is read once and
its blake2b compared with the manifest's before any new sum is written, so the new sums
describe bytes the strong hash vouched for; one mismatch and nothing is changed (the pack
is corrupted: pack it again). The data file is never written; the manifest is replaced
atomically, under the packer's lock, and only if the data file is still the one hashed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, UsageError
from ..files import atomic_write, describe, open_regular, read_regular
from .format import FAST_CHECKSUM, FORMAT, MANIFEST, UPGRADABLE, digest_run, valid_file_name
from .packdir import MANIFEST_LIMIT, drop_lock, lock_path, take_lock
from .reader import identity


@dataclass(frozen=True)
class UpgradeResult:
    path: Path
    runs: int
    bytes_checked: int
    old_format: str
    up_to_date: bool = False


def _fail(root: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{root}: {why}; nothing was changed — delete it and run `dsv4 pack-trunk` again")


def upgrade_trunk(out_dir: str | os.PathLike, on_bytes: Callable[[int], None] | None = None) -> UpgradeResult:
    """Upgrade the pack in `out_dir` in place (see the module docstring)."""
    root = Path(out_dir)
    if describe(root) != "a directory":
        raise UsageError(f"{root}: not a folder holding a packed trunk; give the pack's folder (OUT_DIR of pack-trunk)")
    if describe(root / MANIFEST) is None:
        raise UsageError(f"{root}: no manifest.json here; give the pack's folder (OUT_DIR of pack-trunk)")
    lock_fd = take_lock(lock_path(root), root)
    try:
        return _upgrade_locked(root, on_bytes)
    finally:
        drop_lock(lock_path(root), lock_fd)


def _upgrade_locked(root: Path, on_bytes: Callable[[int], None] | None) -> UpgradeResult:
    mpath = root / MANIFEST
    try:
        m = json.loads(read_regular(mpath, "the manifest", CheckpointError, limit=MANIFEST_LIMIT))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _fail(root, f"manifest.json is unreadable ({type(e).__name__})") from None
    fmt = m.get("format") if isinstance(m, dict) else None
    if fmt == FORMAT:
        return UpgradeResult(root, len(m.get("runs") or ()), 0, fmt, up_to_date=True)
    if fmt not in UPGRADABLE:
        raise _fail(root, f"manifest format {fmt!r} is not one this dsv4stream can upgrade ({', '.join(UPGRADABLE)})")
    name = m.get("file")
    if not valid_file_name(name):
        raise _fail(root, f"the manifest's 'file' {name!r} is not a plain file name inside the pack")
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
    return UpgradeResult(root, len(m["runs"]), checked, str(fmt))
