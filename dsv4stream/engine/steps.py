"""The pieces a forward pass is made of, shared by the session and the model families' stacks.

Owns: `Pass` (one forward pass in flight: its tokens, positions and residual streams; a
family adds what it carries from layer to layer), `PassContext` (what the session lends a
stack for one pass: the attention sub-chunk, the trace, the expert source and the routing
hook of a layer) and the `Stack` protocol each family (`engine.stack_v4`, `engine.stack_v41`) implements.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..model.moe import ExpertSource
from ..model.trace import Trace

# routed(layer, positions, prefetch=...) -> the MoE's on_route hook for that layer: calls the
# session's on_route, then (prefetch=True) asks the expert provider for the chosen experts
RoutedHook = Callable[..., Callable[[np.ndarray], None]]


@dataclass
class Pass:
    """One forward pass: tokens ids (T,) at positions (T,), streams x (T, hc, D) between layers."""

    ids: np.ndarray
    positions: np.ndarray
    x: np.ndarray

    def cut(self, first: int) -> None:
        """Keep rows first: only (what the last layer's outputs feed once the state has seen
        every row); a family's pass cuts what it carries per row too."""
        self.ids, self.positions, self.x = self.ids[first:], self.positions[first:], self.x[first:]


@dataclass(frozen=True)
class PassContext:
    chunk: int  # attention sub-chunk (tokens)
    trace: Trace | None
    experts: Callable[[int], ExpertSource]  # layer -> the MoE's expert source
    routed: RoutedHook


class Stack(Protocol):
    """A model family's part of the forward pass; the session owns the loop around it."""

    family: str

    def new_state(self) -> list:
        """A fresh sequence's state: what `Session.state` holds and snapshots copy."""
        ...

    def read_ahead(self, ids: np.ndarray, state: list) -> object:
        """Start the reads that the token ids alone decide, for the pass that feeds `ids` next;
        returns what that pass needs from it (handed to `begin`)."""
        ...

    def begin(self, ids: np.ndarray, positions: np.ndarray, state: list, ahead: Callable[[], object]) -> Pass:
        """The pass's streams from the embedding; `ahead()` gives `read_ahead`'s result (started now
        if the session has not already), at the point in the reads the family wants it."""
        ...

    def layer(self, ctx: PassContext, p: Pass, i: int, w, state: list, keep: int | None = None) -> None:
        """Layer i (weights w) on the pass's streams, updating `state`. keep (None: all rows): only
        the pass's last `keep` rows' outputs are wanted (the last layer of a pass whose logits are
        the last position's, 1, or nobody's, 0): every row still updates the state, which comes
        from the layer's inputs, and the pass is cut to those rows before the query path, the
        mixing after attention and the MoE; their bits are those of the whole pass's rows."""
        ...

    def attend(self, ctx: PassContext, p: Pass, i: int, w, state: list, keep: int | None = None) -> None:
        """Layer i's half that reads and updates `state` (`layer` = `attend`, then `ffn`); keep as
        in `layer` (the pass is cut here)."""
        ...

    def ffn(self, ctx: PassContext, p: Pass, i: int, w) -> None:
        """Layer i's stateless half, each row on its own: what a batched pass runs once over the
        rows of every sequence in it (`engine.batch`)."""
        ...

    def join(self, passes: list[Pass]) -> Pass:
        """One pass of the rows of `passes`, in order, for `ffn` and `logits`."""
        ...

    def split(self, joined: Pass, passes: list[Pass]) -> None:
        """The rows of `joined` back into the passes it was joined from."""
        ...

    def logits(self, p: Pass, last_only: bool, extra: np.ndarray | None = None) -> np.ndarray:
        """(T, vocab), or (1, vocab) for the last position; then the logits of `extra` (n, D),
        rows already normed for the head (another model's: a drafter's), from the same call."""
        ...

    def head_weights(self) -> object:
        """The head's named weights (read when the logits are not finite, for the message)."""
        ...

    def agrees(self, state: list, ids: Sequence[int]) -> str | None:
        """What is wrong between a state read from a file and the token ids it says it has read
        (None: nothing): what the state derives from the ids themselves, not from the position."""
        ...
