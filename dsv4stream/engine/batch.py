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

import numpy as np

from .. import kernels
from ..errors import NumericsError, UsageError
from ..model.moe import GroupedSource
from ..weights.providers import grouped_source
from . import numerics as run_numerics
from .phases import StepClock
from .session import Session, layer_numerics_error
from .steps import PassContext


def step_many(sessions: Sequence[Session], token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Feed token_ids[b] to sessions[b], all in one forward pass: logits (B, vocab) float32, row b
    equal bit for bit to `sessions[b].step(token_ids[b])`.

    The sessions share one engine, appear once each and hold no trace (a drafter's taps see one
    sequence: a traced session steps alone). A failure inside the layers leaves every session of
    the pass torn, as a failed `step` leaves its one."""
    sessions = list(sessions)
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if not sessions or len(sessions) != ids.size:
        raise UsageError(f"step_many: {len(sessions)} sessions for {ids.size} token ids (one each, at least one)")
    engine = sessions[0].engine
    if any(s.engine is not engine for s in sessions):
        raise UsageError("step_many: the sessions of one pass must share one engine")
    if len({id(s) for s in sessions}) != len(sessions):
        raise UsageError("step_many: a session appears twice in one pass")
    if any(s.trace is not None for s in sessions):
        raise UsageError("step_many: a traced session (a drafter's) steps alone")
    if len(sessions) == 1:
        return sessions[0].step(int(ids[0]))[None]
    rows = [s._check_ids([t]) for s, t in zip(sessions, ids, strict=True)]
    run_numerics.ensure(engine.cfg.family, engine.numerics)
    for hook in {id(s.before_pass): s.before_pass for s in sessions if s.before_pass is not None}.values():
        hook(len(sessions))  # the pass's memory (a run's sessions share one `make_room`)
    stack, n_layers = engine.stack, engine.cfg.n_layers
    passes = [s._begin(r) for s, r in zip(sessions, rows, strict=True)]  # nothing changed yet
    ctx = _joined_context(sessions)
    try:
        for i in range(n_layers):
            w = engine.trunk.layer(i)  # once for the pass
            try:
                joined = _attend(stack, sessions, passes, i, w)
                stack.ffn(ctx, joined, i, w)
            except NumericsError as e:
                raise layer_numerics_error(engine.cfg, i, w, e) from None
            stack.split(joined, passes)
    except BaseException:
        for s in sessions:
            s.torn = True
        raise
    for s in sessions:
        s.pos += 1
    return sessions[0]._logits(joined, last_only=False)


def step_governed(
    sessions: Sequence[Session], token_ids: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, float, dict[str, float]]:
    """`step_many` timed: (logits (B, vocab), wall seconds, seconds by phase), at the thread count
    the engine's governor (None: `--threads` fixed, nothing chosen) picks for passes of B rows;
    its compute (wall less the read waits, which threads do not change) goes back to it. The
    kernels are at the governor's full count again afterwards (a joining prompt's prefill keeps
    every thread)."""
    engine = sessions[0].engine
    clock = StepClock(engine.meter)
    gov = engine.governor.for_rows(len(sessions)) if engine.governor is not None else None
    threads = gov.next_threads() if gov is not None else 0
    if threads and threads != kernels.get_threads():
        kernels.set_threads(threads)
    try:
        clock.begin()
        logits = step_many(sessions, token_ids)
        wall, spent = clock.end()
    finally:
        if gov is not None and threads != gov.most:
            kernels.set_threads(gov.most)
    if gov is not None:
        gov.record(threads, wall - spent["expert_reads"] - spent["trunk_reads"])
    return logits, wall, spent


def read_ahead_many(sessions: Sequence[Session], token_ids: Sequence[int] | np.ndarray) -> None:
    """`Session.read_ahead` for each session's next token, the pass's memory made for all of them."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    for s, t in zip(sessions, ids, strict=True):
        s.read_ahead([t], pass_tokens=len(sessions))


def _attend(stack, sessions: list[Session], passes: list, i: int, w):
    """Layer i's stateful half for every row, joined for the stateless half: in one call over the
    rows where the family's stack has one (`attend_rows`: the projections shared, each row's
    state apart), else each session's `attend` on its own row."""
    rows = getattr(stack, "attend_rows", None)
    if rows is not None:
        return rows(passes, i, w, [s.state for s in sessions])
    for s, p in zip(sessions, passes, strict=True):
        stack.attend(s.pass_context(), p, i, w, s.state)
    return stack.join(passes)


def _joined_context(sessions: list[Session]) -> PassContext:
    """The context of the stateless half over the joined rows (row b = sessions[b]): each session's
    `on_route` sees its own row, the chosen experts are asked for once for all rows, and a session
    that records its requests records its row's experts, as its own step would."""
    engine = sessions[0].engine
    routed_rows: dict[int, np.ndarray] = {}

    def routed(layer: int, positions: np.ndarray, prefetch: bool = True) -> Callable[[np.ndarray], None]:
        def hook(experts: np.ndarray) -> None:
            routed_rows[layer] = experts
            for b, s in enumerate(sessions):
                if s.on_route is not None:
                    s.on_route(layer, positions[b : b + 1], experts[b : b + 1])
            if prefetch:
                engine.experts.prefetch([(layer, int(e)) for e in np.unique(experts)])

        return hook

    def experts_of(layer: int) -> GroupedSource:
        def record(ids: np.ndarray) -> None:
            chosen = routed_rows.pop(layer, None)
            for b, s in enumerate(sessions):
                if s.requests is not None and chosen is not None:
                    s.requests.extend((layer, int(e)) for e in np.unique(chosen[b]))

        return grouped_source(engine.experts, layer, record)

    return PassContext(sessions[0].chunk_size, None, experts_of, routed)


__all__ = ["read_ahead_many", "step_governed", "step_many"]
