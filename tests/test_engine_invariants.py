"""What the engine keeps whatever the model family, checked once per family (`family`, conftest.py)
on generated V4 and V4.1 checkpoints.

Prefill in any chunks and segments equals decoding one token at a time; calls continue the
sequence; the ids do not depend on the budget; each (layer, expert) is read once per segment and
each streamed trunk layer once; a session's state snapshots, restores and round-trips through a
file bit for bit, refuses damaged files and stays within what the planner counts; the thread count
changes no bit. Family-only checks stay in their own files (test_prefill.py, test_streaming.py,
test_v41_engine.py, ...).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from engine_probes import count_expert_reads, streaming

from dsv4stream.engine import state as st
from dsv4stream.engine.session import Engine
from dsv4stream.errors import UsageError
from dsv4stream.run import planner
from dsv4stream.run.runtime import Runtime

T = 48  # past every window, compression period and V4.1 candidate pool of the two checkpoints
GEN = 6


@pytest.fixture(scope="module")
def prompt(family) -> list[int]:
    return [int(t) for t in family.ids(T)]


@pytest.fixture(scope="module")
def reference(family, prompt) -> list[int]:
    """Greedy ids of the engine as `dsv4` opens it, fed one token per forward pass."""
    return list(family.engine().session(chunk_size=1, segment=1).generate(prompt, GEN))


@pytest.fixture(scope="module")
def whole(family, prompt) -> np.ndarray:
    """The prompt's logits in one chunk, from the exact engine."""
    return family.exact().session(chunk_size=64).prefill(prompt)


def rel_err(got: np.ndarray, base: np.ndarray) -> float:
    """The largest error of a row, relative to that row's largest logit."""
    return float((np.abs(got - base).max(axis=1) / np.abs(base).max(axis=1)).max())


# --- prefill, steps and calls ---


@pytest.fixture(scope="module")
def one_by_one(family, prompt) -> tuple[np.ndarray, list[int]]:
    """The exact engine fed one token per forward pass: the prompt's logits and the greedy ids."""
    eng = family.exact()
    return eng.session(chunk_size=1, segment=1).prefill(prompt), list(
        eng.session(chunk_size=1, segment=1).generate(prompt, GEN)
    )


@pytest.mark.parametrize("segment", [1, 7, 64, T])
def test_same_logits_and_ids_at_every_segment_size(family, prompt, one_by_one, segment) -> None:
    """Any chunking and segmenting of the prompt gives the logits of one token per pass, to float
    rounding, and the same greedy ids."""
    eng, (base, want) = family.exact(), one_by_one
    assert rel_err(eng.session(chunk_size=5, segment=segment).prefill(prompt), base) <= family.rtol
    assert rel_err(eng.session(chunk_size=3, segment=segment).prefill(prompt), base) <= family.rtol
    assert list(eng.session(chunk_size=3, segment=segment).generate(prompt, GEN)) == want


def test_prefill_equals_decoding_one_token_at_a_time(family, prompt, whole) -> None:
    s = family.exact().session(segment=1)
    steps = np.stack([s.step(t) for t in prompt])
    assert np.abs(steps - whole).max() <= family.rtol * np.abs(whole).max()
    assert rel_err(steps, whole) <= 10 * family.rtol


def test_calls_continue_the_sequence(family, prompt, whole) -> None:
    s = family.exact().session(chunk_size=6)
    a = s.prefill(prompt[:17])
    b = np.stack([s.step(t) for t in prompt[17:25]])
    c = s.prefill(prompt[25:])
    assert s.pos == len(prompt)
    np.testing.assert_allclose(np.concatenate([a, b, c]), whole, rtol=0, atol=family.rtol * np.abs(a).max())


def test_last_only_and_generate(family, prompt, whole) -> None:
    eng = family.exact()
    last = eng.session(chunk_size=64).prefill(prompt, last_only=True)
    np.testing.assert_allclose(last, whole[-1], atol=1e-6)
    toks = list(eng.session().generate(prompt[:10], 4))
    s = eng.session()
    logits = s.prefill(prompt[:10])[-1]
    for t in toks:
        assert t == int(np.argmax(logits))
        logits = s.step(t)


