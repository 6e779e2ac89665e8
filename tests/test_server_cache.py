"""Prefix caches of `dsv4 serve`: the RAM LRU within its byte limit, the disk cache (atomic
files named by the ids, longest prefix first, size-capped LRU, bad files skipped with one
log line), and the checkpoint identity (same shapes, other weights: another identity)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from server_proc import one_thread_engine

from dsv4stream.checkpoint import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.engine.state import capture, to_bytes
from dsv4stream.server.cache import SUFFIX, DiskCache, StateCache, checkpoint_identity, prefix_names

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
    names = {p.name for p in tmp_path.iterdir()}
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
