"""Counter-based uniforms for sampled speculative decoding: one draw per (position, purpose).

Owns: `PositionUniforms`, a stand-in for the `numpy.random.Generator` a pick function draws
from (it only ever calls `.random()`), whose value depends on the seed, the position the picked
token takes in the sequence and how many draws were made at that position, never on how many
draws came before. numpy's Philox is a counter-based generator: key = the seed (and a choice
index), counter = (position, purpose), so each uniform is computed directly, not by running a
stream up to it.

Why: a speculative run feeds tokens in passes whose sizes depend on the drafts (and, with
`--speculate auto`, on timing). With a sequential stream the k-th draw would belong to different
positions in different runs; with this one the token picked at position i always sees the same
uniform, so a seed gives the same ids whatever the budget, the draft length or `auto`'s choices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PositionUniforms:
    """`.at(pos)` before a pick at position `pos`; `.random()` then gives that position's uniforms
    in [0, 1), purpose 0, 1, ... in call order."""

    def __init__(self, seed: int | Sequence[int] | None) -> None:
        words = np.random.SeedSequence(seed).generate_state(2, dtype=np.uint64)
        self._key = words
        self._pos = 0
        self._purpose = 0

    def at(self, pos: int) -> None:
        self._pos, self._purpose = int(pos), 0

    def random(self) -> float:
        bits = np.random.Philox(key=self._key, counter=[self._pos, self._purpose, 0, 0])
        self._purpose += 1
        return float(np.random.Generator(bits).random())
