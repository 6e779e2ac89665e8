"""Prompts read together (`engine.batch.forward_many`): each sequence's logits are its own pass's.

Both families (the `family` fixture), in exact, official and fast numerics: prompts of
different lengths cut into segments as `Session.prefill` cuts them (`segment_cuts`, a boundary
one token short of the prompt as the server keeps), fed in joined passes beside other sequences'
decode steps, each segment's logits and every later step compared bit for bit with a twin
session that read the same prompt alone. A mixed-up row would fail: the sequences differ.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4stream.engine.batch import Feed, forward_many
from dsv4stream.engine.session import segment_cuts
from dsv4stream.errors import UsageError

SEGMENT, CHUNK = 7, 4
PROMPTS = (5, 16, 9)  # one segment, three (7 + 7 + 2: then a boundary cuts 15 | 16), two


def _twins(engine, **kw):
    return engine.session(chunk_size=CHUNK, segment=SEGMENT, **kw), engine.session(
        chunk_size=CHUNK, segment=SEGMENT, **kw
    )


@pytest.mark.parametrize("numerics", ["exact", "official", "fast"])
def test_prompts_read_together_beside_decode_steps_are_their_solo_prefills(family, numerics) -> None:
    engine = family.engine(numerics)
    prompts = [[int(t) for t in family.ids(n, seed=60 + k)] for k, n in enumerate(PROMPTS)]
    alone, joined = zip(*[_twins(engine, record_requests=True) for _ in prompts], strict=True)
    want = [a.prefill(p, last_only=True, boundaries=[len(p) - 1]) for a, p in zip(alone, prompts, strict=True)]
    # two sequences already decoding ride along, a token each per pass (one `attend_rows` call)
    decoding = []
    for k in range(2):
        dec_alone, dec = _twins(engine, record_requests=True)
        first = [int(t) for t in family.ids(6 + k, seed=70 + k)]
        dec.prefill(first, last_only=True)
        decoding.append([dec_alone, dec, int(np.argmax(dec_alone.prefill(first, last_only=True)))])
    cuts = [segment_cuts(len(p), SEGMENT, [len(p) - 1]) for p in prompts]
    done = [0] * len(prompts)
    got: list[np.ndarray | None] = [None] * len(prompts)
    passes = 0
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        feeds, who = [], []
        for k, p in enumerate(prompts):
            if done[k] < len(p):
                b = next(c for c in cuts[k] if c > done[k])
                feeds.append(Feed(joined[k], np.asarray(p[done[k] : b]), "last" if b == len(p) else "none"))
                who.append((k, b))
        feeds += [Feed(dec, np.asarray([tok])) for _, dec, tok in decoding]
        out = forward_many(feeds)
        for d, o in zip(decoding, out[len(who) :], strict=True):
            row = d[0].step(d[2])
            assert np.array_equal(o[0], row), f"a decode row beside the prompts ({numerics})"
            d[2] = int(np.argmax(row))
        for (k, b), o in zip(who, out, strict=False):
            done[k] = b
            if b == len(prompts[k]):
                got[k] = o
            else:
                assert o is None
        passes += 1
    assert passes == max(len(c) for c in cuts)  # the prompts' segments went together
    for k in range(len(prompts)):
        assert joined[k].pos == alone[k].pos == len(prompts[k])
        assert np.array_equal(got[k], want[k]), f"prompt {k} ({numerics})"
    assert not np.array_equal(got[0], got[1])
    # each session recorded its own rows' experts (the routing hook saw its rows in the joined pass)
    for a, j in [*zip(alone, joined, strict=True), *((d[0], d[1]) for d in decoding)]:
        assert sorted(set(j.requests)) == sorted(set(a.requests))
    # and each goes on exactly as its twin
    nxt = [int(np.argmax(w)) for w in want]
    rows = forward_many([Feed(s, np.asarray([t])) for s, t in zip(joined, nxt, strict=True)])
    for k, (a, t) in enumerate(zip(alone, nxt, strict=True)):
        assert np.array_equal(rows[k][0], a.step(t)), f"prompt {k}'s first step ({numerics})"


def test_a_decode_row_beside_a_prompt_is_its_own_step(family) -> None:
    engine = family.engine("fast")
    a, b = _twins(engine)
    p = [int(t) for t in family.ids(6, seed=81)]
    tok = int(np.argmax(a.prefill(p, last_only=True)))
    b.prefill(p, last_only=True)
    reader = engine.session(chunk_size=CHUNK, segment=SEGMENT)
    prompt = [int(t) for t in family.ids(7, seed=82)]
    out = forward_many([Feed(reader, np.asarray(prompt), "all"), Feed(b, np.asarray([tok]))])
    assert out[0].shape == (len(prompt), engine.cfg.vocab_size)
    assert np.array_equal(out[1][0], a.step(tok))
    solo = engine.session(chunk_size=CHUNK, segment=SEGMENT)
    assert np.array_equal(out[0], solo.prefill(prompt))


def test_prompts_read_together_ask_each_expert_once(family) -> None:
    """Each session records its own rows' experts, as its own prefill would; the provider is asked
    once per (layer, expert) of the pass."""
    engine = family.engine("exact")
    prompts = [[int(t) for t in family.ids(5 + k, seed=90 + k)] for k in range(3)]
    pairs = [_twins(engine, record_requests=True) for _ in prompts]
    asked: list = []
    real = engine.experts.get_groups if hasattr(engine.experts, "get_groups") else None
    if real is not None:
        engine.experts.get_groups = lambda layer, ids: (asked.extend((layer, e) for e in ids), real(layer, ids))[1]
    try:
        forward_many([Feed(j, np.asarray(p), "last") for (_, j), p in zip(pairs, prompts, strict=True)])
    finally:
        if real is not None:
            del engine.experts.get_groups
    for (a, j), p in zip(pairs, prompts, strict=True):
        a.prefill(p, last_only=True)
        assert sorted(set(j.requests)) == sorted(set(a.requests))
    if real is not None:
        assert len(asked) == len(set(asked))
        assert set(asked) == {key for _, j in pairs for key in j.requests}


def test_bad_feeds_are_refused_and_feed_nothing(family) -> None:
    engine = family.engine("exact")
    a, b = _twins(engine)
    with pytest.raises(UsageError, match="at least one token"):
        forward_many([Feed(a, np.asarray([1, 2])), Feed(b, np.asarray([], dtype=np.int64))])
    with pytest.raises(UsageError, match="logits is one of"):
        forward_many([Feed(a, np.asarray([1])), Feed(b, np.asarray([1]), "first")])
    with pytest.raises(UsageError, match="no sequence"):
        forward_many([])
    assert a.pos == b.pos == 0


def test_a_pass_reading_a_prompt_runs_at_the_single_steps_count_untimed(family, monkeypatch) -> None:
    """`forward_governed`: a pass that carries a prompt's segment runs at the thread count the
    single steps' governor holds now (1 here, as on a busy machine), records nothing (its tokens
    vary), leaves the kernels at the full count, and its logits are the solo prefill's."""
    from dsv4stream.engine import batch
    from dsv4stream.engine.threads import ThreadGovernor

    engine = family.engine("fast")
    set_to: list[int] = []
    now = [2]
    monkeypatch.setattr(batch.kernels, "set_threads", lambda n: (set_to.append(n), now.__setitem__(0, n))[1])
    monkeypatch.setattr(batch.kernels, "get_threads", lambda: now[0])
    gov = ThreadGovernor(2)
    gov.current = 1
    monkeypatch.setattr(engine, "governor", gov)
    prompts = [[int(t) for t in family.ids(n, seed=95 + n)] for n in (5, 3)]
    (a0, j0), (a1, j1) = _twins(engine), _twins(engine)
    got, wall, _ = batch.forward_governed(
        [Feed(j0, np.asarray(prompts[0]), "last"), Feed(j1, np.asarray(prompts[1]), "last")]
    )
    assert wall > 0
    assert np.array_equal(got[0], a0.prefill(prompts[0], last_only=True))
    assert np.array_equal(got[1], a1.prefill(prompts[1], last_only=True))
    assert set_to == [1, 2] and now[0] == 2
    assert gov.summary() == {} and not gov._by_rows  # nothing recorded, no batch governor made
