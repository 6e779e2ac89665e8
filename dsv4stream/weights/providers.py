"""Where the forward pass gets its weights: small provider interfaces and their defaults.

Owns: the `Trunk` (embedding rows, dense per-layer weights, head) and `Experts` (routed
experts by (layer, expert), with a prefetch hint) protocols and the in-memory defaults that
read from the catalog. Streaming implementations (`dsv4stream.streaming`) plug in here
without touching the model code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np

from ..checkpoint.catalog import Catalog
from ..checkpoint.formats import bf16_to_f32, e4m3_to_f32, scale_to_f32
from ..checkpoint.spec_v41 import engram_names
from ..checkpoint.tensors import MODEL, linear_names
from ..model.moe import ExpertWeights, GroupedSource
from .family import BlockWeights, TopWeights, load_block, load_top
from .loading import load_expert

ExpertKey = tuple[int, int]  # (layer, expert); MTP layers count from num_hidden_layers


class Trunk(Protocol):
    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """token_ids (T,) -> (T, D) float32."""
        ...

    def layer(self, i: int) -> BlockWeights: ...

    def head(self) -> TopWeights: ...

    def tid2eid(self, i: int) -> np.ndarray:
        """(vocab, k) int64 expert table of hash layer i, available without loading layer i."""
        ...


class Experts(Protocol):
    def get(self, layer: int, expert: int) -> ExpertWeights: ...

    def get_many(self, layer: int, experts: Sequence[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """Each of these distinct experts once, in any order (those in memory first); an
        expert's weights stay valid until the iterator advances. Optional: the engine falls
        back to `get` in id order."""
        ...

    def get_groups(self, layer: int, experts: Sequence[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """`get_many`'s experts in groups whose weights all stay valid until the iterator
        advances (every expert in memory at once where they fit). Optional (`expert_groups`)."""
        ...

    def prefetch(self, keys: Sequence[ExpertKey]) -> None:
        """A hint: these experts are about to be needed, in this order."""
        ...


def expert_groups(experts: Experts, layer: int, ids: Sequence[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
    """Layer `layer`'s experts `ids` from the provider in groups (`Experts.get_groups`): its own
    groups where it has them, else one expert per group from `get_many`, else from `get` in order."""
    ids = [int(e) for e in ids]
    groups = getattr(experts, "get_groups", None)
    if groups is not None:
        yield from groups(layer, ids)
        return
    many = getattr(experts, "get_many", None)
    items = many(layer, ids) if many is not None else ((e, experts.get(layer, e)) for e in ids)
    for item in items:
        yield [item]


def grouped_source(experts: Experts, layer: int, before: Callable[[np.ndarray], None] | None = None) -> GroupedSource:
    """The MoE's expert source for `layer` over the provider `experts` (`expert_groups`);
    before(ids), if given, runs first (a session records its requests there)."""

    def groups(ids: np.ndarray) -> Iterator[list[tuple[int, ExpertWeights]]]:
        if before is not None:
            before(ids)
        yield from expert_groups(experts, layer, ids)

    return GroupedSource(groups)


class EngramRows(Protocol):
    """DeepSeek-V4.1's Engram table rows by id, dequantised. The ids of a pass are known from its
    token ids before layer 0 (`Session.read_ahead`), so `prefetch` comes first, well ahead of
    the Engram layer's `rows` call."""

    def prefetch(self, layer: int, ids: np.ndarray) -> None:
        """A hint: the rows ids (T, columns) of Engram layer `layer` are about to be needed."""
        ...

    def rows(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """ids (T, columns) int64 -> (T, columns, head_dim) float32: E4M3 values times their
        E8M0 scale (one per 32 columns)."""
        ...

    def rows_chunks(self, layer: int, ids: np.ndarray, chunk: int) -> Iterator[np.ndarray]:
        """`rows(layer, ids)` in pieces of `chunk` tokens, read as one call. Optional: the engine
        falls back to one `rows` call per piece."""
        ...


class CatalogEngramRows:
    """Engram rows read from the checkpoint on demand, each distinct row once per call; nothing
    kept between calls. For tests and small tables: the released tables (~100 GB each) are
    streamed by a dedicated provider."""

    def __init__(self, cat: Catalog) -> None:
        self.cat = cat

    def prefetch(self, layer: int, ids: np.ndarray) -> None:
        pass

    def rows(self, layer: int, ids: np.ndarray) -> np.ndarray:
        weight, scale = linear_names(engram_names(self.cat.config, layer)["table"])
        uniq, inverse = np.unique(np.asarray(ids, dtype=np.int64), return_inverse=True)
        vals = e4m3_to_f32(self.cat.read_rows(weight, uniq))  # (n, head_dim)
        s = scale_to_f32(self.cat.read_rows(scale, uniq))  # (n, head_dim / 32)
        n, hd = vals.shape
        deq = (vals.reshape(n, -1, 32) * s[:, :, None]).reshape(n, hd)
        return deq[inverse.reshape(np.shape(ids))]


class CatalogTrunk:
    """All dense weights read from the checkpoint into memory, once, on first use."""

    def __init__(self, cat: Catalog) -> None:
        self.cat = cat
        self._layers: dict[int, BlockWeights] = {}
        self._head: TopWeights | None = None
        self._int8 = False  # `use_int8_trunk`: layers loaded from now on are converted too
        e = cat.entry(MODEL["embed"])
        self._embed_bf16 = e.dtype == "BF16"

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64)
        rows = self.cat.read_rows(MODEL["embed"], ids)
        return bf16_to_f32(rows) if self._embed_bf16 else rows.astype(np.float32)

    def layer(self, i: int) -> BlockWeights:
        w = self._layers.get(i)
        if w is None:
            w = self._layers[i] = load_block(self.cat, i)
            if self._int8:
                self._convert(w)
        return w

    def use_int8_trunk(self) -> None:
        """The FP8 weights of every layer, loaded or to be loaded, in their int8 form (`trunkq8`:
        a fast engine on a CPU without a BF16 dot product)."""
        self._int8 = True
        for w in self._layers.values():
            self._convert(w)

    @staticmethod
    def _convert(w: BlockWeights) -> None:
        from ..kernels import trunkq8

        trunkq8.convert_block(w)

    def tid2eid(self, i: int) -> np.ndarray:
        return self.layer(i).moe.tid2eid

    def head(self) -> TopWeights:
        if self._head is None:
            self._head = load_top(self.cat)
        return self._head


class CatalogExperts:
    """Routed experts read from the checkpoint on first use and kept in memory."""

    def __init__(self, cat: Catalog) -> None:
        self.cat = cat
        self._cache: dict[ExpertKey, ExpertWeights] = {}

    def get(self, layer: int, expert: int) -> ExpertWeights:
        key = (layer, expert)
        w = self._cache.get(key)
        if w is None:
            w = self._cache[key] = load_expert(self.cat, layer, expert)
        return w

    def get_many(self, layer: int, experts: Sequence[int]) -> Iterator[tuple[int, ExpertWeights]]:
        for e in experts:
            yield e, self.get(layer, e)

    def get_groups(self, layer: int, experts: Sequence[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        yield [(e, self.get(layer, e)) for e in experts]  # all in memory, for good

    def prefetch(self, keys: Sequence[ExpertKey]) -> None:
        pass
