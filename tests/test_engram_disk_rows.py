"""DiskEngramRows: V4.1's Engram tables read from disk through the row cache, against the
safetensors library's bytes; the hash-to-row path end to end; counters; bad layers."""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import tokenizers

from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.checkpoint.spec_v41 import engram_names
from dsv4stream.checkpoint.tensors import linear_names
from dsv4stream.engram import HashLayout, next_row_ids, row_ids, token_classes
from dsv4stream.errors import CheckpointError, Dsv4Error
from dsv4stream.streaming.engram import DiskEngramRows, engram_tables

QUIET = {"warn": lambda m: None}


def library_tables(ckpt: Path) -> dict[int, np.ndarray]:
    """Each Engram layer's table dequantised from the safetensors library's raw bytes with
    ml_dtypes (independent of dsv4stream's catalog and formats): (rows, head_dim) float32."""
    cfg = Catalog.open(ckpt).config
    raw = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        raw.update(dict(safetensors.deserialize(shard.read_bytes())))
    out = {}
    for layer in cfg.engram.layer_ids:
        weight, scale = linear_names(engram_names(cfg, layer)["table"])
        w, s = raw[weight], raw[scale]
        vals = np.frombuffer(bytes(w["data"]), dtype=ml_dtypes.float8_e4m3fn).reshape(w["shape"]).astype(np.float32)
        sdt = ml_dtypes.float8_e8m0fnu if s["dtype"] == "F8_E8M0" else np.float32
        sc = np.frombuffer(bytes(s["data"]), dtype=sdt).reshape(s["shape"]).astype(np.float32)
        n, hd = vals.shape
        out[layer] = (vals.reshape(n, sc.shape[1], -1) * sc[:, :, None]).reshape(n, hd)
    return out


@pytest.fixture(scope="module")
def truth(tiny_v41):
    return library_tables(tiny_v41)


@pytest.fixture(scope="module")
def cat(tiny_v41):
    return Catalog.open(tiny_v41)


def test_rows_match_the_safetensors_library_for_every_engram_layer(cat, truth):
    e = cat.config.engram
    rng = np.random.default_rng(0)
    with DiskEngramRows(cat, capacity=64, verify=True, **QUIET) as rows:
        for layer in e.layer_ids:
            n = e.table_rows(layer)
            ids = rng.integers(0, n, (9, e.columns))
            ids[0, :] = n - 1  # the last row and a repeat
            got = rows.rows(layer, ids)
            assert got.shape == (9, e.columns, e.head_dim) and got.dtype == np.float32
            assert np.array_equal(got, truth[layer][ids])
        s = rows.stats()
    assert s.verified_rows == s.rows_read > 0 and s.verify_mismatches == 0


def test_float_scales_are_read_and_applied_too(tmp_path):
    from dsv4stream.synth import make_checkpoint

    ck = make_checkpoint(tmp_path / "f", "tiny-v41", seed=2, scale_fmt="float", engram_head_dim=64)
    cat = Catalog.open(ck)
    truth = library_tables(ck)
    layer = cat.config.engram.layer_ids[-1]
    ids = np.arange(cat.config.engram.table_rows(layer))[::-1].reshape(1, -1)
    with DiskEngramRows(cat, capacity=16, **QUIET) as rows:
        assert rows.cache.tables[1].parts[1].row_bytes == 2 * 4  # two float32 scales per 64-wide row
        assert np.array_equal(rows.rows(layer, ids), truth[layer][ids])


def test_the_hash_to_row_path_end_to_end(tiny_v41, cat, truth):
    """Token ids -> classes (the checkpoint's tokenizer) -> row ids, batch and one at a time ->
    prefetched -> rows equal to the library's table rows; each distinct row read once."""
    e = cat.config.engram
    classes = token_classes(tokenizers.Tokenizer.from_file(str(tiny_v41 / "tokenizer.json")))
    layout = HashLayout.build(
        e.layer_ids, e.max_ngram_size, e.n_heads, e.vocab_size, classes.n_classes,
        int(classes.of(np.array([e.pad_token_id]))[0]),
    )  # fmt: skip
    tokens = np.random.default_rng(3).integers(0, cat.config.vocab_size, 40)
    ids, history = row_ids(layout, classes.of(tokens[:30]))
    step = []
    for t in tokens[30:]:
        r, history = next_row_ids(layout, history, int(classes.of(np.array([t]))[0]))
        step.append(r)
    ids = np.concatenate([ids, np.stack(step)])  # (40, L, columns)
    assert np.array_equal(ids, row_ids(layout, classes.of(tokens))[0])
    with DiskEngramRows(cat, capacity=4000, **QUIET) as rows:
        for k, layer in enumerate(e.layer_ids):
            rows.prefetch(layer, ids[:, k])
        for k, layer in enumerate(e.layer_ids):
            assert np.array_equal(rows.rows(layer, ids[:, k]), truth[layer][ids[:, k]])
        s = rows.stats()
    distinct = sum(np.unique(ids[:, k]).size for k in range(len(e.layer_ids)))
    assert s.prefetches == s.rows_read == s.prefetch_used == s.misses == distinct
    assert s.requests == ids.size and s.hits == ids.size - distinct


def test_tables_are_the_checkpoints_tensors(cat):
    e = cat.config.engram
    tables = engram_tables(cat)
    assert list(tables) == list(e.layer_ids)
    for layer, t in tables.items():
        weight, scale = linear_names(engram_names(cat.config, layer)["table"])
        assert [p.name for p in t.parts] == [weight, scale]
        assert t.rows == e.table_rows(layer) and t.row_bytes == e.head_dim + e.head_dim // 32
        assert t.parts[1].offset >= t.parts[0].offset + t.rows * e.head_dim  # the scales after the rows


def test_a_layer_without_a_table_is_a_one_line_error(cat):
    with DiskEngramRows(cat, capacity=4, **QUIET) as rows:
        with pytest.raises(CheckpointError, match="layer 0 has no Engram table") as err:
            rows.rows(0, np.zeros((1, cat.config.engram.columns), dtype=np.int64))
        assert "\n" not in str(err.value)
        with pytest.raises(Dsv4Error, match="outside"):
            rows.prefetch(cat.config.engram.layer_ids[0], np.array([[10**9]]))


def test_a_v4_checkpoint_has_no_engram_rows(tmp_path):
    from dsv4stream.synth import make_checkpoint

    ck = make_checkpoint(tmp_path / "v4", "tiny", seed=0)
    with pytest.raises(CheckpointError, match="no Engram layers"):
        DiskEngramRows(Catalog.open(ck), capacity=4)
