"""One decode pass over several sequences: `step_many(sessions, token_ids)` -> logits (B, vocab).

Owns: the batched forward pass that continuous batching (`dsv4 serve --max-batch`) runs. Each
layer's weights are fetched once for the pass; each sequence's half of the layer that reads
and updates its state (`Stack.attend`: attention on its own rings and compressed rows, at its
own position; V4.1's Engram and index keys) runs on that sequence's row alone; the stateless
half (`Stack.ffn`: mHC mixing, norms, the router and the MoE) runs once over the B rows, so
each routed expert chosen by any row is fetched and multiplied once for all the rows that
chose it; the head (a third of a token with the model in RAM) multiplies the B rows in one
read of its weight.

Exactness: every row's logits are bit for bit those of the same session's `step`. It holds
because nothing in the stateless half mixes rows: the kernels give a row the bits of its
one-token product whatever other rows share the call, in every numerics mode (`kernels`,
`kernels.numerics`: the rule of issue 44), the mHC, norms and routing are row by row, and each
token sums its experts in ascending id order whatever the batch (`model.moe`).
tests/test_batch.py checks it for both families in exact, official and fast numerics.

`step_governed` is the pass a server runs: timed (wall seconds and seconds by phase, as a
`Session.generate` step is) at the kernel thread count the engine's governor picks for passes of
that many rows (`engine.threads`).

Not here: the generation loop around it (picking, stops, the turn's record: `engine.decode_batch`)
and the server's scheduling (`server.worker`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..errors import NumericsError, UsageError
from ..model.moe import GroupedSource
from ..weights.providers import grouped_source
from . import numerics as run_numerics
from .phases import StepClock
from .session import Session, layer_numerics_error
from .steps import PassContext

_WANTS = ("all", "last", "none")


@dataclass(frozen=True)
class Feed:
    """One sequence's part of a joined pass (`forward_many`): `ids` fed to `session`; `logits`:
    "all" (every row's, as `step`), "last" (the last row's, as a prefill's last segment with
    last_only) or "none" (a prefill segment before the last)."""

    session: Session
    ids: np.ndarray
    logits: str = "all"


def forward_many(feeds: Sequence[Feed]) -> list[np.ndarray | None]:
    """Feed each feed's ids to its session, all in one forward pass: per feed its logits ((T, vocab)
    for "all", (vocab,) for "last", None for "none"), bit for bit those of the session's own pass
    of the same ids (`Session._forward`: a `step`, or one segment of `prefill`).

    Every feed's attention runs on its own rows and state (one-row feeds together through the
    family's `attend_rows`); the stateless half and the head run once over every feed's rows.
    The sessions share one engine and appear once each; a session's trace sees its own rows
    entering each layer (a drafter's taps) and nothing else, so one that reads layers' outputs
    is refused. A failure inside the layers leaves every session of the pass torn."""
    feeds = list(feeds)
    if not feeds:
        raise UsageError("forward_many: no sequence to feed")
    sessions = [f.session for f in feeds]
    engine = sessions[0].engine
    if any(s.engine is not engine for s in sessions):
        raise UsageError("forward_many: the sessions of one pass must share one engine")
    if len({id(s) for s in sessions}) != len(sessions):
        raise UsageError("forward_many: a session appears twice in one pass")
    if any(s.trace is not None and getattr(s.trace, "reads_outputs", True) for s in sessions):
        # (the streams entering layers are each session's own rows, before the joined half: a
        # drafter's taps, `engine.speculate.Observer`; a layer's outputs are the joined pass's)
        raise UsageError("forward_many: a session whose trace reads layers' outputs steps alone")
    if any(f.logits not in _WANTS for f in feeds):
        raise UsageError(f"forward_many: logits is one of {', '.join(_WANTS)}")
    rows = [s._check_ids(f.ids) for s, f in zip(sessions, feeds, strict=True)]
    if any(r.size == 0 for r in rows):
        raise UsageError("forward_many: every sequence feeds at least one token")
    if len(feeds) == 1:  # the session's own pass
        out = sessions[0]._forward(rows[0], logits=feeds[0].logits != "none", last_only=feeds[0].logits == "last")
        return [None if out is None else out[-1] if feeds[0].logits == "last" else out]
    run_numerics.ensure(engine.cfg.family, engine.numerics)
    total = sum(r.size for r in rows)
    for hook in {id(s.before_pass): s.before_pass for s in sessions if s.before_pass is not None}.values():
        hook(total)  # the pass's memory (a run's sessions share one `make_room`)
    stack, n_layers = engine.stack, engine.cfg.n_layers
    passes = [s._begin(r) for s, r in zip(sessions, rows, strict=True)]  # nothing changed yet
    keeps = [
        s._rows_used(r.size, f.logits != "none", f.logits == "last")
        for s, r, f in zip(sessions, rows, feeds, strict=True)
    ]
    spans: list[tuple[int, int]] = []  # each session's rows in the joined pass of the layer running
    ctx = _joined_context(sessions, spans)
    try:
        for i in range(n_layers):
            w = engine.trunk.layer(i)  # once for the pass
            last = i == n_layers - 1
            try:
                joined, parts, order = _attend(stack, sessions, passes, i, w, keeps if last else None)
                spans[:] = _row_spans(passes, order)
                if joined.ids.size:
                    stack.ffn(ctx, joined, i, w)
            except NumericsError as e:
                raise layer_numerics_error(engine.cfg, i, w, e) from None
            _split(stack, joined, parts, passes)
    except BaseException:
        for s in sessions:
            s.torn = True
        raise
    for s, r in zip(sessions, rows, strict=True):
        s.pos += r.size
    wanted = [k for k, f in enumerate(feeds) if f.logits != "none"]
    out: list[np.ndarray | None] = [None] * len(feeds)
    if wanted:
        head = stack.join([passes[k] for k in wanted]) if len(wanted) > 1 else passes[wanted[0]]
        logits = sessions[0]._logits(head, last_only=False)
        a = 0
        for k in wanted:
            b = a + passes[k].ids.size
            out[k] = logits[b - 1] if feeds[k].logits == "last" else logits[a:b]
            a = b
    return out


def step_many(sessions: Sequence[Session], token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Feed token_ids[b] to sessions[b], all in one forward pass: logits (B, vocab) float32, row b
    equal bit for bit to `sessions[b].step(token_ids[b])` (`forward_many` of one-token feeds)."""
    sessions = list(sessions)
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if not sessions or len(sessions) != ids.size:
        raise UsageError(f"step_many: {len(sessions)} sessions for {ids.size} token ids (one each, at least one)")
    got = forward_many([Feed(s, ids[b : b + 1]) for b, s in enumerate(sessions)])
    return np.concatenate(got)


def step_governed(
    sessions: Sequence[Session], token_ids: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, float, dict[str, float]]:
    """`step_many` timed: (logits (B, vocab), wall seconds, seconds by phase), at the thread count
    the engine's governor picks for passes of B rows (`forward_governed`)."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if len(sessions) != ids.size:
        raise UsageError(f"step_many: {len(sessions)} sessions for {ids.size} token ids (one each, at least one)")
    got, wall, spent = forward_governed([Feed(s, ids[b : b + 1]) for b, s in enumerate(sessions)])
    return np.concatenate(got), wall, spent


def forward_governed(feeds: Sequence[Feed]) -> tuple[list[np.ndarray | None], float, dict[str, float]]:
    """`forward_many` timed: (its logits, wall seconds, seconds by phase). A pass of one-token feeds
    (decode steps) runs at the thread count the engine's governor (None: `--threads` fixed,
    nothing chosen) picks for passes of that many rows, and its compute (wall less the read
    waits, which threads do not change) goes back to it. A pass that reads a prompt's segment
    runs at the count the single steps' governor holds now (what the machine's load favours:
    on 2 busy vCPUs prompts read at every thread lost to one thread, docs/serving.md), untimed
    (its tokens vary from pass to pass). The kernels are at the governor's full count again
    afterwards."""
    engine = feeds[0].session.engine
    clock = StepClock(engine.meter)
    decode = all(np.size(f.ids) == 1 for f in feeds)
    gov = engine.governor.for_rows(len(feeds)) if engine.governor is not None and decode else None
    threads = gov.next_threads() if gov is not None else engine.governor.current if engine.governor else 0
    if threads and threads != kernels.get_threads():
        kernels.set_threads(threads)
    try:
        clock.begin()
        logits = forward_many(feeds)
        wall, spent = clock.end()
    finally:
        if engine.governor is not None and threads != engine.governor.most:
            kernels.set_threads(engine.governor.most)
    if gov is not None:
        gov.record(threads, wall - spent["expert_reads"] - spent["trunk_reads"])
    return logits, wall, spent


def read_ahead_many(sessions: Sequence[Session], token_ids: Sequence[int] | np.ndarray) -> None:
    """`Session.read_ahead` for each session's next token, the pass's memory made for all of them."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    for s, t in zip(sessions, ids, strict=True):
        s.read_ahead([t], pass_tokens=len(sessions))


