"""A run's speculative decoding: its `--speculate` setting, one drafter per session, `auto`'s costs.

Owns: `Speculator` (what `Runtime.generate` asks: `resolve` a request's setting against the run's
default and the checkpoint, then `generate` through `engine.speculate` with the session's drafter
and the right policy) and `pick_at` (a pick that draws at its session's position, for runs
without drafts that use the same position uniforms). `auto`'s policy is one per run: the costs
it measures (pass times, read rate) are the machine's, and acceptance changes slowly.

Settings: "off", "auto", or N (1..dspark_block_size). Where the checkpoint has no drafter this
code runs (V4, V4-Flash-0731, a V4.1 checkpoint without mtp.*): "auto" is "off" silently; N is a
UsageError naming why (the CLI's one line, the server's 400).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

import numpy as np

from ..errors import UsageError
from ..weights.loading_dspark import drafter_reason
from .spec_memory import SpecMemory
from .spec_policy import AutoDrafts, FixedDrafts
from .speculate import AUTO, OFF, parse_setting, speculative_generate
from .speculate_v41 import DSparkDrafter, drafter_for


class Speculator:
    def __init__(
        self, engine, setting: str | int = AUTO, memory: Callable[[], SpecMemory | None] | None = None
    ) -> None:
        self.engine = engine
        # auto's figures between runs (`engine.spec_memory`): opened when auto first runs, so a run
        # that never drafts spends nothing on it (None: none kept)
        self._memory_of = memory
        self.memory: SpecMemory | None = None
        self.why_not = drafter_reason(engine.cfg)
        self.block = engine.cfg.dspark.block_size if self.why_not is None else None
        self.default = self.resolve(setting, "--speculate")
        self._drafters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._auto: AutoDrafts | None = None

    def resolve(self, setting: object = None, where: str = "speculate") -> str | int:
        """A request's setting (None: the run's default) as "off", "auto" or N."""
        if setting is None:
            return self.default
        s = parse_setting(setting, self.block, where)
        if s == OFF:
            return OFF
        if self.why_not is not None:
            if s == AUTO:
                return OFF
            raise UsageError(f"{where} {s}: this checkpoint cannot draft: {self.why_not}; use off")
        return s

    def drafter(self, session) -> DSparkDrafter:
        d = self._drafters.get(session)
        if d is None:
            d = self._drafters[session] = DSparkDrafter(self.engine, drafter_for(self.engine))
        return d

    def adopt(self, session, drafter: DSparkDrafter) -> DSparkDrafter:
        """`drafter` (one at the position before the session's, e.g. a copy of another's at a state
        the session was restored from) as the session's from now on; returns it."""
        self._drafters[session] = drafter
        return drafter

    def generate(self, session, setting: str | int, prompt_ids, max_new_tokens: int, pick, *, uniforms=None, **kw):
        """`engine.speculate.speculative_generate` with this session's drafter and the setting's policy."""
        if setting == AUTO:
            if self._auto is None:
                self.memory = self._memory_of() if self._memory_of is not None else None
                self._auto = AutoDrafts(self.block, self.memory.load() if self.memory is not None else None)
            policy = self._auto
        else:
            policy = FixedDrafts(int(setting))
        gen = speculative_generate(
            session, prompt_ids, max_new_tokens, pick, self.drafter(session), policy,
            setting=setting, uniforms=uniforms, **kw,
        )  # fmt: skip
        return gen if setting != AUTO or self.memory is None else self._kept(gen, policy)

    def _kept(self, gen: Iterator[int], policy: AutoDrafts) -> Iterator[int]:
        """`gen`, and what the policy measured saved once it ends (finished, closed or failed)."""
        try:
            return (yield from gen)  # (a `HandOver`'s carried tokens)
        finally:
            rec = policy.remember()
            if rec is not None:
                self.memory.save(rec)


def pick_at(session, pick: Callable[[np.ndarray], int], uniforms) -> Callable[[np.ndarray], int]:
    """`pick` drawing at `session.pos` (where `Session.generate` feeds the token it picks)."""
    if uniforms is None:
        return pick

    def at(logits: np.ndarray) -> int:
        uniforms.at(session.pos)
        return pick(logits)

    return at
