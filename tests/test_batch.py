"""A batched decode pass (`engine.batch.step_many`) gives each row the bits of that session's own step.

Both families (the `family` fixture), in exact, official and fast numerics: sequences at
different positions (prompts of different lengths), rows joining and leaving between passes,
and each row's logits compared bit for bit with a twin session fed the same tokens one step at a
time. A test that a mixed-up row would fail: the rows' logits differ from one another.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4stream.engine.batch import read_ahead_many, step_many
from dsv4stream.errors import UsageError

PROMPTS = (5, 11, 3, 8)  # prompt lengths: the sequences sit at different positions
STEPS = 6


def _pair(engine, prompt):
    """Two sessions fed the same prompt: one steps alone (the reference), one in the batch."""
    alone, batched = engine.session(chunk_size=4, segment=7), engine.session(chunk_size=4, segment=7)
    a, b = alone.prefill(prompt, last_only=True), batched.prefill(prompt, last_only=True)
    assert np.array_equal(a, b)
    return alone, batched, a


@pytest.mark.parametrize("numerics", ["exact", "official", "fast"])
def test_batched_rows_are_the_solo_steps_bit_for_bit(family, numerics) -> None:
    engine = family.engine(numerics)
    prompts = [[int(t) for t in family.ids(n, seed=20 + k)] for k, n in enumerate(PROMPTS)]
    rows = [_pair(engine, p) for p in prompts]
    # row k is in the batch for passes [join, leave): the batch has 2, 4, 3, 2 ... rows
    live = {0: (0, STEPS), 1: (0, STEPS - 2), 2: (1, STEPS), 3: (2, 4)}
    next_ids = [int(np.argmax(logits)) for _, _, logits in rows]
    for step in range(STEPS):
        now = [k for k, (a, b) in live.items() if a <= step < b]
        toks = [next_ids[k] for k in now]
        read_ahead_many([rows[k][1] for k in now], toks)  # as the server does once it picked them
        got = step_many([rows[k][1] for k in now], toks)
        assert got.shape == (len(now), engine.cfg.vocab_size)
        for j, k in enumerate(now):
            want = rows[k][0].step(toks[j])
            assert np.array_equal(got[j], want), f"row {k} at step {step} ({numerics})"
            assert rows[k][1].pos == rows[k][0].pos
            next_ids[k] = int(np.argmax(want))
        assert not np.array_equal(got[0], got[1])  # the rows really are different sequences


def test_one_row_is_a_plain_step_and_bad_batches_are_refused(family) -> None:
    engine = family.engine("exact")
    a, b, logits = _pair(engine, [int(t) for t in family.ids(4)])
    tok = int(np.argmax(logits))
    assert np.array_equal(step_many([b], [tok])[0], a.step(tok))
    with pytest.raises(UsageError, match="twice"):
        step_many([a, a], [tok, tok])
    with pytest.raises(UsageError, match="sessions for"):
        step_many([a, b], [tok])
    with pytest.raises(UsageError, match="outside the vocabulary"):
        step_many([a, b], [tok, engine.cfg.vocab_size])
    assert a.pos == b.pos  # a refused pass fed nothing


def test_the_batched_pass_fetches_each_expert_once_for_all_rows(family) -> None:
    """Each session records the experts its own row chose, as its own step would; the provider is
    asked once per (layer, expert) of the pass."""
    engine = family.engine("exact")
    seqs = [engine.session(record_requests=True) for _ in range(3)]
    solo = [engine.session(record_requests=True) for _ in range(3)]
    toks = []
    for k, (s, t) in enumerate(zip(seqs, solo, strict=True)):
        p = [int(x) for x in family.ids(4 + k, seed=40 + k)]
        toks.append(int(np.argmax(s.prefill(p, last_only=True))))
        t.prefill(p, last_only=True)
        s.requests.clear()
        t.requests.clear()
    asked: list = []
    real = engine.experts.get_groups if hasattr(engine.experts, "get_groups") else None
    if real is not None:
        engine.experts.get_groups = lambda layer, ids: (asked.extend((layer, e) for e in ids), real(layer, ids))[1]
    try:
        step_many(seqs, toks)
    finally:
        if real is not None:
            del engine.experts.get_groups
    for s, t, tok in zip(seqs, solo, toks, strict=True):
        t.step(tok)
        assert sorted(s.requests) == sorted(t.requests)
    if real is not None:
        assert len(asked) == len(set(asked))
        assert set(asked) == {key for s in seqs for key in s.requests}


def test_a_governed_pass_tries_thread_counts_per_batch_size(family, monkeypatch) -> None:
    """`step_governed`: the engine's governor picks each pass's thread count from the passes of the
    same size (`ThreadGovernor.for_rows`), tries another count after FIRST_PROBE passes, gets every
    pass's time back, leaves the kernels at its full count, and the logits are the solo step's."""
    from dsv4stream.engine import batch
    from dsv4stream.engine.threads import FIRST_PROBE, PROBE_STEPS, ThreadGovernor

    engine = family.engine("exact")
    seqs = [_pair(engine, [int(t) for t in family.ids(3 + k, seed=60 + k)]) for k in range(2)]
    toks = [int(np.argmax(logits)) for _, _, logits in seqs]
    set_to: list[int] = []
    now = [2]
    monkeypatch.setattr(batch.kernels, "set_threads", lambda n: (set_to.append(n), now.__setitem__(0, n))[1])
    monkeypatch.setattr(batch.kernels, "get_threads", lambda: now[0])
    monkeypatch.setattr(engine, "governor", ThreadGovernor(2))
    passes = FIRST_PROBE + PROBE_STEPS + 1
    for _ in range(passes):
        got, wall, spent = batch.step_governed([b for _, b, _ in seqs], toks)
        assert wall > 0 and spent["expert_reads"] >= 0
        for j, (alone, _, _) in enumerate(seqs):
            assert np.array_equal(got[j], alone.step(toks[j]))
        toks = [int(np.argmax(r)) for r in got]
    two = engine.governor.for_rows(2)
    assert two is not engine.governor and engine.governor.for_rows(1) is engine.governor
    assert two.steps == {2: passes - PROBE_STEPS, 1: PROBE_STEPS}  # the try of 1 thread ran its passes
    assert engine.governor.steps == {2: 0, 1: 0}  # the single-sequence governor saw none of them
    assert engine.governor.summary() == {"2": passes - PROBE_STEPS, "1": PROBE_STEPS}
    assert set_to[0] == 1 and set_to[-1] == 2 and now[0] == 2  # the try, then back to every thread


def test_the_attention_projects_the_rows_of_a_pass_in_one_product(family, monkeypatch) -> None:
    """The stateful half of a batched pass (the stack's `attend_rows`): each projection of the
    attention (wq_a, wq_b, wkv, wo_b) is one product over the B rows, not B one-row products;
    only the state's part runs row by row (the rows' bits: the test above)."""
    import importlib

    attention = importlib.import_module(f"dsv4stream.model.{family.name}.attention")
    engine = family.engine("exact")
    rows = [_pair(engine, [int(t) for t in family.ids(3 + 2 * k, seed=80 + k)]) for k in range(3)]
    toks = [int(np.argmax(logits)) for _, _, logits in rows]
    seen: list[tuple[int, int]] = []
    real = attention.matmul
    monkeypatch.setattr(attention, "matmul", lambda w, x: (seen.append((id(w), x.shape[0])), real(w, x))[1])
    got = step_many([b for _, b, _ in rows], toks)
    projections = set()
    for i in range(engine.cfg.n_layers):
        a = engine.trunk.layer(i).attn
        projections |= {id(a.wq_a), id(a.wq_b), id(a.wkv), id(a.wo_b)}
    mine = [n for w, n in seen if w in projections]
    assert mine and all(n == 3 for n in mine)
    assert len(mine) == 4 * engine.cfg.n_layers  # once each per layer for the pass
    for j, (alone, _, _) in enumerate(rows):
        assert np.array_equal(got[j], alone.step(toks[j]))
