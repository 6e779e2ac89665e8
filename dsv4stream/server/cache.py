"""Prefix reuse: session states kept by the token ids they have read, in RAM and on disk.

Owns: `StateCache` (an LRU of `SessionState`s within a byte limit, the planner's share of
`--budget` for kept states; `splice` puts back the ids the server itself sampled in place of
a re-tokenised reply), `DiskCache` (`--kv-cache DIR`: one file per state, named by a hash of
the checkpoint identity and the ids, written atomically, evicted oldest-used first beyond
`--kv-cache-gb`; a file that fails any check is skipped with one log line), and
`checkpoint_identity`. Lookup returns the longest kept prefix strictly shorter than the
prompt: at least one token must be fed to get the next logits. Nothing here looks inside a
state: any engine's state value is kept, written and read the same way.

Why the file name is a hash of the ids: a lookup hashes every prefix of the prompt in one
pass (a running SHA-256, copied at each length) and asks which of those names exist; no
index file to keep consistent. The header holds the ids too, and they are compared.

What the disk cache refuses before reading a file whole: anything but a regular file (a
FIFO never blocks a request), a file larger than the cache's cap, and a file whose header
(magic, length, version, array table) does not account for exactly its size. At start it
removes the temporary files (`.NAME.tmpPID`) a server killed mid-write left behind, only
those of our naming and only when that PID is no longer running; a folder it cannot write
raises `CacheUnwritable` at start (the server then runs without the disk cache, saying so once).

Images (V4.1): every position of an image's span carries the same `image_token_id`, so two
different images of one size give the same ids. The ids a job is kept and looked up by
(`image_keys`) put in each span position a surrogate id derived from a hash of the image's
pixels as the tower reads them (the decoded, resized, normalised patches): at least KEY_BASE,
so above any vocabulary, and below the state file's 2**31 limit on ids. A conversation that
resends an image finds its states; another image of the same size does not. `keyed_decode`
gives each surrogate a text of its own, so `splice` never takes one image's key for another's.

One server per folder: the cache evicts by its own cap and counts, so two servers sharing a
folder would delete each other's files. `FolderLock` holds an exclusive `flock` on
`.dsv4-kv-cache.lock` in it for the server's life (the kernel drops it when the process
dies, so no stale lock outlives a killed server); a second server is refused with one line
naming the holder. A file that vanishes anyway (a person cleaning up) is a miss, never an error.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import os
import re
import socket
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from ..checkpoint.catalog import Catalog
from ..engine.state import Agrees, SessionState, StateFileError, from_bytes, peek, to_bytes
from ..errors import Dsv4Error
from ..files import open_regular

SUFFIX = ".dsv4state"
_TEMP = re.compile(r"^\.([0-9a-f]{40}" + re.escape(SUFFIX) + r")\.tmp([0-9]+)$")  # what put() writes first
_SAMPLE = 1 << 16  # bytes read from three places of each shard for the identity

KEY_BASE = 1 << 30  # surrogate ids of image span positions start here (`image_keys`)
SAMPLED_KEPT = 64  # sequences remembered for splice (ids only: a few KB each)

Log = Callable[[str], None]
Decode = Callable[[Sequence[int]], str]


def image_keys(
    ids: Sequence[int], starts: Sequence[int], lengths: Sequence[int], digests: Sequence[bytes]
) -> list[int]:
    """`ids` (an expanded prompt) with the span of image k (starts[k], lengths[k] positions)
    keyed by its digest: position j of the span holds KEY_BASE + (h + j) mod 2**30, h from the
    digest, so spans of other images differ from their first position on."""
    out = [int(i) for i in ids]
    for start, n, digest in zip(starts, lengths, digests, strict=True):
        h = int.from_bytes(hashlib.sha256(digest).digest()[:8], "little")
        for j in range(n):
            out[start + j] = KEY_BASE + (h + j) % KEY_BASE
    return out


def keyed_decode(decode: Decode) -> Decode:
    """`decode` that takes keyed ids: each surrogate becomes a text of its own (a private-use
    character and its number), never the text of a token."""

    def run(ids: Sequence[int]) -> str:
        out, plain = [], []
        for i in ids:
            if i >= KEY_BASE:
                if plain:
                    out.append(decode(plain))
                    plain = []
                out.append(f"\ue000{i}\ue001")
            else:
                plain.append(i)
        if plain:
            out.append(decode(plain))
        return "".join(out)

    return run


class CacheUnwritable(Dsv4Error):
    """The --kv-cache folder cannot take new files (read-only, not ours to write)."""


class CacheBusy(Dsv4Error):
    """The --kv-cache folder is held by another running server."""


LOCK_NAME = ".dsv4-kv-cache.lock"


class FolderLock:
    """This process's exclusive hold on a cache folder, until `close` or the process ends.

    The lock file's text (pid and host of the holder) is only for the message; the lock is
    the `flock`, so a file left by a dead server is taken over, never trusted."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK_NAME
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode("ascii", "replace").strip() or "its pid not written yet"
            os.close(self.fd)
            raise CacheBusy(
                f"--kv-cache {self.root}: in use by another running dsv4 server ({holder}); "
                "give each server its own folder"
            ) from None
        except BaseException:
            os.close(self.fd)
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the flock
            self.fd = -1


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
        # whole sequences the server fed and sampled (prompt + reply, the last token included,
        # though no state holds it): splice needs them when a reply ended without EOS
        self._sampled: OrderedDict[tuple[int, ...], None] = OrderedDict()

    def remember(self, ids: Sequence[int]) -> None:
        """Keep `ids` (a prompt and the reply sampled for it) for `splice`, most recent last."""
        key = tuple(int(i) for i in ids)
        self._sampled.pop(key, None)
        self._sampled[key] = None
        while len(self._sampled) > SAMPLED_KEPT:
            self._sampled.popitem(last=False)

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

    def splice(self, ids: Sequence[int], decode: Decode) -> list[int]:
        """`ids` with a leading part replaced by a kept key that spells the same text.

        A client sends the server's reply back as text, and the prompt tokenizes it afresh:
        the ids need not be the ones sampled (BPE has many spellings of one text), so the kept
        state after the reply would never match. For each kept key that is not a prefix of
        `ids`, past their common ids, the key's remaining ids and some run of `ids` must
        decode to the same text; then the key replaces that run (the text, so what the model
        reads as text, is unchanged). The longest such key wins; `ids` unchanged when none."""
        best: tuple[int, ...] | None = None
        best_end = 0
        for key in [*self._items, *self._sampled]:
            if best is not None and len(key) <= len(best):
                continue
            c = _common(key, ids)
            if c == len(key) or c == len(ids):
                continue
            end = _same_text_end(key[c:], ids, c, decode)
            if end is not None and end < len(ids):
                best, best_end = key, end
        return list(ids) if best is None else [*best, *ids[best_end:]]

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


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _same_text_end(tail: Sequence[int], ids: Sequence[int], start: int, decode: Decode) -> int | None:
    """The end e such that ids[start:e] decodes to exactly the text of `tail`, or None.
    The decoded length grows with e, so the candidates are found by bisection (a few decodes)."""
    want = decode(tail)
    if not want:
        return None
    lengths = _Lengths(ids, start, decode)
    e = bisect.bisect_right(lengths, len(want), lo=start + 1, hi=len(ids) + 1) - 1
    for end in (e, e - 1, e + 1):  # a multi-byte character may straddle the bisection's guess
        if start < end <= len(ids) and decode(ids[start:end]) == want:
            return end
    return None


