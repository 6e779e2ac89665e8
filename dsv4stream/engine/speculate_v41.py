"""Greedy speculative decoding with DeepSeek-V4.1's DSpark drafter: the same ids as without it.

Owns: the draft / verify / roll back loop of one greedy generation (`speculative_greedy`). The
drafter proposes k tokens after the last picked one (`DSparkProposer`: the block of
`model.v41.dspark` with its greedy Markov chain); the main model checks them in one pass of
k + 1 tokens. The longest prefix whose every draft is the main model's own greedy pick is kept,
plus the main model's pick after it. Where a draft is rejected the session goes back to the
snapshot taken before the pass and feeds only the kept tokens again, so its state is exactly
that of a run without drafts; the drafter's windows only ever see positions that were kept.

Greedy ids equal those of `Session.generate` without drafts up to float rounding between a
k + 1-token pass and k + 1 one-token passes (an exact tie between two logits could flip).
Not yet wired into `run`, the chat or `serve` (issue 41: `--speculate`, sampled acceptance).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import UsageError
from ..model.v41.dspark import draft, markov, new_state, observe
from ..text.sampler import greedy
from ..weights.loading_dspark import check_drafter, dspark_params, load_dspark
from .dspark_v41 import expert_source

F32 = np.float32


@dataclass
class SpecStats:
    passes: int = 0  # verification passes of the main model
    drafted: int = 0
    accepted: int = 0
    refeeds: int = 0  # passes spent re-feeding after a rejection
    accepted_per_pass: list[int] = field(default_factory=list)


class DSparkProposer:
    """The drafter beside one session: `observe(taps, positions)` after every kept pass,
    `propose(token, k)` -> k greedy draft ids after `token` (the main model's pick at the last
    observed position)."""

    def __init__(self, engine) -> None:
        cfg = engine.cfg
        check_drafter(cfg)
        self.engine = engine
        self.params = dspark_params(cfg, engine.stack.options.grid.quantise)
        self.weights = load_dspark(engine.catalog)
        self.state = new_state(self.params, len(self.weights.stages))
        self.targets = self.params.targets
        self.block = self.params.block_size

    def observe(self, taps: np.ndarray, positions: np.ndarray) -> None:
        observe(self.state, taps, positions, self.weights, self.params, self.engine.stack.rope_main)

    def propose(self, token: int, k: int) -> list[int]:
        eng, p = self.engine, self.params
        d = draft(
            self.state,
            token,
            self.weights,
            p,
            eng.trunk.embed,
            eng.stack.head_weights().head,
            lambda layer: expert_source(eng.experts, layer),
            eng.stack.rope_main,
        )
        chain = [int(token)]
        for j in range(k):
            lg, _ = markov(_slot(d, j), np.array(chain[j : j + 1]), self.weights)
            chain.append(greedy(lg[0]))
        return chain[1:]


def _slot(d, j: int):
    return type(d)(d.logits[j : j + 1], d.hidden[j : j + 1])


def speculative_greedy(
    engine,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    k: int,
    proposer=None,
    propose: Callable[[int, int, int], list[int]] | None = None,
) -> tuple[list[int], SpecStats]:
    """Greedy ids after `prompt_ids` (the first `max_new_tokens`), drafting k per pass.

    `proposer`: a `DSparkProposer` (default: the checkpoint's drafter). `propose(pos, token, k)`
    replaces its proposals (a stand-in drafter with a chosen acceptance, for tests and benches)."""
    if k < 1:
        raise UsageError(f"--speculate {k}: draft at least one token (or turn speculation off)")
    prop = proposer or DSparkProposer(engine)
    if k > prop.block:
        raise UsageError(f"--speculate {k}: the drafter drafts at most {prop.block} tokens (dspark_block_size)")
    taps: dict[int, list[np.ndarray]] = {t: [] for t in prop.targets}

    def trace(what: str, layer: int, x: np.ndarray) -> None:
        if what == "input" and layer in taps:
            taps[layer].append(x.mean(axis=1, dtype=F32))

    def fed(ids: Sequence[int]) -> np.ndarray:
        """Feed ids; the drafter observes their taps; the logits (n, vocab)."""
        for v in taps.values():
            v.clear()
        start = session.pos
        logits = session.prefill(np.asarray(ids, dtype=np.int64))
        tap = np.concatenate([np.concatenate(taps[t]) for t in prop.targets], axis=1)
        prop.observe(tap, np.arange(start, start + len(ids), dtype=np.int64))
        return logits

    session = engine.session(chunk_size=1 << 20, trace=trace)
    stats = SpecStats()
    out = [greedy(fed(prompt_ids)[-1])]
    while len(out) < max_new_tokens:
        t = out[-1]
        want = min(k, max_new_tokens - len(out))
        drafts = propose(session.pos - 1, t, want) if propose is not None else prop.propose(t, want)
        snap = session.snapshot()
        for v in taps.values():
            v.clear()
        logits = session.prefill(np.array([t, *drafts], dtype=np.int64))
        picks = [greedy(row) for row in logits]
        a = 0
        while a < want and picks[a] == drafts[a]:
            a += 1
        stats.passes += 1
        stats.drafted += want
        stats.accepted += a
        stats.accepted_per_pass.append(a)
        if a == want:
            start = session.pos - (want + 1)
            tap = np.concatenate([np.concatenate(taps[q]) for q in prop.targets], axis=1)
            prop.observe(tap, np.arange(start, start + want + 1, dtype=np.int64))
            out.extend([*drafts, picks[want]])
        else:  # back to before the pass; feed only what is kept
            session.restore(snap)
            stats.refeeds += 1
            last = fed([t, *drafts[:a]])[-1]
            out.extend([*drafts[:a], greedy(last)])
    return out[:max_new_tokens], stats
