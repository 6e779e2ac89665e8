"""The pack's int8 copy of the head: `head-q8.bin` beside trunk.bin, read by `fast` numerics.

Owns: the rounding (`quantize_rows`: per row s = fl32(absmax / 127), q = rint(w / s) in
[-127, 127]), the file's layout, writing it from the packed BF16 head (`write_copy`), its
manifest entry (`head_q8`), checking that entry when a pack opens (`checked_entry`) and reading
the copy (`read_copy`, xxh3-checked like every run). The one derived file of a pack: every
other byte is the checkpoint's, unchanged.

Layout of head-q8.bin: the int8 rows (vocab x dim, row-major) from byte 0, then the float32
row scales from the next multiple of 4096, the file padded with zeros to a multiple of 4096.
The manifest's `head_q8`: file, rows, cols, scale_offset, file_bytes, scheme, blake2b and xxh3
of the whole file, and `source_xxh3`, the xxh3 of the BF16 head bytes it was made from (the
head tensor's own `xxh3` in the manifest): a copy of another head is refused.

A pack without the entry (packed before the copy existed, or a head the copy does not take:
not BF16, or a width not a multiple of 64) still runs: fast then reads the BF16 head.
`dsv4 upgrade-trunk` and `dsv4 pack-trunk` on such a pack add the copy in place (`add_in_place`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from ..checkpoint.formats import bf16_to_f32
from ..errors import CheckpointError, ReadError, ShortReadError
from ..files import atomic_write
from .format import ALIGN, CHUNK, HEAD_Q8_FILE, MANIFEST, new_hash, round_up, valid_file_name

ENTRY = "head_q8"
HEAD = "head.weight"  # the main model's head (both families); never a drafter's head
FILE = HEAD_Q8_FILE
SCHEME = "int8 rows, float32 scale per row = absmax/127, round half to even"
JOURNAL_KEY = "head-q8"  # its line in the packer's journal
COL_MULTIPLE = 64  # the kernels' width (`kernels.headq8.supports`)
ROWS_PER_CHUNK = 2048


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float weight rows (R, C) -> (int8 (R, C), float32 scale (R,)); an all-zero row has scale 0."""
    w = np.asarray(w, dtype=np.float32)
    if not np.isfinite(w).all():
        raise CheckpointError("the head holds a NaN or an infinity: no int8 copy can stand for it")
    s = (np.abs(w).max(axis=1) / np.float32(127.0)).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1.0))
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)  # float32 division, as the kernels'
    return q, s


def layout(rows: int, cols: int) -> tuple[int, int]:
    """(scale_offset, file_bytes) of the copy of a (rows, cols) head."""
    scale_offset = round_up(rows * cols, ALIGN)
    return scale_offset, round_up(scale_offset + 4 * rows, ALIGN)


def source_tensor(manifest: dict) -> dict | None:
    """The manifest's entry of the head weight the copy is made from, if the copy can take it."""
    for r in manifest.get("runs") or ():
        if r.get("key") != "head":
            continue
        for t in r.get("tensors") or ():
            shape = t.get("shape") or ()
            if t.get("name") == HEAD and t.get("dtype") == "BF16" and len(shape) == 2:
                return t if int(shape[1]) % COL_MULTIPLE == 0 else None
    return None


def copy_bytes(manifest: dict) -> int:
    """The disk (and memory) the copy takes for this pack; 0 where it cannot be made."""
    t = source_tensor(manifest)
    return layout(*map(int, t["shape"]))[1] if t is not None else 0


def copy_bytes_of(rows: int, cols: int) -> int:
    """The disk (and memory) the copy of a BF16 (rows, cols) head takes; 0 where it cannot be made."""
    return layout(rows, cols)[1] if cols % COL_MULTIPLE == 0 else 0


def write_copy(
    data_fd: int, data_path: str, src: dict, out_path: Path, on_bytes: Callable[[int], None] | None = None
) -> dict:
    """Write the copy of BF16 head `src` (a manifest tensor entry, read from data_fd) to out_path;
    the bytes read are checked against src's xxh3 first. Returns the manifest entry."""
    rows, cols = map(int, src["shape"])
    scale_offset, total = layout(rows, cols)
    h, x, sx = new_hash(), xxhash.xxh3_64(), xxhash.xxh3_64()
    scales = np.empty(rows, np.float32)
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for r0 in range(0, rows, ROWS_PER_CHUNK):
            n = min(ROWS_PER_CHUNK, rows - r0)
            raw = _pread(data_fd, data_path, int(src["offset"]) + r0 * cols * 2, n * cols * 2)
            sx.update(raw)
            q, scales[r0 : r0 + n] = quantize_rows(bf16_to_f32(np.frombuffer(raw, np.uint16).reshape(n, cols)))
            _write(fd, q.tobytes(), r0 * cols, (h, x))
            if on_bytes:
                on_bytes(len(raw))
        if sx.hexdigest() != src.get("xxh3"):
            raise CheckpointError(
                f"{data_path}: the packed head does not match its checksum; the int8 copy is not made"
            )
        _write(fd, bytes(scale_offset - rows * cols), rows * cols, (h, x))
        tail = scales.tobytes() + bytes(total - scale_offset - 4 * rows)
        _write(fd, tail, scale_offset, (h, x))
        os.fsync(fd)
    finally:
        os.close(fd)
    return {
        "file": FILE,
        "rows": rows,
        "cols": cols,
        "scale_offset": scale_offset,
        "file_bytes": total,
        "scheme": SCHEME,
        "source_xxh3": src["xxh3"],
        "blake2b": h.hexdigest(),
        "xxh3": x.hexdigest(),
    }


