"""The one table of checkpoint names (`spec`): it covers every tensor of a generated checkpoint,
and the loaders consume every name it holds, for each mtp.* layout (preview MTP, 0731 DSpark, none).

What the loaders consume is recorded from the outside: a catalog look-alike that notes every
name asked of it, driven through the same providers and layouts a run uses.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.checkpoint.config import DSPARK, PREVIEW
from dsv4stream.checkpoint.spec_v4 import COMPRESSOR, MTP_EXTRAS
from dsv4stream.checkpoint.tensors import (
    BLOCK,
    EXPERT_LINEARS,
    EXPERT_NAME,
    HC_PARTS,
    MODEL,
    block_names,
    is_drafter,
    layer_prefix,
)
from dsv4stream.streaming.expert_layout import expert_layouts
from dsv4stream.streaming.layout import trunk_layout
from dsv4stream.weights.providers import CatalogExperts, CatalogTrunk

LAYOUTS = {
    "preview": ("tiny", {}),
    "0731": ("tiny-0731", {}),
    "none": ("tiny", {"num_nextn_predict_layers": 0, "compress_ratios": [0, 4, 8, 4]}),
}


class Recording:
    """What the loaders call on a catalog, answered by the real one, each name noted."""

    qweight = Catalog.qweight
    f32 = Catalog.f32

    def __init__(self, cat: Catalog) -> None:
        self._cat = cat
        self.config = cat.config
        self.names: set[str] = set()

    def entry(self, name: str):
        self.names.add(name)
        return self._cat.entry(name)

    def read(self, name: str):
        self.names.add(name)
        return self._cat.read(name)

    def read_rows(self, name: str, rows):
        self.names.add(name)
        return self._cat.read_rows(name, rows)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cat(request, tmp_path_factory) -> Catalog:
    preset, over = LAYOUTS[request.param]
    out = synth.make_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", preset=preset, seed=3, **over)
    c = Catalog.open(out)
    c.validate()
    return c


def loaded_names(cat: Catalog) -> set[str]:
    """Every name the in-memory providers read for a whole forward pass over every expert."""
    rec = Recording(cat)
    cfg = cat.config
    trunk, experts = CatalogTrunk(rec), CatalogExperts(rec)
    trunk.embed(np.array([0]))
    for i in range(cfg.n_layers):
        trunk.layer(i)
        for e in range(cfg.n_routed_experts):
            experts.get(i, e)
    trunk.head()
    return rec.names


def test_the_loaders_read_exactly_the_main_model(cat):
    main = {n for n in cat.entries if not is_drafter(n)}
    assert loaded_names(cat) == main


def test_the_streamed_path_places_exactly_the_main_model(cat):
    cfg = cat.config
    layout = trunk_layout(cat)
    placed = {layout.embed.name} | {n for g in (*layout.layers, layout.head) for n in g.entries}
    el = expert_layouts(cat.entries, cfg.n_layers)
    placed |= {p.name for k, v in el.layouts.items() if k[0] < cfg.n_layers for run in v for p in run.pieces}
    assert placed == {n for n in cat.entries if not is_drafter(n)}


def test_the_table_names_every_drafter_tensor(cat):
    cfg = cat.config
    drafter = {n for n in cat.entries if is_drafter(n)}
    assert bool(drafter) == bool(cfg.n_mtp)
    blocks = [cfg.n_layers + k for k in range(cfg.n_mtp)]
    # block tensors of mtp.k come from BLOCK; what each layout adds, from MTP_EXTRAS
    spelled = [v for b in blocks for v in block_names(cfg, b).values()]
    spelled += [layer_prefix(cfg, b) + x[1] for b in blocks for x in MTP_EXTRAS.get(cfg.layout or "", ())]
    assert not [n for n in drafter if not any(n.startswith(p) for p in spelled)]
    # routed experts of mtp.k are found by the same pattern, keyed n_layers + k
    mtp_experts = {n for n in drafter if EXPERT_NAME.match(n)}
    keys = {k for k in expert_layouts(cat.entries, cfg.n_layers).layouts if k[0] >= cfg.n_layers}
    assert len(keys) == cfg.n_mtp * cfg.n_routed_experts
    assert len(mtp_experts) == len(keys) * 2 * len(EXPERT_LINEARS)


def test_every_table_name_is_consumed(cat):
    cfg = cat.config
    used = loaded_names(cat)

    def consumed(prefix: str) -> bool:
        return any(n.startswith(prefix) for n in used)

    unused = [k for k in BLOCK if not any(consumed(block_names(cfg, i)[k]) for i in range(cfg.n_layers))]
    unused += [k for k, v in MODEL.items() if not consumed(v)]
    for part, parts in (("compressor", COMPRESSOR.values()), ("mHC", [f"_{x}" for x in HC_PARTS])):
        unused += [f"{part} {p}" for p in parts if not any(p in n for n in used)]
    unused += [f"expert {w}" for w in EXPERT_LINEARS if not any(f".{w}." in n for n in used)]
    assert not unused, f"table entries no loader reads: {unused}"
    if cfg.layout in (PREVIEW, DSPARK):  # the layout's extras are in the checkpoint (validated, not run)
        p0 = layer_prefix(cfg, cfg.n_layers)
        last = layer_prefix(cfg, cfg.n_layers + cfg.n_mtp - 1)
        for which, name, _, _, _ in MTP_EXTRAS[cfg.layout]:
            stage = last if which == "last" else p0
            assert any(n.startswith(stage + name) for n in cat.entries), f"{cfg.layout}: {stage + name} absent"


def test_a_loader_that_skips_a_tensor_is_caught(cat, monkeypatch):
    # the bug the first test guards against: a field the loader forgets is a tensor nobody reads
    from dsv4stream.weights import loading_v4 as loading

    real = loading._compressor
    monkeypatch.setattr(loading, "_compressor", lambda c, p: real(c, p) if "indexer" not in p else None)
    assert loaded_names(cat) != {n for n in cat.entries if not is_drafter(n)}
