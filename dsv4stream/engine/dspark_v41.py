"""The DSpark drafter (V4.1's, or V4-Flash-0731's) beside a session: its weights, its expert source, its taps.

Owns: running the drafter (`model.v41.dspark`) teacher-forced over a token sequence, as
`dsv4 logits --draft-out` asks: the main model consumes the tokens (in its session's mode), the
"input" trace of the target layers gives the taps, and at each asked position p the drafter
runs once, as in speculative decoding right after the main model consumed tokens[0..p]: its
window holds the taps of positions <= p, its block starts with tokens[p + 1], and the Markov
chain is teacher-forced (slot j's bias from tokens[p + 1 + j]). The drafter's routed experts
come through the engine's expert provider (blocks n_layers + K), in the same cache and budget
as the main model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InternalError, UsageError
from ..model.dspark import markov
from ..model.moe import GroupedSource
from ..model.v4.dspark import draft as draft_0731
from ..model.v4.dspark import new_state as new_0731
from ..model.v4.dspark import observe as observe_0731
from ..model.v41.dspark import draft as draft_v41
from ..model.v41.dspark import new_state as new_v41
from ..model.v41.dspark import observe as observe_v41
from ..weights.loading_dspark import check_drafter, dspark_params, load_dspark
from ..weights.loading_dspark_0731 import is_0731
from ..weights.providers import grouped_source
from .dspark_0731 import model_0731

F32 = np.float32


def draft_positions(spec: str, n_tokens: int, block: int) -> np.ndarray:
    """`all` or `P1,P2,...` -> ascending unique positions, each 1 <= p <= T - 1 - B."""
    hi = n_tokens - 1 - block
    if spec.strip() == "all":
        if hi < 1:
            raise UsageError(
                f"--draft-out needs at least {block + 2} tokens (a block of {block} after position 1); got {n_tokens}"
            )
        return np.arange(1, hi + 1, dtype=np.int64)
    try:
        pos = sorted({int(s) for s in spec.split(",")})
    except ValueError:
        raise UsageError(f"--draft-positions {spec!r}: use all or positions like 1,5,9") from None
    bad = [p for p in pos if not 1 <= p <= hi]
    if bad:
        raise UsageError(
            f"--draft-positions: {bad[0]} is outside 1..{hi} (T = {n_tokens}, block {block}: p <= T - 1 - B)"
        )
    return np.array(pos, dtype=np.int64)


def expert_source(experts, layer: int) -> GroupedSource:
    """The MoE's expert source for drafter block `layer` from the engine's provider (reads
    started first, then in groups pinned together: `weights.providers.expert_groups`)."""
    return grouped_source(experts, layer, lambda ids: experts.prefetch([(layer, int(e)) for e in ids]))


def teacher_forced_drafts(
    engine, ids: np.ndarray, positions: Sequence[int], chunk: int, segment: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(main logits (T, vocab), draft logits (P, B, vocab), confidence (P, B)) for `ids`."""
    cfg = engine.cfg
    stack = engine.stack
    if is_0731(cfg):  # V4-Flash-0731's design (model.v4.dspark); the Markov head reads as V4.1's
        p, w = model_0731(engine)
        new_state, observe, draft = new_0731, observe_0731, draft_0731
    else:
        check_drafter(cfg)
        if engine.catalog is None:
            raise InternalError("the drafter loads its weights from the engine's catalog")
        p = dspark_params(cfg, stack.options.grid.quantise)
        w = load_dspark(engine.catalog)
        new_state, observe, draft = new_v41, observe_v41, draft_v41
    taps: dict[int, list[np.ndarray]] = {t: [] for t in p.targets}

    def trace(what: str, layer: int, x: np.ndarray) -> None:
        if what == "input" and layer in taps:
            taps[layer].append(x.mean(axis=1, dtype=F32))

    session = engine.session(chunk_size=chunk, segment=segment, trace=trace)
    main = session.prefill(ids).astype(F32, copy=False)
    tap = np.concatenate([np.concatenate(taps[t]) for t in p.targets], axis=1)
    if tap.shape[0] != ids.size:
        raise InternalError(f"the drafter's taps cover {tap.shape[0]} positions of {ids.size}")
    head = stack.head_weights().head
    state = new_state(p, len(w.stages))
    want = {int(q) for q in positions}
    logits, conf = [], []
    for q in range(max(want) + 1):
        observe(state, tap[q : q + 1], np.array([q], dtype=np.int64), w, p, stack.rope_main)
        if q not in want:
            continue
        d = draft(
            state,
            int(ids[q + 1]),
            w,
            p,
            engine.trunk.embed,
            head,
            lambda layer: expert_source(engine.experts, layer),
            stack.rope_main,
        )
        lg, c = markov(d, ids[q + 1 : q + 1 + p.block_size], w)
        logits.append(lg)
        conf.append(c)
    return main, np.stack(logits), np.stack(conf)