def test_bad_tokens_are_refused(family) -> None:
    s = family.engine().session()
    vocab = family.engine().cfg.vocab_size
    with pytest.raises(UsageError, match="outside the vocabulary"):
        s.prefill([1, 2, vocab])
    with pytest.raises(UsageError):
        s.prefill([])
    assert s.pos == 0


def test_routing_hooks_and_request_log(family, prompt) -> None:
    seen = []
    eng = family.engine()
    s = eng.session(
        chunk_size=4, segment=8, record_requests=True, on_route=lambda l, p, e: seen.append((l, p.copy(), e.copy()))
    )
    s.prefill(prompt[:16])
    cfg = eng.cfg
    assert [l for l, _, _ in seen] == [i for _ in range(2) for i in range(cfg.n_layers)]
    want = []
    for layer, pos, experts in seen:
        assert experts.shape == (len(pos), cfg.num_experts_per_tok)
        want += [(layer, int(e)) for e in np.unique(experts)]
    assert s.requests == want  # each expert once per layer per segment, ascending


def test_same_logits_whatever_the_thread_count(family) -> None:
    code = (
        "import sys, hashlib, numpy as np; from dsv4stream.engine.session import Engine; "
        f"e = Engine.open({str(family.path)!r}, threads=int(sys.argv[1])); "
        f"print(hashlib.sha256(e.session(chunk_size=16).prefill(np.arange(2, 200, 7)).tobytes()).hexdigest())"
    )
    out = []
    for n in ("1", "2"):
        env = dict(os.environ, OPENBLAS_NUM_THREADS=n, OMP_NUM_THREADS=n, NUMBA_NUM_THREADS=n)
        r = subprocess.run([sys.executable, "-c", code, n], env=env, capture_output=True, text=True, check=True)
        out.append(r.stdout.strip())
    assert out[0] == out[1]


# --- the budgeted runtime ---


def test_each_expert_and_trunk_layer_is_read_once_per_segment(family, prompt, monkeypatch) -> None:
    """The prompt as one segment, with fewer slots than the experts it touches and the trunk
    streamed: every (layer, expert) is read at most once and every streamed layer once. Fed in
    chunks (a segment of 4 tokens), the same prompt reads most experts again and again."""
    reads = count_expert_reads(monkeypatch)
    cfg = family.engine().cfg
    touched: set = set()

    def route(layer, positions, experts):
        touched.update((layer, int(e)) for e in experts.ravel())

    for segment, once in ((len(prompt), True), (4, False)):
        reads.clear()
        touched.clear()
        opts = streaming(family.path, cfg.n_routed_experts + 2, 1, prefill_segment=segment)  # a layer's experts fit
        with Runtime.open(family.path, opts) as rt:
            # the small segment's plan may pin a second layer in the bytes it frees
            streamed = rt.plan.streamed_layers
            assert rt.plan.prefill_segment == segment and streamed == cfg.n_layers - rt.plan.pinned_layers
            assert 1 <= rt.plan.pinned_layers <= 2 and (family.name != "v4" or streamed == cfg.n_layers - 1)
            slots = rt.plan.expert_slots
            s = rt.session(on_route=route)
            trunk0 = rt.trunk.stats().reads
            s.prefill(prompt, last_only=True)
            trunk = rt.trunk.stats().reads - trunk0
        assert set(reads) == touched
        if once:
            assert max(reads.values()) == 1 and len(touched) > slots
            assert trunk <= streamed + 1  # each streamed layer once, plus the next pass's first
        else:
            assert sum(reads.values()) > 1.5 * len(touched)  # chunk after chunk re-reads evicted experts
            assert trunk > 2 * streamed


@pytest.mark.parametrize("slots,pinned,segment", [(4, 0, None), (8, 1, 7), (12, 4, None), (24, 4, 1)])
def test_same_ids_at_every_budget_and_segment(family, reference, prompt, slots, pinned, segment) -> None:
    with Runtime.open(family.path, streaming(family.path, slots, pinned, prefill_segment=segment)) as rt:
        assert list(rt.generate(rt.session(), prompt, GEN)) == reference


