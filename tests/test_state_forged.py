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
    template = engine.session().state
    blob = st.to_bytes(s.snapshot(), IDS[:19], "ck", template)
    header, payload = _split(blob)
    assert st.from_bytes(_forge(header, payload), "ck", template)[0].pos == 19  # the forger itself is faithful
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    refused = ran = 0
    for what, h in _edits(header):
        try:
            snap, ids = st.from_bytes(_forge(h, payload), "ck", template)
        except st.StateFileError:
            refused += 1
            continue
        r = engine.session(chunk_size=8)
        r.restore(snap)
        try:
            with np.errstate(all="ignore"):  # edited values may overflow: wrong, but no error
                r.prefill(IDS[len(ids) : len(ids) + 3])
                r.step(IDS[0])
        except Exception as e:  # noqa: BLE001 - what the test is about: nothing but StateFileError
            pytest.fail(f"{what}: accepted, then {type(e).__name__}: {e}")
        ran += 1
    assert refused > 100 and ran < refused
    assert (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 << 10
    )  # no edited counter sized an allocation
