"""The verifier finds every tensor through the file's own header, so a wrong offset anywhere
in the fast path (catalog, layouts, placement) is caught, not re-read the same wrong way."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from store_files import make_files

from dsv4stream import synth
from dsv4stream.checkpoint import catalog
from dsv4stream.cli.run import run as run_cmd
from dsv4stream.errors import VerifyError
from dsv4stream.store import ExpertStore, directio
from dsv4stream.store.runs import Run
from dsv4stream.streaming.expert_layout import expert_label

QUIET = {"warn": lambda m: None}


def test_an_offset_wrong_in_the_layout_is_caught(tmp_path):
    layouts, truth = make_files(tmp_path, files=1)
    # the w1.weight of (0, 1) is its own run's first piece only when runs are split per tensor: build one
    src = next(p for r in layouts[(0, 2)] for p in r.pieces if p.name.endswith("w1.weight"))
    lay = tuple(
        Run(r.path, src.offset, p.nbytes, (dataclasses.replace(p, offset=src.offset),))
        if p.name.endswith("w1.weight") else Run(r.path, p.offset, p.nbytes, (p,))
        for r in layouts[(0, 1)] for p in r.pieces
    )  # fmt: skip
    bad = {**layouts, (0, 1): lay}
    at = [p.name for r in lay for p in r.pieces].index("layers.0.ffn.experts.1.w1.weight")
    with ExpertStore(bad, slots=2, label=expert_label, **QUIET) as store:  # unverified: silently wrong bytes
        got = store.get((0, 1))[at].tobytes()
    assert got != truth["layers.0.ffn.experts.1.w1.weight"]
    store = ExpertStore(bad, slots=2, verify=True, label=expert_label, **QUIET)
    with (
        store,
        pytest.raises(VerifyError, match=r"w1\.weight: the fast path read .* but the file's header puts them at"),
    ):
        store.get((0, 1))


def test_a_byte_changed_after_the_fast_read_is_blamed_on_both_possible_causes(tmp_path, monkeypatch):
    layouts, _ = make_files(tmp_path, files=1)
    real = directio.FileSet.read

    def flaky(self, window, slot):  # as if O_DIRECT returned other bytes than the page cache holds
        n = real(self, window, slot)
        slot[window.slot_offset + window.nbytes // 2] ^= 0xFF
        return n

    monkeypatch.setattr(directio.FileSet, "read", flaky)
    store = ExpertStore(layouts, slots=2, verify=True, label=expert_label, **QUIET)
    with store, pytest.raises(VerifyError) as err:
        store.get((0, 1))
    msg = str(err.value)
    assert "placed the bytes wrongly" in msg and "page cache returned different data" in msg and "\n" not in msg


def test_run_verify_catches_a_catalog_that_misread_a_header(tmp_path, monkeypatch):
    ckpt = synth.make_checkpoint(tmp_path / "c", "tiny", seed=2)
    real = catalog.read_header

    def misread(path: Path):  # one routed expert's w2.weight read from its neighbour's bytes
        out = real(path)
        names = {e.name: i for i, e in enumerate(out)}
        a, b = "layers.1.ffn.experts.0.w2.weight", "layers.1.ffn.experts.1.w2.weight"
        if a in names and b in names:
            out[names[a]] = dataclasses.replace(out[names[a]], offset=out[names[b]].offset)
        return out

    monkeypatch.setattr(catalog, "read_header", misread)
    args = [str(ckpt), "--prompt-ids", "1,2,3,4,5,6,7,8", "--gen", "4", "--budget", "1"]
    res = CliRunner().invoke(run_cmd, [*args, "--verify"])
    assert isinstance(res.exception, VerifyError), res.output
    assert "layers.1.ffn.experts.0.w2.weight" in str(res.exception) and "header puts them at" in str(res.exception)


def test_verify_reads_a_packed_trunk_through_its_manifest(tmp_path):
    from dsv4stream.trunkpack.writer import pack_trunk

    ckpt = synth.make_checkpoint(tmp_path / "c", "tiny", seed=2)
    pack_trunk(ckpt, progress=False)
    stats = tmp_path / "s.json"
    args = [str(ckpt), "--prompt-ids", "1,2,3", "--gen", "3", "--budget", "1", "--verify", "--stats-json", str(stats)]
    res = CliRunner().invoke(run_cmd, args)
    assert res.exit_code == 0, res.output
    assert json.loads(stats.read_text())["trunk_verified_reads"] > 0
    # without its manifest the verifier cannot find the trunk's tensors itself: it refuses, never guesses
    (ckpt / "dsv4-trunk" / "manifest.json").rename(tmp_path / "m.json")
    from dsv4stream.store.verify import Part, Verifier

    v = Verifier()
    with pytest.raises(VerifyError, match="cannot find the tensors"):
        v.check("x", [Part(str(ckpt / "dsv4-trunk" / "trunk.bin"), "head.weight", 0, 0, np.zeros(4, np.uint8))])
    v.close()