def _attend(stack, sessions: list[Session], passes: list, i: int, w, keeps: list | None):
    """Layer i's stateful half for every feed (keeps: each one's `Stack.layer` keep, on the last
    layer), joined for the stateless half: (the joined pass, the parts it joins, the feeds in the
    order of its rows). One-row feeds
    that keep their row go in one call where the family's stack has one (`attend_rows`: the
    projections shared, each row's state apart); every other feed attends on its own rows."""
    rows_of = getattr(stack, "attend_rows", None)
    single = [k for k, p in enumerate(passes) if p.ids.size == 1 and (keeps is None or keeps[k] is None)]
    if rows_of is None or len(single) < 2:
        single = []
    for k, (s, p) in enumerate(zip(sessions, passes, strict=True)):
        if k not in single:
            stack.attend(s.pass_context(), p, i, w, s.state, None if keeps is None else keeps[k])
    if not single:
        return stack.join(passes), passes, range(len(passes))
    rows = rows_of(
        [passes[k] for k in single], i, w, [sessions[k].state for k in single], [sessions[k].trace for k in single]
    )
    if len(single) == len(passes):
        return rows, passes, range(len(passes))
    parts = [rows, *(p for k, p in enumerate(passes) if k not in single)]
    return stack.join(parts), parts, [*single, *(k for k in range(len(passes)) if k not in single)]


