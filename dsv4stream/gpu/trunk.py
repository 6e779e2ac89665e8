"""Trunk matrices in VRAM, served to the weight loader in place of their CPU copies.

Owns: the placement candidates read from the catalog (every 2-D `.weight` of a main layer
that the model turns into a `QWeight`, and the head), the upload of the chosen ones (each
read from the checkpoint once, uploaded, its host copy dropped: one matrix in RAM at a
time), and `PlacedSource`, a catalog look-alike whose `qweight(prefix)` answers with the
device copy. The family's loaders (`weights.family`) build their named weights from such a
source, so whichever trunk provider builds the layers (all in RAM, or streamed through a
ring) gets `DeviceQWeight`s for placed matrices and never reads their bytes again; a
streamed trunk leaves `Placed.tensor_names` out of its groups, so its slots (and the
budget) shrink by what went to VRAM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..checkpoint.spec import block_specs
from ..checkpoint.tensors import MODEL, TensorSpec, linear_names, released_nbytes
from ..kernels import QWeight
from .device import Device, DeviceQWeight
from .plan import MIN_BYTES, PARAMS_PER_BYTE, Key, Matrix, Placement, device_bytes_of, plan_placement

KINDS = {"F8_E4M3": "fp8", "BF16": "bf16", "F32": "f32"}
HEAD = MODEL["head"]


def _linear_specs(cfg) -> list[tuple[int | None, str, TensorSpec | None]]:
    """(layer, tensor prefix, spec) of every 2-D linear weight of the main layers, then the head."""
    found: list[tuple[int | None, str, TensorSpec | None]] = [
        (i, s.name.rpartition(".")[0], s)
        for i in range(cfg.n_layers)
        for s in block_specs(cfg, i, with_experts=False)
        if len(s.shape) == 2 and s.name == linear_names(s.name.rpartition(".")[0])[0]
    ]
    found.append((None, HEAD, None))
    return found


def candidates(cat) -> list[Matrix]:
    """Matrices that may go to VRAM, keyed (layer, tensor prefix); the head is (None, "head")."""
    cfg = cat.config
    out = []
    for layer, prefix, _ in _linear_specs(cfg):
        weight, scale = linear_names(prefix)
        w = cat.entries.get(weight)
        kind = KINDS.get(w.dtype) if w is not None and len(w.shape) == 2 else None
        if kind is None or kind not in PARAMS_PER_BYTE:
            continue
        s = cat.entries.get(scale)
        host = w.nbytes + (s.nbytes if s is not None and kind == "fp8" else 0)
        rows, cols = w.shape
        out.append(Matrix((layer, prefix), kind, rows, cols, host, device_bytes_of(kind, rows, cols, cfg.fp8_block)))
    return out


def candidates_from_config(cfg) -> list[Matrix]:
    """The same candidates estimated from config.json alone, with the release dtypes (`dsv4
    inspect --gpu` on a bare config): FP8 with E8M0 scales per `cfg.fp8_block`, BF16 head."""
    out = []
    for layer, prefix, spec in _linear_specs(cfg):
        if spec is None:  # the head: BF16 in every release
            rows, cols, kind, host = cfg.vocab_size, cfg.hidden_size, "bf16", 2 * cfg.vocab_size * cfg.hidden_size
        else:
            kind = KINDS[spec.dtypes[0]]
            (rows, cols), host = spec.shape, released_nbytes(cfg, spec)
        out.append(Matrix((layer, prefix), kind, rows, cols, host, device_bytes_of(kind, rows, cols, cfg.fp8_block)))
    return out


@dataclass(frozen=True)
class Placed:
    """The matrices now in VRAM and what the trunk providers need to know about them."""

    weights: Mapping[str, DeviceQWeight]  # tensor prefix -> device weight
    placement: Placement
    kept_on_cpu: tuple[str, ...] = ()  # planned, but VRAM ran out while uploading

    @property
    def tensor_names(self) -> frozenset[str]:
        """Checkpoint tensors a streamed trunk no longer reads (weights and their scales)."""
        names = {linear_names(p)[0] for p in self.weights}
        return frozenset(names | {linear_names(p)[1] for p, w in self.weights.items() if w.scale is not None})

    def source(self, inner) -> PlacedSource:
        return PlacedSource(inner, self.weights)


class PlacedSource:
    """A catalog look-alike: `qweight(prefix)` is the device copy when placed, else the
    wrapped source's; every other attribute is the wrapped source's."""

    def __init__(self, inner, weights: Mapping[str, QWeight]) -> None:
        self._inner = inner
        self._weights = weights
        self.served: set[str] = set()  # prefixes answered from the device (tests, reports)

    def qweight(self, prefix: str) -> QWeight:
        w = self._weights.get(prefix)
        if w is None:
            return self._inner.qweight(prefix)
        self.served.add(prefix)
        return w

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def place(
    cat, device: Device, budget: int, min_bytes: int = MIN_BYTES, progress: Callable[[str], None] | None = None
) -> Placed:
    """Plan on the catalog's sizes, then upload the chosen matrices one at a time."""
    placement = plan_placement(candidates(cat), budget, min_bytes)
    weights: dict[str, DeviceQWeight] = {}
    kept: list[str] = []
    for key in sorted(placement.on_device, key=lambda k: (-1 if k[0] is None else k[0], k[1])):
        prefix = key[1]
        if kept:
            kept.append(prefix)
            continue
        if progress is not None:
            progress(prefix)
        try:
            weights[prefix] = device.upload(cat.qweight(prefix))
        except MemoryError:  # another process took VRAM since the plan: stop placing
            kept.append(prefix)
    return Placed(weights, placement, tuple(kept))


__all__ = ["HEAD", "Key", "Placed", "PlacedSource", "candidates", "candidates_from_config", "place"]
