"""Every file a command writes: never over a checkpoint, pack or kv cache file, never half a file.

Each test points an output option at something it must not replace (a shard, the config, the
index, a pack's trunk.bin, a tokenizer pack, a kv cache state, a FIFO, a link into the
checkpoint) and checks for one `dsv4:` line, exit 2, and the file's bytes unchanged; or makes
a run fail after its output was opened and checks nothing was truncated or left behind."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from cli_runs import dsv4, dsv4_child, refused
from click.testing import CliRunner

from dsv4stream import synth
from dsv4stream.cli.outputs import check_output
from dsv4stream.cli.run import run as run_cmd
from dsv4stream.errors import ReadError, UsageError
from dsv4stream.files import AtomicFile, atomic_write
from dsv4stream.run.runtime import Runtime
from dsv4stream.text.tokenizer import pack_tokenizer
from dsv4stream.trunkpack.writer import pack_trunk


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    c = synth.make_checkpoint(
        tmp_path_factory.mktemp("out") / "ck", "tiny", seed=2, vocab_size=synth.REAL_VOCAB, tokenizer=True
    )
    pack_trunk(c, progress=False)
    pack_tokenizer(c)
    return c


def inputs(c: Path) -> list[Path]:
    """Files of the checkpoint and its packs an output must never replace."""
    index = json.loads((c / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted(set(index.values()))[1]
    return [
        c / "config.json",
        c / "model.safetensors.index.json",
        c / shard,
        c / "tokenizer.json",
        c / "dsv4-trunk" / "trunk.bin",
        c / "dsv4-trunk" / "manifest.json",
        c / "dsv4-tokenizer.pack",
    ]


@pytest.mark.parametrize("which", range(7))
def test_run_outputs_never_replace_a_checkpoint_or_pack_file(ckpt, which):
    target = inputs(ckpt)[which]
    before = digest(target)
    for flag in ("--stats-json", "--route-log"):
        r = dsv4("run", str(ckpt), "--prompt-ids", "1,2", "--gen", "2", "--budget", "3", flag, str(target))
        refused(r, flag, "writing there would destroy it")
        assert digest(target) == before


@pytest.mark.parametrize("which", [0, 2, 4])
def test_logits_out_never_replaces_a_checkpoint_or_pack_file(ckpt, which):
    target = inputs(ckpt)[which]
    before = digest(target)
    r = dsv4("logits", str(ckpt), "--tokens", "1,2", "--out", str(target))
    refused(r, "--out", "writing there would destroy it")
    assert digest(target) == before


def test_bench_outputs_never_replace_a_checkpoint_file(ckpt, tmp_path):
    log = tmp_path / "route.log"
    log.write_text("0 1\n")
    before = digest(ckpt / "config.json")
    for flag in ("--json", "--csv", "--plot"):
        r = dsv4(
            "bench", "simulate", str(log), "--cache-experts", "4", "--hints", "none", flag, str(ckpt / "config.json")
        )
        refused(r, flag, "a file of the checkpoint")
    r = dsv4("bench", "run", str(ckpt), "--budgets", "3", "--out", str(ckpt / "dsv4-trunk"))
    refused(r, "--out", "is a trunk pack")
    assert digest(ckpt / "config.json") == before


def test_a_link_into_the_checkpoint_is_refused_too(ckpt, tmp_path):
    link = tmp_path / "stats.json"
    link.symlink_to(ckpt / "config.json")
    with pytest.raises(UsageError, match="a file of the checkpoint"):
        check_output(link, "--stats-json")


def test_a_kv_cache_state_and_a_safetensors_file_are_refused(tmp_path):
    state = tmp_path / "0123abcd.dsv4state"
    state.write_bytes(b"DSV4STAT")
    with pytest.raises(UsageError, match="a state file of a kv cache"):
        check_output(state, "--stats-json")
    lone = tmp_path / "weights.safetensors"
    lone.write_bytes(b"x")
    with pytest.raises(UsageError, match="a safetensors file"):
        check_output(lone, "--out")
    check_output(tmp_path / "new.json", "--out")  # a new file beside them is fine


def test_a_fifo_or_a_device_as_output_is_named_not_opened(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    r = dsv4_child("logits", str(tmp_path), "--tokens", "1", "--out", str(fifo))  # a hang times out
    refused(r, "is a FIFO")
    assert time.monotonic() - t0 < 60
    with pytest.raises(UsageError, match="is a character device"):
        check_output(Path("/dev/null"), "--stats-json")


def test_a_failed_run_leaves_the_old_route_log_and_no_temporary_file(ckpt, tmp_path, monkeypatch):
    log, stats = tmp_path / "route.log", tmp_path / "stats.json"
    log.write_text("previous run\n")
    real = Runtime.generate

    def failing(self, *a, **k):
        for n, t in enumerate(real(self, *a, **k)):
            yield t
            if n == 1:
                raise ReadError("injected read error")

    monkeypatch.setattr(Runtime, "generate", failing)
    args = [str(ckpt), "--prompt-ids", "1,2,3", "--gen", "6", "--budget", "3"]
    res = CliRunner().invoke(run_cmd, [*args, "--route-log", str(log), "--stats-json", str(stats)])
    assert isinstance(res.exception, ReadError)
    assert log.read_text() == "previous run\n"  # not truncated, not half written
    assert json.loads(stats.read_text())["exit"]["status"] == "error"  # a whole file saying why
    assert sorted(p.name for p in tmp_path.iterdir()) == ["route.log", "stats.json"]
    monkeypatch.setattr(Runtime, "generate", real)
    res = CliRunner().invoke(run_cmd, [*args, "--route-log", str(log)])
    assert res.exit_code == 0, res.output
    assert log.read_text() != "previous run\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "route.log",
        "stats.json",
    ]


def test_an_atomic_file_appears_whole_or_not_at_all(tmp_path):
    p = tmp_path / "out.txt"
    p.write_text("old")
    with pytest.raises(RuntimeError), AtomicFile(p, "w") as f:
        f.write("half")
        raise RuntimeError("stopped")
    assert p.read_text() == "old" and [q.name for q in tmp_path.iterdir()] == ["out.txt"]
    p.chmod(0o600)
    atomic_write(p, "new")
    assert p.read_text() == "new" and p.stat().st_mode & 0o777 == 0o600
    link = tmp_path / "link.txt"
    link.symlink_to(p)
    atomic_write(link, "through the link")
    assert link.is_symlink() and p.read_text() == "through the link"