def test_a_sessions_state_stays_within_what_the_planner_counts(family) -> None:
    """The state a session allocates after n tokens (window rings, compressed rows as their
    buffers grew, open windows) is at most `planner.state_bytes_for(cfg, n)`, and close to it.
    n = 4 * 129 + 3 puts the ratio-4 layers' rows just past a doubling point (129 rows in a
    buffer that a doubling rule would have grown to 256)."""
    eng = family.engine()
    n = 4 * 129 + 3
    s = eng.session(chunk_size=64, segment=200)
    s.prefill(family.ids(n - 5, seed=3), last_only=True)
    for tok in range(5):
        s.step(tok + 2)
    held, planned = s.snapshot().nbytes, planner.state_bytes_for(eng.cfg, n)
    assert held <= planned < 1.5 * held


# --- the state: snapshot, restore, files ---


def tail_logits(sess, ids) -> np.ndarray:
    out = [sess.prefill(ids[:7])]  # a chunk, then single steps: both paths after the restore
    out += [sess.step(t)[None] for t in ids[7:]]
    return np.concatenate(out)


def test_restored_session_gives_the_same_logits_bit_for_bit(family, prompt) -> None:
    # 30 tokens: past the window and several compression periods, with open windows
    ids, eng = prompt[:45], family.engine()
    a = eng.session(chunk_size=5)
    a.prefill(ids[:30])
    snap = a.snapshot()
    want = tail_logits(a, ids[30:])
    b = eng.session(chunk_size=5)
    b.restore(snap)
    assert b.pos == 30
    assert np.array_equal(tail_logits(b, ids[30:]), want)
    # the snapshot did not move while `a` and `b` went on: a second restore agrees too
    c = eng.session(chunk_size=5)
    c.restore(snap)
    assert np.array_equal(tail_logits(c, ids[30:]), want)


def test_snapshot_is_read_only_and_counts_its_bytes(family, prompt) -> None:
    s = family.engine().session()
    s.prefill(prompt[:13])
    snap = s.snapshot()
    arrays = list(st._arrays(snap.layers))
    assert arrays and all(not a.flags.writeable for a in arrays)
    assert snap.nbytes == sum(a.nbytes for a in arrays) > 0
    s.step(5)  # the live session moves on; the snapshot's arrays are other memory
    assert all(not np.shares_memory(a, b) for a in arrays for b in st._arrays(s.state))


def test_file_round_trip_continues_bit_for_bit(family, prompt) -> None:
    eng = family.engine()
    s = eng.session(chunk_size=8)
    s.prefill(prompt[:21])
    template = eng.session().state
    blob = st.to_bytes(s.snapshot(), prompt[:21], "ck1", template)
    want = tail_logits(s, prompt[21:])
    snap, ids = st.from_bytes(blob, "ck1", template)
    assert ids == prompt[:21] and snap.pos == 21
    r = eng.session(chunk_size=8)
    r.restore(snap)
    assert np.array_equal(tail_logits(r, prompt[21:]), want)


def test_bad_files_are_refused(family, prompt) -> None:
    eng = family.engine()
    s = eng.session()
    s.prefill(prompt[:9])
    template = eng.session().state
    blob = st.to_bytes(s.snapshot(), prompt[:9], "ck1", template)
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
        st.to_bytes(s.snapshot(), prompt[:8], "ck1", template)


def test_restore_refuses_a_state_of_another_shape(family) -> None:
    eng = family.engine()
    snap = st.capture(3, eng.session().state[:2])
    with pytest.raises(Exception, match="layers"):
        eng.session().restore(snap)


def test_engine_open_checks_the_family(family) -> None:
    """The family fixture really gives each family (a test run twice on one family proves nothing)."""
    assert isinstance(family.engine(), Engine)
    assert (family.engine().cfg.engram is not None) == (family.name == "v41")