class _Lengths:
    """len(decode(ids[start:e])) indexed by e, computed on demand (for bisect)."""

    def __init__(self, ids: Sequence[int], start: int, decode: Decode) -> None:
        self.ids, self.start, self.decode = ids, start, decode

    def __getitem__(self, e: int) -> int:
        return len(self.decode(self.ids[self.start : e]))

    def __len__(self) -> int:
        return len(self.ids) + 1


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

    def __init__(
        self,
        root: str | os.PathLike,
        limit: int,
        identity: str,
        template,
        log: Log,
        lock: FolderLock | None = None,
        agrees: Agrees | None = None,
    ) -> None:
        """`lock`: the folder's, taken earlier (the server takes it before loading the model);
        taken here when not given. CacheBusy when another process holds it. `template`, `agrees`:
        a fresh session's state and its stack's `agrees`, what a file is checked against."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.limit = limit
        self.identity = identity
        self.template = template
        self.agrees = agrees
        self.log = log
        self.reads = self.writes = self.rejected = 0
        self._bad: set[str] = set()  # names already refused: one log line each, not one per request
        self._check_writable()
        self.lock = lock if lock is not None else FolderLock(self.root)
        self.removed_stale = self._remove_stale_temps()

    def close(self) -> None:
        self.lock.close()

    def _check_writable(self) -> None:
        probe = self.root / f".write-test.tmp{os.getpid()}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise CacheUnwritable(f"--kv-cache {self.root}: cannot write there ({e.strerror})") from None
        os.close(fd)
        probe.unlink(missing_ok=True)

    def _remove_stale_temps(self) -> int:
        """Temporary files of ours whose writer is no longer running (a server killed mid-write)."""
        removed = 0
        for p in self.root.iterdir():
            m = _TEMP.match(p.name)
            if m is None or _running(int(m.group(2))):
                continue
            try:
                p.unlink()
                removed += 1
            except FileNotFoundError:
                pass
        if removed:
            self.log(f"kv-cache: removed {removed} unfinished file(s) a stopped server left in {self.root}")
        return removed

    def _files(self) -> list[tuple[Path, os.stat_result]]:
        """Our state files with their stat, those that vanish meanwhile left out."""
        out = []
        for p in self.root.iterdir():
            if p.name.endswith(SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    if p.is_file():
                        out.append((p, st))
        return out

    @property
    def nbytes(self) -> int:
        return sum(st.st_size for _, st in self._files())

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
        # every entry of our naming, not only regular files: one that is not gets named in the log
        present = {p.name for p in self.root.iterdir() if p.name.endswith(SUFFIX)}
        for k in range(len(names), shorter_than, -1):
            name = names[k - 1]
            if name not in present or name in self._bad:
                continue
            path = self.root / name
            try:
                state, got = from_bytes(self._read(path), self.identity, self.template, self.agrees)
                if got != [int(i) for i in ids[:k]]:
                    raise StateFileError("token ids differ from its name's")
                os.utime(path)  # recently used: evicted last
            except (StateFileError, OSError) as e:
                if not os.path.lexists(path):
                    continue  # removed since the listing (another hand cleaning up): a plain miss
                self.rejected += 1
                self._bad.add(name)
                self.log(f"kv-cache: ignoring {path}: {e}")
                continue
            self.reads += 1
            return k, state
        return None

    def _read(self, path: Path) -> bytes:
        """A state file's bytes, refused by type, size and header before the payload is read."""
        fd = open_regular(path, "a kv cache state", StateFileError)
        try:
            size = os.fstat(fd).st_size
            if size > self.limit:
                raise StateFileError(f"{size:,} bytes, more than the cache's cap of {self.limit:,}")
            peek(lambda at, n: os.pread(fd, n, at), size)
            blob = os.pread(fd, size, 0)
            if len(blob) != size:
                raise StateFileError("shorter than when it was opened")
            return blob
        finally:
            os.close(fd)

    def _evict(self, keep: Path) -> None:
        files = sorted(self._files(), key=lambda f: f[1].st_mtime)
        total = sum(st.st_size for _, st in files)
        for p, st in files:
            if total <= self.limit:
                break
            if p == keep:
                continue
            total -= st.st_size
            p.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    """Whether a process with this id exists (one of another user counts: it is not ours to judge)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