def _split(stack, joined, parts: list, passes: list) -> None:
    """The joined pass's rows back into the feeds' passes (through the one-row feeds' joined part)."""
    stack.split(joined, parts)
    if parts is not passes:
        single = [p for p in passes if not any(p is q for q in parts)]
        stack.split(parts[0], single)


def _row_spans(passes: list, order) -> list[tuple[int, int]]:
    """Each pass's rows (a, b) in the joined pass of a layer, whose rows hold the passes in `order`."""
    spans = [(0, 0)] * len(passes)
    a = 0
    for k in order:
        spans[k] = (a, a + passes[k].ids.size)
        a = spans[k][1]
    return spans


def _joined_context(sessions: list[Session], spans: list[tuple[int, int]]) -> PassContext:
    """The context of the stateless half over the joined rows (session k's rows spans[k], set for
    each layer before its stateless half): each session's `on_route` sees its own rows, the chosen
    experts are asked for once for all rows, and a session that records its requests records its
    rows' experts, as its own pass would."""
    engine = sessions[0].engine
    routed_rows: dict[int, np.ndarray] = {}

    def routed(layer: int, positions: np.ndarray, prefetch: bool = True) -> Callable[[np.ndarray], None]:
        def hook(experts: np.ndarray) -> None:
            routed_rows[layer] = experts
            for s, (a, b) in zip(sessions, spans, strict=True):
                if s.on_route is not None and b > a:
                    s.on_route(layer, positions[a:b], experts[a:b])
            if prefetch:
                engine.experts.prefetch([(layer, int(e)) for e in np.unique(experts)])

        return hook

    def experts_of(layer: int) -> GroupedSource:
        def record(ids: np.ndarray) -> None:
            chosen = routed_rows.pop(layer, None)
            for s, (a, b) in zip(sessions, spans, strict=True):
                if s.requests is not None and chosen is not None and b > a:
                    s.requests.extend((layer, int(e)) for e in np.unique(chosen[a:b]))

        return grouped_source(engine.experts, layer, record)

    return PassContext(sessions[0].chunk_size, None, experts_of, routed)


__all__ = ["Feed", "forward_governed", "forward_many", "read_ahead_many", "step_governed", "step_many"]
