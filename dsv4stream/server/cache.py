"""Prefix reuse: session states kept by the token ids they have read, in RAM and on disk.

Owns: `StateCache` (an LRU of `SessionState`s within a byte limit, the planner's share of
`--budget` for kept states), `DiskCache` (`--kv-cache DIR`: one file per state, named by
a hash of the checkpoint identity and the ids, written atomically, evicted oldest-used
first beyond `--kv-cache-gb`; a file that fails any check is skipped with one log line),
and `checkpoint_identity`. Lookup returns the longest kept prefix strictly shorter than the
prompt: at least one token must be fed to get the next logits.

Why the file name is a hash of the ids: a lookup hashes every prefix of the prompt in one
pass (a running SHA-256, copied at each length) and asks which of those names exist; no
index file to keep consistent. The header holds the ids too, and they are compared.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from ..checkpoint.catalog import Catalog
from ..engine.state import SessionState, StateFileError, from_bytes, to_bytes

SUFFIX = ".dsv4state"
_SAMPLE = 1 << 16  # bytes read from three places of each shard for the identity

Log = Callable[[str], None]


def checkpoint_identity(cat: Catalog) -> str:
    """The catalog's header fingerprint plus a sample of each shard's bytes: two checkpoints of
    the same shapes but other weights (another seed, another fine-tune) differ here."""
    h = hashlib.sha256(cat.fingerprint.encode())
    for path in sorted({e.path for e in cat.entries.values()}):
        size = os.path.getsize(path)
        h.update(f"{Path(path).name}|{size}".encode())
        with open(path, "rb") as f:
            for at in (0, size // 2, max(size - _SAMPLE, 0)):
                f.seek(at)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()[:32]


class StateCache:
    """Kept states by token ids, least recently used dropped first beyond `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict[tuple[int, ...], SessionState] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def put(self, ids: Sequence[int], state: SessionState) -> bool:
        key = tuple(int(i) for i in ids)
        if state.nbytes > self.limit or len(key) != state.pos:
            return False
        self._items.pop(key, None)
        self._items[key] = state
        while self.nbytes > self.limit:
            self._items.popitem(last=False)
        return True

    def lookup(self, ids: Sequence[int]) -> tuple[int, SessionState] | None:
        """(length, state) of the longest kept prefix of `ids` shorter than `ids`."""
        best: tuple[int, ...] | None = None
        n = len(ids)
        for key in self._items:
            k = len(key)
            if k < n and (best is None or k > len(best)) and tuple(ids[:k]) == key:
                best = key
        if best is None:
            return None
        self._items.move_to_end(best)
        return len(best), self._items[best]


def prefix_names(identity: str, ids: Sequence[int]) -> list[str]:
    """File name of each prefix ids[:k], k = 1 .. len(ids)."""
    h = hashlib.sha256(identity.encode())
    out = []
    for i in ids:
        h.update(struct.pack("<I", int(i)))
        out.append(h.copy().hexdigest()[:40] + SUFFIX)
    return out


class DiskCache:
    """States in a directory; the directory is ours only for files ending in SUFFIX."""

    def __init__(self, root: str | os.PathLike, limit: int, identity: str, template, log: Log) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.limit = limit
        self.identity = identity
        self.template = template
        self.log = log
        self.reads = self.writes = self.rejected = 0
        self._bad: set[str] = set()  # names already refused: one log line each, not one per request

    def _files(self) -> list[Path]:
        return [p for p in self.root.iterdir() if p.name.endswith(SUFFIX) and p.is_file()]

    @property
    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self._files())

    def put(self, ids: Sequence[int], state: SessionState) -> Path | None:
        blob = to_bytes(state, ids, self.identity, self.template)
        if len(blob) > self.limit:
            return None
        path = self.root / prefix_names(self.identity, ids)[-1]
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            self.log(f"kv-cache: cannot write {path} ({e.strerror}); going on without it")
            return None
        finally:
            tmp.unlink(missing_ok=True)
        self.writes += 1
        self._bad.discard(path.name)
        self._evict(keep=path)
        return path

    def lookup(self, ids: Sequence[int], shorter_than: int = 0) -> tuple[int, SessionState] | None:
        """The longest usable file for a prefix of `ids` shorter than `ids` and longer than
        `shorter_than` tokens (a RAM hit of that length is as good and costs no read)."""
        names = prefix_names(self.identity, ids[:-1]) if len(ids) > 1 else []
        present = {p.name for p in self._files()}
        for k in range(len(names), shorter_than, -1):
            name = names[k - 1]
            if name not in present or name in self._bad:
                continue
            path = self.root / name
            try:
                state, got = from_bytes(path.read_bytes(), self.identity, self.template)
                if got != [int(i) for i in ids[:k]]:
                    raise StateFileError("token ids differ from its name's")
            except (StateFileError, OSError) as e:
                self.rejected += 1
                self._bad.add(name)
                self.log(f"kv-cache: ignoring {path}: {e}")
                continue
            os.utime(path)  # recently used: evicted last
            self.reads += 1
            return k, state
        return None

    def _evict(self, keep: Path) -> None:
        files = sorted(self._files(), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for p in files:
            if total <= self.limit:
                break
            if p == keep:
                continue
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
