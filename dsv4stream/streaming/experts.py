"""`StreamedExperts`: the `Experts` provider over an `ExpertStore`.

Pin contract with the MoE (`model.moe.routed_experts`): a layer's experts come through
`get_groups(layer, experts)`, the store's `get_groups`: those in memory first as one group,
then misses in groups as their reads land, at most the unpinned slots pinned at once, each
group's computation finished before the iterator advances (`get_many` is the same one
expert at a time). The single `get(layer, e)` keeps the older contract
(the previous expert is released when the next one is asked for). Weights used past either
end raise LifetimeError (`lifetime.expire`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..checkpoint.config import ModelConfig
from ..model.moe import ExpertWeights
from ..store import ExpertStore
from ..weights.lifetime import expire
from ..weights.loading import expert_from_arrays
from ..weights.providers import ExpertKey


class StreamedExperts:
    """`Experts` provider over an ExpertStore keyed (layer, expert) with the six arrays in
    `EXPERT_TENSORS` order. Holds at most one pin (see the module doc)."""

    def __init__(self, store: ExpertStore, cfg: ModelConfig) -> None:
        self.store = store
        self.cfg = cfg
        self._held: ExpertKey | None = None
        self._held_weights: ExpertWeights | None = None

    def get(self, layer: int, expert: int) -> ExpertWeights:
        self.release()  # the previous expert's computation is finished (MoE contract)
        key = (layer, expert)
        arrays = self.store.get(key)
        self._held = key
        self._held_weights = expert_from_arrays(self.cfg, tuple(arrays))
        return self._held_weights

    def get_many(self, layer: int, experts: Sequence[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """Each expert once: resident ones first, then misses in the order their reads land."""
        self.release()
        many = getattr(self.store, "get_many", None)
        if many is None:  # a store with get/release only: one at a time, in order
            for e in experts:
                yield e, self.get(layer, e)
            self.release()
            return
        for (_, e), arrays in many([(layer, e) for e in experts]):
            w = expert_from_arrays(self.cfg, tuple(arrays))
            try:
                yield e, w
            finally:
                expire(w, f"layer {layer} expert {e}'s weights used after get_many moved on (valid until it advances)")

    def get_groups(self, layer: int, experts: Sequence[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """The experts in groups pinned together (the store's `get_groups`: all of them at once
        when they are in memory and fit the unpinned slots), each group's weights valid until
        the iterator advances."""
        self.release()
        groups = getattr(self.store, "get_groups", None)
        if groups is None:  # a store without groups: one expert at a time
            for item in self.get_many(layer, experts):
                yield [item]
            return
        for group in groups([(layer, e) for e in experts]):
            ws = [(e, expert_from_arrays(self.cfg, tuple(arrays))) for (_, e), arrays in group]
            try:
                yield ws
            finally:
                for e, w in ws:
                    expire(
                        w,
                        f"layer {layer} expert {e}'s weights used after get_groups moved on (valid until it advances)",
                    )

    def prefetch(self, keys: Sequence[ExpertKey]) -> None:
        self.store.prefetch(list(keys))

    def release(self) -> None:
        """Unpin the expert handed out last (also done by the next get)."""
        if self._held is not None:
            key, self._held = self._held, None
            expire(
                self._held_weights,
                f"layer {key[0]} expert {key[1]}'s weights used after their release"
                " (one expert is pinned at a time: the next get releases the previous)",
            )
            self._held_weights = None
            self.store.release(key)
