"""Independent check of what the fast path delivered: find each tensor itself, re-read it, compare.

Owns its own view of where every tensor lives and its own reads. For a `*.safetensors` file
it parses the header with ``struct`` and ``json`` alone (8-byte little-endian length, JSON,
data section); for a packed ``trunk.bin`` it reads the ``manifest.json`` beside it. It
imports nothing from the catalog, the store layouts or ``directio``: a wrong offset there (a
header misparsed, a layout built wrongly, a window placed with the wrong residue) cannot
hide here, because each delivered array is checked against the offset *this* module found,
and re-read from there with plain buffered ``os.pread``.

What it proves, and what not: the delivered bytes equal the bytes at the place the file's
own header (or the pack's manifest) names, read a second time through the page cache. It
cannot see bytes that are wrong on disk, since both reads return the same wrong bytes: the
packed trunk's checksums and a re-download are for that. When the offsets agree and the
bytes still differ, the two reads of the same range disagreed: the fast path placed them
wrongly in its buffer, or the O_DIRECT read and the page cache returned different data (a
file changed during the run, failing storage or memory).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from .. import jsonio
from ..errors import ReadError, VerifyError

_ITEM = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}


@dataclass(frozen=True)
class Part:
    """One delivered array: `nbytes` of tensor `name` of `path` from byte `start` inside the
    tensor, which the fast path says it read at absolute `offset`."""

    path: str
    name: str
    start: int
    offset: int
    array: np.ndarray


@dataclass(frozen=True)
class _Where:
    begin: int  # absolute
    end: int
    shape: tuple[int, ...]
    itemsize: int


def _safetensors_index(path: str) -> dict[str, _Where]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise VerifyError(f"verify: {path} is too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if 8 + n > size:
            raise VerifyError(f"verify: {path}: header length {n} runs past the end of the file")
        header = jsonio.parse_json(
            f.read(n), f"verify: {path}: the safetensors header", VerifyError, jsonio.HEADER_MAX, fix="re-download it"
        )
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = _Where(8 + n + b, 8 + n + e, tuple(info["shape"]), _ITEM.get(info["dtype"], 0))
    return out


def _manifest_index(path: str) -> dict[str, _Where]:
    manifest = os.path.join(os.path.dirname(path), "manifest.json")
    m = jsonio.read_json(manifest, "the pack manifest", VerifyError, jsonio.MANIFEST_MAX, fix="re-pack the trunk")
    if os.path.basename(path) != m.get("file"):
        raise VerifyError(f"verify: {manifest} describes {m.get('file')!r}, not {os.path.basename(path)}")
    return {
        t["name"]: _Where(t["offset"], t["offset"] + t["nbytes"], tuple(t["shape"]), _ITEM.get(t["dtype"], 0))
        for r in m["runs"]
        for t in r["tensors"]
    }


class Verifier:
    """Re-reads pieces through the page cache at offsets it found itself, and compares."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._index: dict[str, dict[str, _Where]] = {}
        self._lock = threading.Lock()

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise ReadError(f"verify: cannot open {path} ({e.strerror})") from None
                self._fds[path] = fd
            return fd

    def _where(self, path: str, name: str) -> _Where:
        with self._lock:
            idx = self._index.get(path)
            if idx is None:
                try:
                    idx = _safetensors_index(path) if path.endswith(".safetensors") else _manifest_index(path)
                except (OSError, ValueError, KeyError, TypeError, VerifyError) as e:
                    raise VerifyError(f"verify: cannot find the tensors of {path} on its own ({e})") from None
                self._index[path] = idx
        w = idx.get(name)
        if w is None:
            raise VerifyError(f"verify: tensor {name} is not in {path}'s own header; the fast path read the wrong file")
        return w

    def _pread_exact(self, path: str, offset: int, nbytes: int) -> bytes:
        fd = self._fd(path)
        chunks = []
        done = 0
        while done < nbytes:
            try:
                chunk = os.pread(fd, nbytes - done, offset + done)
            except OSError as e:
                raise ReadError(f"verify: {path}: {e.strerror} at byte {offset + done}") from None
            if not chunk:
                raise ReadError(
                    f"verify: {path} ends before offset {offset + done} "
                    f"(wanted {nbytes} bytes at {offset}); the file is truncated"
                )
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)

    def check(self, key: Hashable, parts: Sequence[Part]) -> None:
        """Raise VerifyError unless every part holds exactly its tensor's bytes, at the place
        the file's own header names (see the module doc for what this proves)."""
        for p in parts:
            w = self._where(p.path, p.name)
            got = np.ascontiguousarray(p.array).view(np.uint8).reshape(-1)
            offset = w.begin + p.start
            if p.offset != offset or p.start < 0 or offset + got.nbytes > w.end:
                raise VerifyError(
                    f"verify: {key} tensor {p.name}: the fast path read {got.nbytes} bytes at offset {p.offset} of"
                    f" {p.path}, but the file's header puts them at {offset} (tensor bytes {w.begin}..{w.end});"
                    " the catalog or the store layout placed it wrongly"
                )
            whole = p.start == 0 and got.nbytes == w.end - w.begin
            if whole and w.itemsize and p.array.shape != w.shape:
                raise VerifyError(
                    f"verify: {key} tensor {p.name}: delivered with shape {p.array.shape}, the header says {w.shape}"
                )
            want = np.frombuffer(self._pread_exact(p.path, offset, got.nbytes), np.uint8)
            if not np.array_equal(got, want):
                bad = int(np.argmax(got != want))
                raise VerifyError(
                    f"verify: {key} tensor {p.name}: bytes differ from {p.path} at offset {offset}"
                    f" (first difference at +{bad}) although both reads used the header's offset: the fast path"
                    " placed the bytes wrongly in its buffer, or the disk (O_DIRECT) and the page cache returned"
                    " different data (the file changed during the run, or failing storage or memory);"
                    " run again with --io buffered to tell them apart"
                )

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._index.clear()
