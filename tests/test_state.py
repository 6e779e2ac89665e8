"""Session snapshot / restore and the state file: a restored session continues bit for bit
like the uninterrupted one; damaged, truncated or foreign files are refused."""

from __future__ import annotations

import numpy as np
import pytest
from server_proc import one_thread_engine

from dsv4stream import synth
from dsv4stream.engine import state as st

IDS = [int(i) for i in np.random.default_rng(3).integers(0, 512, size=45)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    yield from one_thread_engine(synth.make_checkpoint(tmp_path_factory.mktemp("st") / "tiny", preset="tiny", seed=11))


def _tail_logits(sess, ids) -> np.ndarray:
    out = [sess.prefill(ids[:7])]  # a chunk, then single steps: both paths after the restore
    out += [sess.step(t)[None] for t in ids[7:]]
    return np.concatenate(out)


def test_restored_session_gives_the_same_logits_bit_for_bit(engine) -> None:
    # 30 tokens: past the window (8) and several compression periods (4, 8), with open windows
    a = engine.session(chunk_size=16)
    a.prefill(IDS[:30])
    snap = a.snapshot()
    want = _tail_logits(a, IDS[30:])
    b = engine.session(chunk_size=16)
    b.restore(snap)
    assert b.pos == 30
    assert np.array_equal(_tail_logits(b, IDS[30:]), want)
    # the snapshot did not move while `a` and `b` went on: a second restore agrees too
    c = engine.session(chunk_size=16)
    c.restore(snap)
    assert np.array_equal(_tail_logits(c, IDS[30:]), want)


def test_snapshot_is_read_only_and_counts_its_bytes(engine) -> None:
    s = engine.session()
    s.prefill(IDS[:13])
    snap = s.snapshot()
    arrays = list(st._arrays(snap.layers))
    assert arrays and all(not a.flags.writeable for a in arrays)
    assert snap.nbytes == sum(a.nbytes for a in arrays) > 0
    s.step(5)  # the live session moves on; the snapshot's arrays are other memory
    assert all(not np.shares_memory(a, b) for a in arrays for b in st._arrays(s.state))


def test_file_round_trip_continues_bit_for_bit(engine) -> None:
    s = engine.session(chunk_size=8)
    s.prefill(IDS[:21])
    template = engine.session().state
    blob = st.to_bytes(s.snapshot(), IDS[:21], "ck1", template)
    want = _tail_logits(s, IDS[21:])
    snap, ids = st.from_bytes(blob, "ck1", template)
    assert ids == IDS[:21] and snap.pos == 21
    r = engine.session(chunk_size=8)
    r.restore(snap)
    assert np.array_equal(_tail_logits(r, IDS[21:]), want)


def test_bad_files_are_refused(engine) -> None:
    s = engine.session()
    s.prefill(IDS[:9])
    template = engine.session().state
    blob = st.to_bytes(s.snapshot(), IDS[:9], "ck1", template)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x40
    for bad, why in (
        (blob[:-100], "checksum"),
        (bytes(flipped), "checksum"),
        (b"not a state" * 9, "magic"),
        (b"", "magic"),
    ):
        with pytest.raises(st.StateFileError, match=why):
            st.from_bytes(bad, "ck1", template)
    with pytest.raises(st.StateFileError, match="another checkpoint"):
        st.from_bytes(blob, "ck2", template)
    with pytest.raises(st.StateFileError, match="layout"):
        st.from_bytes(blob, "ck1", template[:-1])
    with pytest.raises(ValueError):
        st.to_bytes(s.snapshot(), IDS[:8], "ck1", template)


def test_restore_refuses_a_state_of_another_shape(engine) -> None:
    snap = st.capture(3, engine.session().state[:2])
    with pytest.raises(Exception, match="layers"):
        engine.session().restore(snap)
