"""The DSpark drafter (V4.1's, or V4-Flash-0731's) as the speculative loop's `Drafter`, and greedy
speculation helpers.

Owns: `DSparkDrafter` (the drafter beside one session: the block of `model.v41.dspark`, or of
`model.v4.dspark` on a 0731 checkpoint, with its greedy Markov chain and its confidence head;
`propose_rows` gives a `Folded` run whose head the next main pass runs), `DSparkModel` (its weights and parameters, loaded
once per engine and shared by every session's drafter), `drafter_for` (the checks: which
checkpoints have a drafter this code runs) and `speculative_greedy` (ids and figures of one
greedy generation with a fixed draft length: tests and benches).

The drafter is greedy: each slot proposes the argmax of its logits (head + the Markov bias of the
previous slot's pick). Its taps are observed lazily: the streams of every kept position are held
as the main model left them (the last `window` of them) and reduced to taps (the mean over the hc
copies) and pushed into the stages' windows only when a draft is asked for, so cycles where
`--speculate auto` drafts nothing cost the drafter nothing but that copy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from ..model.dspark import Draft, markov
from ..model.v4.dspark import DSpark0731Params, DSpark0731Weights
from ..model.v4.dspark import draft as draft_0731
from ..model.v4.dspark import new_state as new_0731
from ..model.v4.dspark import observe as observe_0731
from ..model.v41.dspark import DSparkParams, DSparkWeights, draft, new_state, observe
from ..text.sampler import greedy
from ..weights.loading_dspark import drafter_reason, dspark_params, load_dspark
from ..weights.loading_dspark_0731 import is_0731
from .dspark_0731 import model_0731
from .dspark_v41 import expert_source
from .spec_policy import FixedDrafts
from .spec_stats import SpecCounts
from .speculate import speculative_generate

F32 = np.float32


@dataclass(frozen=True)
class DSparkModel:
    """A drafter's weights and parameters, and its design's three functions (V4.1's by default;
    `engine.dspark_0731.model_0731` gives V4-Flash-0731's)."""

    params: DSparkParams | DSpark0731Params
    weights: DSparkWeights | DSpark0731Weights
    new_state: Callable = new_state
    observe: Callable = observe
    draft: Callable = draft


def drafter_for(engine) -> DSparkModel:
    """The engine's drafter weights (loaded on first use, then kept on the engine); UsageError
    where the checkpoint has none this code runs."""
    got = getattr(engine, "_dspark", None)
    if got is None:
        why = drafter_reason(engine.cfg)
        if why is not None:
            raise UsageError(f"--speculate: this checkpoint cannot draft: {why}; use --speculate off")
        if is_0731(engine.cfg):
            p7, w7 = model_0731(engine)
            got = engine._dspark = DSparkModel(p7, w7, new_0731, observe_0731, draft_0731)
        else:
            p = dspark_params(engine.cfg, engine.stack.options.grid.quantise)
            got = engine._dspark = DSparkModel(p, load_dspark(engine.catalog))
    return got


class DSparkDrafter:
    """The drafter beside one session (`engine.speculate.Drafter`), of either design: the
    model's `new_state` / `observe` / `draft` are V4.1's or V4-Flash-0731's."""

    def __init__(self, engine, model: DSparkModel | None = None) -> None:
        self.engine = engine
        m = model or drafter_for(engine)
        self.params, self.weights = m.params, m.weights
        self.new_state, self.observe_taps, self.draft = m.new_state, m.observe, m.draft
        self.targets = self.params.targets
        self.block = self.params.block_size
        self.window = self.params.window
        self.state = self.new_state(self.params, len(self.weights.stages))
        self.last = -1
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._held = 0

    def reset(self) -> None:
        self.state = self.new_state(self.params, len(self.weights.stages))
        self.last, self._pending, self._held = -1, [], 0

    def copy(self) -> DSparkDrafter:
        """A drafter at the same place, with a state of its own from here (another sequence that
        goes on from the same positions: a request's later choice from the first's state at the
        prompt's end). The weights are shared; the held streams are never written, so shared too."""
        d = copy.copy(self)
        d.state, d._pending = copy.deepcopy(self.state), list(self._pending)
        return d

    @property
    def cold(self) -> bool:
        """Whether no drafter has run on this engine yet: the first run in a process warms its
        kernels, caches and expert reads (its time is not what a run costs: `AutoDrafts.drafted`)."""
        return not getattr(self.engine, "_drafter_ran", False)

    def observe(self, taps: Sequence[np.ndarray], positions: np.ndarray) -> None:
        """Holds the streams (per target layer (T, hc, D)) until a draft is asked for (`_flush`)."""
        if positions.size == 0:
            return
        self._pending.append((taps, positions))
        self._held += positions.size
        while self._held - self._pending[0][1].size >= self.window:  # older than the window: never read
            self._held -= self._pending.pop(0)[1].size
        self.last = int(positions[-1])

    def _flush(self) -> None:
        if not self._pending:
            return
        raw = np.concatenate([np.stack(t, axis=1) for t, _ in self._pending])[-self.window :]  # (T, targets, hc, D)
        pos = np.concatenate([q for _, q in self._pending])[-self.window :]
        self._pending, self._held = [], 0
        # the taps: each target layer's streams, mean over the hc copies, side by side (T, D * targets)
        taps = raw.mean(axis=2, dtype=F32).reshape(raw.shape[0], -1)
        eng = self.engine
        self.observe_taps(self.state, taps, pos, self.weights, self.params, eng.stack.rope_main)

    def run(self, token: int, slots: int | None = None, head: bool = True) -> Draft:
        """The block after the last observed position, whose first token is `token` (head logits
        of the first `slots` slots; `head` False: their head input rows instead)."""
        self._flush()
        eng = self.engine
        top = eng.stack.head_weights()
        eng._drafter_ran = True
        return self.draft(
            self.state,
            token,
            self.weights,
            self.params,
            eng.trunk.embed,
            top.head if head else None,
            lambda layer: expert_source(eng.experts, layer),
            eng.stack.rope_main,
            slots,
            q8=top.q8,  # fast proposes with the int8 head copy where the main model reads it
        )

    def propose(self, token: int, k: int) -> tuple[list[int], list[float]]:
        return self._chain(token, self.run(token, k), k)

    def propose_rows(self, token: int, k: int) -> Folded:
        """`propose` with the head left out: the k rows for the main model's next head call
        (`Session.step_with_rows`: the head's weights read once for both), and what turns their
        logits into the drafts and confidences `propose` gives (the same numbers: the head's
        rows do not depend on the rows beside them)."""
        d = self.run(token, k, head=False)
        return Folded(d.rows, lambda logits: self._chain(token, Draft(logits, d.hidden), k))

    def _chain(self, token: int, d: Draft, k: int) -> tuple[list[int], list[float]]:
        """The greedy Markov chain over a run's first k slots: drafts and raw confidences."""
        chain, conf = [int(token)], []
        for j in range(k):
            lg, c = markov(Draft(d.logits[j : j + 1], d.hidden[j : j + 1]), np.array(chain[j : j + 1]), self.weights)
            chain.append(greedy(lg[0]))
            conf.append(float(c[0]))
        return chain[1:], conf


@dataclass(frozen=True)
class Folded:
    """A drafter run whose head is left to the next main pass: the head's input rows (k, D), and
    `finish(logits (k, vocab))` -> (drafts, confidences)."""

    rows: np.ndarray
    finish: Callable[[np.ndarray], tuple[list[int], list[float]]]


class ScriptedDrafter:
    """A stand-in drafter for tests and benches, NOT the checkpoint's: `propose(pos, token, k)`
    gives the drafts after `token` at position pos (e.g. the main model's own greedy ids with a
    chosen share of them wrong, for a set acceptance); no taps, confidence 0."""

    targets: tuple[int, ...] = ()

    def __init__(self, propose: Callable[[int, int, int], list[int]], block: int) -> None:
        self._propose, self.block, self.last = propose, block, -1

    def reset(self) -> None:
        self.last = -1

    def observe(self, taps: Sequence[np.ndarray], positions: np.ndarray) -> None:
        if positions.size:
            self.last = int(positions[-1])

    def propose(self, token: int, k: int) -> tuple[list[int], list[float]]:
        return list(self._propose(self.last, token, k))[:k], [0.0] * k


def speculative_greedy(
    engine,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    k: int,
    propose: Callable[[int, int, int], list[int]] | None = None,
    policy=None,
) -> tuple[list[int], SpecCounts]:
    """Greedy ids after `prompt_ids` (the first `max_new_tokens`) drafting k per cycle (`policy`:
    another, e.g. `AutoDrafts`), and the figures. `propose(pos, token, k)`: a stand-in drafter
    (`ScriptedDrafter`) instead of the checkpoint's."""
    model = drafter_for(engine)
    if not 1 <= k <= model.params.block_size:
        raise UsageError(f"--speculate {k}: draft 1 to {model.params.block_size} tokens (dspark_block_size)")
    d = DSparkDrafter(engine, model) if propose is None else ScriptedDrafter(propose, model.params.block_size)
    session = engine.session(chunk_size=1 << 20)
    gen = speculative_generate(session, prompt_ids, max_new_tokens, greedy, d, policy or FixedDrafts(k), setting=k)
    ids = list(gen)
    return ids, session.turn.speculation