def _pread(fd: int, path: str, offset: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        try:
            b = os.pread(fd, min(CHUNK, n - len(out)), offset + len(out))
        except OSError as e:
            raise ReadError(f"{path}: {e.strerror} at byte {offset + len(out)}; check the disk") from None
        if not b:
            raise ShortReadError(f"{path}: short read at byte {offset + len(out)}: the file ends before the head")
        out += b
    return bytes(out)


def _write(fd: int, b: bytes, pos: int, hashes) -> None:
    for hh in hashes:
        hh.update(b)
    view, done = memoryview(b), 0
    while done < len(b):
        done += os.pwrite(fd, view[done:], pos + done)


def file_blake2b(path: Path, nbytes: int) -> str | None:
    """blake2b-128 of a copy on disk (None if it is not nbytes long): the packer's resume check."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != nbytes:
            return None
        h, done = new_hash(), 0
        while done < nbytes:
            b = os.pread(fd, min(CHUNK, nbytes - done), done)
            if not b:
                return None
            h.update(b)
            done += len(b)
        return h.hexdigest()
    finally:
        os.close(fd)


def checked_entry(root: Path, manifest: dict) -> dict | None:
    """The manifest's `head_q8`, checked against its head and the file on disk; None if absent."""
    e = manifest.get(ENTRY)
    if e is None:
        return None
    src = source_tensor(manifest)
    try:
        ok = (
            isinstance(e, dict)
            and valid_file_name(e.get("file"))
            and src is not None
            and [e["rows"], e["cols"]] == [int(v) for v in src["shape"]]
            and (e["scale_offset"], e["file_bytes"]) == layout(int(e["rows"]), int(e["cols"]))
            and e["source_xxh3"] == src["xxh3"]
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(
            f"{root}: the manifest's int8 head copy does not describe this pack's head;"
            f" run `dsv4 upgrade-trunk {root}` to write it again"
        )
    try:
        size = (root / e["file"]).stat().st_size
    except OSError:
        size = None
    if size != e["file_bytes"]:
        raise CheckpointError(
            f"{root / e['file']}: the int8 head copy is {size} bytes, the manifest says {e['file_bytes']};"
            f" run `dsv4 upgrade-trunk {root}` to write it again"
        )
    return e


def intact(root: Path, manifest: dict) -> bool:
    """Whether the manifest's copy describes its head and the file's blake2b is the entry's."""
    try:
        e = checked_entry(root, manifest)
    except CheckpointError:
        return False
    return e is not None and file_blake2b(root / e["file"], int(e["file_bytes"])) == e["blake2b"]


def read_copy(root: Path, e: dict):
    """The copy as (q int8 (rows, cols), s float32 (rows,)), its xxh3 checked."""
    path = root / e["file"]
    buf = np.empty(int(e["file_bytes"]), np.uint8)
    try:
        with open(path, "rb") as f:
            got = f.readinto(memoryview(buf))
    except OSError as err:
        raise ReadError(f"{path}: {err.strerror}; check the disk") from None
    if got != buf.size or xxhash.xxh3_64_hexdigest(memoryview(buf)) != e["xxh3"]:
        raise CheckpointError(f"{path}: the int8 head copy fails its checksum; run `dsv4 upgrade-trunk {root}`")
    rows, cols, so = int(e["rows"]), int(e["cols"]), int(e["scale_offset"])
    return buf[: rows * cols].view(np.int8).reshape(rows, cols), buf[so : so + 4 * rows].view(np.float32)


def add_in_place(root: Path, manifest: dict, on_bytes: Callable[[int], None] | None = None) -> bool:
    """Write the copy into a finished pack and record it in its manifest (the caller holds the
    packer's lock): the file first (a temporary, fsynced, renamed), the manifest last, both
    atomically. False where the head cannot have a copy."""
    src = source_tensor(manifest)
    if src is None:
        return False
    data = root / str(manifest["file"])
    tmp = root / f".{FILE}.tmp"
    fd = os.open(data, os.O_RDONLY)
    try:
        entry = write_copy(fd, str(data), src, tmp, on_bytes)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    os.replace(tmp, root / FILE)
    atomic_write(root / MANIFEST, json.dumps({**manifest, ENTRY: entry}, indent=1) + "\n")
    manifest[ENTRY] = entry
    return True
