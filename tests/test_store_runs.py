"""Pieces -> runs, runs -> aligned slot plans, and checkpoint catalog -> expert layouts."""

import itertools

import numpy as np
import pytest
from store_files import make_files

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.errors import CheckpointError, InternalError
from dsv4stream.store.directio import ALIGN, plan_slot
from dsv4stream.store.runs import Piece, Run, layout_nbytes, layout_pieces, merge_pieces
from dsv4stream.streaming.expert_layout import EXPERT_TENSORS, expert_layouts

U8 = np.dtype(np.uint8)


def piece(name, offset, n):
    return Piece(name, offset, n, U8, (n,))


def test_merge_touching_pieces_across_files_in_file_order():
    located = [
        ("b", piece("b2", 110, 10)),
        ("a", piece("a1", 5, 10)),
        ("b", piece("b1", 100, 10)),
        ("a", piece("a3", 40, 4)),
        ("a", piece("a2", 15, 25)),
    ]
    runs = merge_pieces(located)
    assert [(r.path, r.offset, r.nbytes) for r in runs] == [("a", 5, 39), ("b", 100, 20)]
    assert [p.name for p in layout_pieces(runs)] == ["a1", "a2", "a3", "b1", "b2"]
    assert layout_nbytes(runs) == 59


def test_merge_splits_at_gaps_unless_allowed():
    located = [("f", piece("x", 0, 10)), ("f", piece("y", 13, 7))]
    assert len(merge_pieces(located)) == 2
    (run,) = merge_pieces(located, max_gap=3)
    assert (run.offset, run.nbytes) == (0, 20)


def test_merge_refuses_overlap_and_piece_checks_its_size():
    with pytest.raises(CheckpointError, match="overlap"):
        merge_pieces([("f", piece("x", 0, 10)), ("f", piece("y", 9, 4))])
    with pytest.raises(InternalError, match="needs 8 bytes"):
        Piece("w", 0, 7, np.dtype(np.float32), (2,))


def test_release_like_files_give_two_unaligned_runs_per_expert(tmp_path):
    layouts, _ = make_files(tmp_path)
    for layout in layouts.values():
        assert len(layout) == 2
        scales, weights = layout
        assert [p.name.rsplit(".", 2)[-1] for p in scales.pieces] == ["scale"] * 3
        assert [p.name.rsplit(".", 2)[-1] for p in weights.pieces] == ["weight"] * 3
        assert weights.offset - scales.end > 50 * ALIGN
        assert scales.offset % ALIGN and weights.offset % ALIGN


def test_plan_keeps_residue_and_windows_disjoint(tmp_path):
    layouts, _ = make_files(tmp_path)
    for layout in layouts.values():
        plan = plan_slot(layout)
        spans = []
        for w, run in zip(plan.windows, layout, strict=True):
            assert w.file_offset % ALIGN == 0 and w.nbytes % ALIGN == 0 and w.slot_offset % ALIGN == 0
            assert w.file_offset <= run.offset and run.end <= w.file_offset + w.nbytes
            spans.append((w.slot_offset, w.slot_offset + w.nbytes))
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert plan.nbytes == sum(w.nbytes for w in plan.windows)
        for p, off in zip(layout_pieces(layout), plan.piece_offsets, strict=True):
            assert off % ALIGN == p.offset % ALIGN


def test_plan_window_can_be_one_page_longer_than_the_run():
    # 100 bytes straddling a page boundary need two pages: the case that bit a peer.
    plan = plan_slot((Run("f", 4090, 100, (piece("x", 4090, 100),)), Run("f", 9000, 8, (piece("y", 9000, 8),))))
    assert [w.nbytes for w in plan.windows] == [2 * ALIGN, ALIGN]
    assert plan.windows[1].slot_offset == 2 * ALIGN
    assert plan.piece_offsets == (4090, 2 * ALIGN + 9000 - 8192)


def test_expert_layouts_from_a_generated_checkpoint(tmp_path):
    ckpt = synth.make_checkpoint(tmp_path / "ck", "tiny", seed=1)
    cat = Catalog.open(ckpt)
    cfg = cat.config
    el = expert_layouts(cat.entries, cfg.num_hidden_layers)
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert sorted(el.layouts) == [(la, e) for la in range(layers) for e in range(cfg.n_routed_experts)]
    assert {len(v) for v in el.layouts.values()} == {2}  # scales apart from weights, as in the release
    names = [p.name for p in layout_pieces(el.layouts[(2, 5)])]
    assert names[:3] == [f"layers.2.ffn.experts.5.w{i}.scale" for i in (1, 2, 3)]  # file order
    assert [names[i] for i in el.order[(2, 5)]] == [f"layers.2.ffn.experts.5.{t}" for t in EXPERT_TENSORS]
    mtp = el.layouts[(cfg.num_hidden_layers, 0)]
    assert layout_pieces(mtp)[0].name.startswith("mtp.0.ffn.experts.0.")


def test_expert_layouts_refuses_an_incomplete_expert(tmp_path):
    ckpt = synth.make_checkpoint(tmp_path / "ck", "tiny", seed=1)
    cat = Catalog.open(ckpt)
    entries = dict(cat.entries)
    del entries["layers.1.ffn.experts.3.w2.scale"]
    with pytest.raises(CheckpointError, match="layer 1 expert 3"):
        expert_layouts(entries, cat.config.num_hidden_layers)


def test_store_serves_a_generated_checkpoint_like_the_catalog(tmp_path):
    from dsv4stream.store import ExpertStore
    from dsv4stream.streaming.expert_layout import expert_label

    ckpt = synth.make_checkpoint(tmp_path / "ck", "tiny", seed=2, scale_fmt="float")
    cat = Catalog.open(ckpt)
    el = expert_layouts(cat.entries, cat.config.num_hidden_layers)
    with ExpertStore(el.layouts, 3, verify=True, label=expert_label, warn=lambda m: None, order=el.order) as store:
        for key in el.layouts:
            with store.hold(key) as got:
                prefix = ("layers" if key[0] < cat.config.num_hidden_layers else "mtp") + "."
                layer = key[0] % cat.config.num_hidden_layers if prefix == "mtp." else key[0]
                for arr, tname in zip(got, EXPERT_TENSORS, strict=True):
                    want = cat.read(f"{prefix}{layer}.ffn.experts.{key[1]}.{tname}")
                    assert arr.dtype == want.dtype and np.array_equal(arr, want)
        assert store.stats().verified_reads == len(el.layouts)
