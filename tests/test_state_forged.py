"""State files whose checksum was recomputed after an edit (issue 40, item 10): every field of
the header is checked against a fresh session's state and the header's own counters, so an
edited file is refused with StateFileError or, when the edit leaves a state that session could
have reached, continues without error; never an exception in the forward pass, never an
allocation sized by an edited counter. V4 and V4.1 (with Engram) states."""

from __future__ import annotations

import hashlib
import json
import resource
import struct

import numpy as np
import pytest
from server_proc import one_thread_engine

from dsv4stream import synth
from dsv4stream.engine import state as st

IDS = [int(i) for i in np.random.default_rng(5).integers(0, 500, size=23)]
LEAD = len(st.MAGIC) + 8


@pytest.fixture(scope="module", params=["tiny", "tiny-v41-long"])
def engine(request, tmp_path_factory):
    yield from one_thread_engine(synth.make_checkpoint(tmp_path_factory.mktemp("f") / "ck", preset=request.param))


def _split(blob: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", blob[len(st.MAGIC) : LEAD])
    return json.loads(blob[LEAD : LEAD + n]), blob[LEAD + n : -32]


def _forge(header: dict, payload: bytes) -> bytes:
    """A file of this header, the payload cut or zero-padded to what its table describes, and
    the checksum recomputed: only the header's checks can refuse it."""
    size = 0
    for dtype, shape, _ in header["arrays"]:
        try:
            size += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        except (TypeError, ValueError):
            pass
    size = max(0, min(size, 1 << 24))
    payload = payload[:size] + bytes(size - len(payload[:size]))
    head = json.dumps(header).encode()
    body = st.MAGIC + struct.pack("<Q", len(head)) + head + payload
    return body + hashlib.sha256(body).digest()


def _edits(header: dict):
    """(what, edited header) for each counter, shape and dtype of the file, a few ways each."""

    def walk(node, path):
        if isinstance(node, bool):
            yield path, [not node]
        elif isinstance(node, int):
            yield path, [node + 1, node - 2, 10**9, -(10**9), 1.5, "3", None, True]
        elif isinstance(node, list):
            for i, c in enumerate(node):
                yield from walk(c, [*path, i])
        elif isinstance(node, dict):
            for k, c in node.items():
                yield from walk(c, [*path, k])

    def put(h, path, value):
        for k in path[:-1]:
            h = h[k]
        h[path[-1]] = value

    for path, values in walk({k: header[k] for k in ("pos", "ids", "tree", "arrays")}, []):
        if path[0] == "arrays" and path[-1] != 2 and len(path) == 3:
            continue  # the dtype string
        for v in values:
            h = json.loads(json.dumps(header))
            put(h, path, v)
            yield f"{path}={v!r}", h
    for i, (dtype, shape, _) in enumerate(header["arrays"]):
        for other in ("<f8", "<i8", "<f2", "|u1", "|O", "<c8", "[('a', '<f4')]", "<V4"):
            if other != dtype:
                h = json.loads(json.dumps(header))
                h["arrays"][i][0] = other
                yield f"array {i} dtype {other}", h
        for grown in ([s * 2 + 1 for s in shape], [*shape, 1], shape[1:], [shape[0] + 1, *shape[1:]]):
            h = json.loads(json.dumps(header))
            h["arrays"][i][1] = grown
            yield f"array {i} shape {grown}", h
    h = json.loads(json.dumps(header))
    h["ids"], h["pos"] = h["ids"][:-1], h["pos"] - 1
    yield "one id and position less", h


def test_an_edited_state_file_is_refused_or_runs(engine) -> None:
    s = engine.session(chunk_size=8)
    s.prefill(IDS[:19])
    template, agrees = engine.session().state, engine.stack.agrees
    blob = st.to_bytes(s.snapshot(), IDS[:19], "ck", template)
    header, payload = _split(blob)
    faithful = st.from_bytes(_forge(header, payload), "ck", template, agrees)[0]
    assert faithful.pos == 19  # the forger itself is faithful
    same = st.to_bytes(faithful, IDS[:19], "ck", template)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    refused = ran = 0
    for what, h in _edits(header):
        try:
            snap, ids = st.from_bytes(_forge(h, payload), "ck", template, agrees)
        except st.StateFileError:
            refused += 1
            continue
        ran += 1
        if len(ids) == 19 and st.to_bytes(snap, IDS[:19], "ck", template) == same:
            continue  # the state written, bit for bit (an edited id: the forward pass never reads them)
        r = engine.session(chunk_size=8)
        r.restore(snap)
        try:
            with np.errstate(all="ignore"):  # edited values may overflow: wrong, but no error
                r.prefill(IDS[len(ids) : len(ids) + 3])
                r.step(IDS[0])
        except Exception as e:  # noqa: BLE001 - what the test is about: nothing but StateFileError
            pytest.fail(f"{what}: accepted, then {type(e).__name__}: {e}")
    assert refused > 100 and ran < refused
    assert (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 << 10
    )  # no edited counter sized an allocation


def _counters(node, path=()):
    """(path, value) of every integer of the header's position, ids, object tree and array table
    (bools excluded: they are flags, not counts)."""
    if isinstance(node, int) and not isinstance(node, bool):
        yield list(path), node
    elif isinstance(node, list):
        for i, c in enumerate(node):
            yield from _counters(c, (*path, i))
    elif isinstance(node, dict):
        for k, c in node.items():
            yield from _counters(c, (*path, k))


def _continue(engine, snap, ids) -> np.ndarray:
    r = engine.session(chunk_size=8)
    r.restore(snap)
    out = r.prefill(IDS[len(ids) : len(ids) + 3])
    return np.concatenate([np.asarray(out).ravel(), r.step(IDS[0])])


def test_every_counter_one_off_is_refused_or_changes_nothing(engine) -> None:
    """Each integer of a saved state's header, +1 and -1 (checksum recomputed): refused, or the
    restored session gives the same logits bit for bit. Row counts, open-window rows, index keys,
    ring positions and array shapes are all tied to the position, and V4.1's Engram history to
    the last token ids (`Stack.agrees`), so none can drift."""
    s = engine.session(chunk_size=8)
    s.prefill(IDS[:19])
    template, agrees = engine.session().state, engine.stack.agrees
    header, payload = _split(st.to_bytes(s.snapshot(), IDS[:19], "ck", template))
    snap, ids = st.from_bytes(_forge(header, payload), "ck", template, agrees)
    same, want = st.to_bytes(snap, IDS[:19], "ck", template), _continue(engine, snap, ids)
    tried = refused = 0
    for path, value in _counters({k: header[k] for k in ("pos", "ids", "tree", "arrays")}):
        for v in (value + 1, value - 1):
            h = json.loads(json.dumps(header))
            node = h
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = v
            tried += 1
            try:
                snap, ids = st.from_bytes(_forge(h, payload), "ck", template, agrees)
            except st.StateFileError:
                refused += 1
                continue
            if st.to_bytes(snap, IDS[:19], "ck", template) == same:
                continue  # the very state written (an edit of the ids the forward pass never reads)
            with np.errstate(all="ignore"):
                try:
                    got = _continue(engine, snap, ids)
                except Exception as e:  # noqa: BLE001 - what the test is about: nothing but StateFileError
                    pytest.fail(f"{path}={v}: accepted, then {type(e).__name__}: {e}")
            assert np.array_equal(got, want, equal_nan=True), f"{path}={v}: accepted, and the logits differ"
    assert tried > 100 and refused > tried // 2
