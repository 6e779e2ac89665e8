"""Prefix caches of `dsv4 serve`: the RAM LRU within its byte limit, the disk cache (atomic
files named by the ids, longest prefix first, size-capped LRU, bad files skipped with one
log line), and the checkpoint identity (same shapes, other weights: another identity)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from server_proc import one_thread_engine

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.engine.state import capture, to_bytes
from dsv4stream.server.cache import (
    SUFFIX,
    CacheBusy,
    CacheUnwritable,
    DiskCache,
    StateCache,
    checkpoint_identity,
    prefix_names,
)

IDS = [int(i) for i in np.random.default_rng(1).integers(0, 512, size=40)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synth.make_checkpoint(tmp_path_factory.mktemp("c") / "tiny", preset="tiny", seed=2)


@pytest.fixture(scope="module")
def engine(ckpt):
    yield from one_thread_engine(ckpt)


def _state(engine, n):
    s = engine.session()
    s.prefill(IDS[:n])
    return s.snapshot()


def test_ram_cache_longest_shorter_prefix_and_lru(engine) -> None:
    s10, s20, s30 = _state(engine, 10), _state(engine, 20), _state(engine, 30)
    c = StateCache(limit=s10.nbytes + max(s20.nbytes, s30.nbytes))
    assert c.put(IDS[:10], s10) and c.put(IDS[:20], s20)
    assert c.lookup(IDS)[0] == 20
    assert c.lookup(IDS[:20])[0] == 10  # never the whole prompt: one token must be fed
    assert c.lookup([IDS[0] + 1, *IDS[1:]]) is None
    assert c.lookup(IDS[:5]) is None
    c.lookup(IDS[:15])  # 10 is now the most recent
    c.put(IDS[:30], s30)
    assert c.nbytes <= c.limit and c.lookup(IDS)[0] == 30 and c.lookup(IDS[:25])[0] == 10  # 20 evicted
    assert not StateCache(limit=s10.nbytes - 1).put(IDS[:10], s10)  # too big for the limit: not kept


def test_disk_cache_round_trip_and_bad_files(engine, ckpt, tmp_path) -> None:
    ident = checkpoint_identity(Catalog.open(ckpt))
    template = engine.session().state
    logs: list[str] = []
    d = DiskCache(tmp_path, 10**9, ident, template, logs.append)
    p12, p25 = d.put(IDS[:12], _state(engine, 12)), d.put(IDS[:25], _state(engine, 25))
    assert p12.name == prefix_names(ident, IDS[:12])[-1] and p12.name.endswith(SUFFIX)
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    got = d.lookup(IDS)
    assert got[0] == 25 and got[1].pos == 25
    a = engine.session()
    a.restore(got[1])
    b = engine.session()
    b.prefill(IDS[:25])
    assert np.array_equal(a.step(IDS[25]), b.step(IDS[25]))

    blob = bytearray(p25.read_bytes())
    blob[-40] ^= 1
    p25.write_bytes(bytes(blob))
    assert d.lookup(IDS)[0] == 12 and len(logs) == 1 and "ignoring" in logs[0] and "checksum" in logs[0]
    assert d.lookup(IDS)[0] == 12 and len(logs) == 1  # one line per bad file, not per request
    p12.write_bytes(p12.read_bytes()[:-500])  # truncated
    assert d.lookup(IDS) is None and len(logs) == 2
    # a state of another checkpoint under a name this one would use
    other = to_bytes(_state(engine, 7), IDS[:7], "another-checkpoint", template)
    (tmp_path / prefix_names(ident, IDS[:7])[-1]).write_bytes(other)
    assert d.lookup(IDS) is None and "another checkpoint" in logs[-1]
    # a good write under a refused name is used again
    d.put(IDS[:25], _state(engine, 25))
    assert d.lookup(IDS)[0] == 25


def test_disk_cache_is_capped_oldest_used_first(engine, tmp_path) -> None:
    template = engine.session().state
    one = len(to_bytes(_state(engine, 10), IDS[:10], "x", template))
    d = DiskCache(tmp_path, int(2.5 * one), "x", template, lambda m: None)
    d.put(IDS[:10], _state(engine, 10))
    d.put(IDS[:11], _state(engine, 11))
    old = os.stat(tmp_path / prefix_names("x", IDS[:10])[-1]).st_mtime
    os.utime(tmp_path / prefix_names("x", IDS[:11])[-1], (old - 100, old - 100))  # 11 used longest ago
    d.put(IDS[:12], _state(engine, 12))
    names = {p.name for p in tmp_path.iterdir() if p.name.endswith(SUFFIX)}  # the lock file beside them
    assert prefix_names("x", IDS[:11])[-1] not in names and len(names) == 2 and d.nbytes <= d.limit
    (tmp_path / "notes.txt").write_text("not ours")
    d.put(IDS[:13], _state(engine, 13))
    assert (tmp_path / "notes.txt").read_text() == "not ours"


def test_identity_tells_weights_apart(ckpt, tmp_path) -> None:
    same_shapes = synth.make_checkpoint(tmp_path / "other", preset="tiny", seed=3)
    a, b = Catalog.open(ckpt), Catalog.open(same_shapes)
    assert a.fingerprint == b.fingerprint  # headers alone cannot tell them apart
    assert checkpoint_identity(a) != checkpoint_identity(b)
    assert checkpoint_identity(a) == checkpoint_identity(Catalog.open(ckpt))


def test_capture_of_unknown_objects_fails_loudly() -> None:
    with pytest.raises(TypeError):
        to_bytes(capture(1, [object.__new__(type("Weird", (), {"__slots__": ()}))]), [1], "x", [])


def test_the_plan_counts_the_kept_states(ckpt) -> None:
    from dsv4stream.run.memory import measure
    from dsv4stream.run.runinfo import RunOptions

    one, five = measure(ckpt, RunOptions(budget=1)), measure(ckpt, RunOptions(budget=1, kept_states=4))
    assert five.state_bytes == 5 * one.state_bytes > 0


# ---- the disk cache's start-up and reads: stale temporaries, bogus files, read-only folders ----------


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_start_removes_only_our_temporaries_of_dead_servers(engine, ckpt, tmp_path) -> None:
    name = prefix_names("x", IDS[:3])[-1]
    dead = tmp_path / f".{name}.tmp{_dead_pid()}"
    alive = tmp_path / f".{name}.tmp{os.getppid()}"
    foreign = tmp_path / f".notes.txt.tmp{_dead_pid()}"
    kept_state = tmp_path / name
    for p in (dead, alive, foreign, kept_state):
        p.write_bytes(b"partial")
    logs: list[str] = []
    d = DiskCache(tmp_path, 10**9, "x", engine.session().state, logs.append)
    assert d.removed_stale == 1 and not dead.exists()
    assert alive.exists() and foreign.exists() and kept_state.exists()
    assert len(logs) == 1 and "removed 1 unfinished" in logs[0]


def test_a_large_bogus_file_is_refused_by_its_header_and_size_before_it_is_read(engine, tmp_path, monkeypatch) -> None:
    template = engine.session().state
    logs: list[str] = []
    d = DiskCache(tmp_path, 8 << 30, "x", template, logs.append)
    reads: list[int] = []
    real = os.pread
    monkeypatch.setattr("dsv4stream.server.cache.os.pread", lambda fd, n, at: reads.append(n) or real(fd, n, at))
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} read whole"))
    names = prefix_names("x", IDS)
    big = tmp_path / names[9]  # a 3 GB sparse file: bad magic
    with open(big, "wb") as f:
        f.write(b"NOTSTATE" + bytes(100))
        f.truncate(3 << 30)
    good = to_bytes(_state(engine, 5), IDS[:5], "x", template)
    lying = tmp_path / names[7]  # a real header, then 3 GB the header does not describe
    with open(lying, "wb") as f:
        f.write(good)
        f.truncate(3 << 30)
    huge = tmp_path / names[8]  # past the cache's cap: refused by its size alone
    with open(huge, "wb") as f:
        f.truncate(9 << 30)
    t0 = time.monotonic()
    assert d.lookup(IDS) is None
    assert time.monotonic() - t0 < 10 and max(reads) < 1 << 20, reads
    assert len(logs) == 3 and "bad magic" in logs[0] and "more than the cache's cap" in logs[1]
    assert "its header describes" in logs[2]


def test_a_fifo_in_the_cache_is_named_not_waited_on(engine, tmp_path) -> None:
    logs: list[str] = []
    d = DiskCache(tmp_path, 10**9, "x", engine.session().state, logs.append)
    os.mkfifo(tmp_path / prefix_names("x", IDS)[4])
    assert d.lookup(IDS) is None and "is a FIFO" in logs[0]


def test_an_unwritable_cache_folder_is_refused_at_start(engine, tmp_path, monkeypatch) -> None:
    real = os.open

    def read_only(path, flags, *a):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, *a)

    monkeypatch.setattr("dsv4stream.server.cache.os.open", read_only)
    with pytest.raises(CacheUnwritable, match="cannot write there"):
        DiskCache(tmp_path, 10**9, "x", engine.session().state, print)


def test_a_folder_another_live_server_holds_is_refused_naming_it(engine, tmp_path) -> None:
    # another process holds the folder (as a running server does, for its whole life)
    code = "import sys, time; from dsv4stream.server.cache import FolderLock; FolderLock(sys.argv[1]); print('held', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(CacheBusy, match=f"in use by another running dsv4 server \\(pid {holder.pid} "):
            DiskCache(tmp_path, 10**9, "x", engine.session().state, print)
    finally:
        holder.kill()
        holder.wait()
    # the holder died without cleaning up: its lock went with it, the folder is free again
    d = DiskCache(tmp_path, 10**9, "x", engine.session().state, print)
    with pytest.raises(CacheBusy):  # and held by this one now
        DiskCache(tmp_path, 10**9, "x", engine.session().state, print)
    d.close()
    DiskCache(tmp_path, 10**9, "x", engine.session().state, print).close()


def test_a_file_that_vanishes_is_a_miss_never_an_error(engine, tmp_path, monkeypatch) -> None:
    import dsv4stream.server.cache as cache_mod

    template = engine.session().state
    logs: list[str] = []
    one = len(to_bytes(_state(engine, 10), IDS[:10], "x", template))
    d = DiskCache(tmp_path, int(2.5 * one), "x", template, logs.append)
    d.put(IDS[:10], _state(engine, 10))
    d.put(IDS[:11], _state(engine, 11))
    # removed by someone else between the listing and the read: no hit, no error, nothing logged
    real_open = cache_mod.open_regular

    def vanishing(path, *a, **k):
        Path(path).unlink()
        return real_open(path, *a, **k)

    monkeypatch.setattr(cache_mod, "open_regular", vanishing)
    assert d.lookup(IDS[:12]) is None and not logs and d.rejected == 0
    monkeypatch.undo()
    # listed, then gone before its size is asked (eviction, the byte count): left out
    d.put(IDS[:10], _state(engine, 10))
    ghost = tmp_path / prefix_names("x", IDS[:3])[-1]
    real_iterdir = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: iter([ghost, *real_iterdir(self)]))
    for k in (11, 12, 13):
        assert d.put(IDS[:k], _state(engine, k)) is not None
        assert d.nbytes <= d.limit
    assert d.lookup(IDS)[0] == 13 and not logs


# ---- splicing the sampled ids back ----------------------------------------------------------------


def test_splice_puts_back_the_sampled_ids_of_a_reply_sent_back_as_text() -> None:
    # a toy decode: each id is one or two letters, so one text has several spellings
    spell = {1: "a", 2: "b", 3: "ab", 4: "<", 5: ">", 6: "c"}

    def decode(ids):
        return "".join(spell[int(i)] for i in ids)

    c = StateCache(limit=10**9)
    prompt, sampled = [4, 6, 5], [1, 2, 1]  # the model sampled a, b, a
    c.remember(prompt + sampled)
    resent = [4, 6, 5, 3, 1, 4, 6]  # the client sent "aba" back, re-tokenised as ab, a; then a new turn
    assert c.splice(resent, decode) == [4, 6, 5, 1, 2, 1, 4, 6]
    assert decode(c.splice(resent, decode)) == decode(resent)
    assert c.splice([4, 6, 5, 3, 6, 4], decode) == [4, 6, 5, 3, 6, 4]  # "abc": another text, untouched
    assert c.splice([4, 6, 5, 1, 2, 1, 4], decode) == [4, 6, 5, 1, 2, 1, 4]  # already the sampled ids
    assert c.splice([4, 6, 5, 3, 1], decode) == [4, 6, 5, 3, 1]  # nothing after the reply: nothing to gain
