"""The Engram layers' prefill stays inside the plan.

A segment's Engram rows are gathered, dequantised and gated one attention sub-chunk at a time
(`engine.stack_v41`): a whole segment at once would hold S x columns x head_dim floats and their
projection (~0.5 GB at S = 4096 on the release), which the plan's segment bytes do not count.
The planner's staging counts one sub-chunk's peak (`planner_v41.engram_token_bytes`), checked
here against tracemalloc's peak of the same code on generated checkpoints.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.checkpoint.config import ModelConfig
from dsv4stream.engine.session import Engine
from dsv4stream.model.v41.engram import engram
from dsv4stream.run import planner, planner_v41
from dsv4stream.streaming.engram import DiskEngramRows
from dsv4stream.synth import make_checkpoint
from dsv4stream.weights.providers import CatalogEngramRows, CatalogExperts, CatalogTrunk

V41_CONFIG = Path(__file__).resolve().parents[1] / "dsv4stream" / "v41_flash_config.json"


class Recording(CatalogEngramRows):
    """The catalog's rows, with the number of tokens of each `rows` call."""

    def __init__(self, cat) -> None:
        super().__init__(cat)
        self.calls: list[tuple[int, int]] = []

    def rows(self, layer: int, ids: np.ndarray) -> np.ndarray:
        self.calls.append((layer, ids.shape[0]))
        return super().rows(layer, ids)


def test_a_segment_reads_its_engram_rows_one_sub_chunk_at_a_time(tiny_v41) -> None:
    cat = Catalog.open(tiny_v41)
    rec = Recording(cat)
    e = Engine(cat.config, CatalogTrunk(cat), CatalogExperts(cat), cat, engram_rows=rec)
    x = np.random.default_rng(3).integers(0, cat.config.vocab_size, 30)
    got = e.session(chunk_size=8, segment=30).prefill(x)
    layers = cat.config.engram.layer_ids
    assert rec.calls == [(layer, n) for layer in layers for n in (8, 8, 8, 6)]
    # the same tokens in one sub-chunk: the Engram part is per token, so only attention's
    # sub-chunking differs (float rounding)
    rec.calls.clear()
    whole = e.session(chunk_size=64, segment=30).prefill(x)
    assert rec.calls == [(layer, 30) for layer in layers]
    assert np.abs(got - whole).max() <= 1e-3 * np.abs(whole).max()


@pytest.mark.parametrize("over", [{}, {"engram_head_dim": 256, "engram_n_heads": 8}], ids=["tiny", "24-rows-of-256"])
def test_the_staging_counts_an_engram_sub_chunk(tmp_path, over) -> None:
    ck = make_checkpoint(tmp_path / "ck", "tiny-v41", seed=2, **over)
    e = Engine.open(ck)
    cfg, t = e.cfg, 64
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, t)
    rows, _ = e.stack.engram_ids.rows((), ids)
    layer = cfg.engram.layer_ids[0]
    w = e.trunk.layer(layer).engram
    x = np.random.default_rng(1).standard_normal((t, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    with DiskEngramRows(Catalog.open(ck), 4096, io="buffered") as prov:
        engram(x, prov.rows(layer, rows[:, 0]), w, cfg.rms_norm_eps, True)  # rows cached, kernels warm
        tracemalloc.start()
        try:
            engram(x, prov.rows(layer, rows[:, 0]), w, cfg.rms_norm_eps, True)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    per_token = planner_v41.engram_token_bytes(cfg)
    assert peak <= t * per_token, (peak / t, per_token)
    assert peak >= t * per_token // 2  # the estimate is not blind padding either
    assert planner_v41.staging_extra_bytes(cfg, t, 256) >= t * per_token


def test_disk_rows_in_pieces_read_and_count_as_one_call(tmp_path) -> None:
    """rows_chunks: the pieces are rows() of each piece, bit for bit, and with a cache smaller
    than the segment's rows, a row repeated across pieces is still read once (as in one call)."""
    ck = make_checkpoint(tmp_path / "ck", "tiny-v41", seed=4)
    e = Engine.open(ck)
    x = np.random.default_rng(2).integers(0, 40, 200)  # few token ids: n-grams repeat
    rows, _ = e.stack.engram_ids.rows((), x)
    layer, ids = e.cfg.engram.layer_ids[0], rows[:, 0]
    cat = Catalog.open(ck)
    with DiskEngramRows(cat, 64, io="buffered") as one, DiskEngramRows(cat, 64, io="buffered") as parts:
        whole = one.rows(layer, ids)
        got = list(parts.rows_chunks(layer, ids, 16))
        assert [g.shape[0] for g in got] == [16] * 12 + [8]
        np.testing.assert_array_equal(np.concatenate(got), whole)
        a, b = one.stats(), parts.stats()
        assert (a.requests, a.hits, a.misses) == (b.requests, b.hits, b.misses)
        assert a.hits > 0 and a.misses > 64  # repeats, and more distinct rows than the cache holds
    assert planner_v41.segment_extra_bytes(e.cfg) == e.cfg.engram.columns * (
        planner_v41.engram_slot_bytes(e.cfg) + e.cfg.engram.row_bytes + planner_v41.ROW_INDEX_BYTES
    )


def test_the_release_engram_sub_chunk_by_hand() -> None:
    cfg = ModelConfig.from_json(V41_CONFIG)
    e = cfg.engram
    assert (e.columns, e.head_dim, e.row_bytes, cfg.hidden_size, cfg.hc_mult) == (24, 256, 264, 5120, 4)
    rows, kv, streams = 24 * 256 * 4, 5 * 5120 * 4, 4 * 5120 * 4  # float32 bytes a token
    assert planner_v41.engram_token_bytes(cfg) == rows + kv + max(2 * rows, streams) + 24 * (264 + 192) == 219_840
    # at the default sub-chunk that is 14 MB of staging, against ~0.9 GB for a 4096-token segment
    # at once (what the Engram layers held before they ran per sub-chunk)
    assert planner.staging_bytes_for(cfg, 64) >= 64 * 219_840
