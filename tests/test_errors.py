"""One error policy: the same failure is one class wherever it happens; bugs keep their
traceback at the command line, problems the user can fix are one line and exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dsv4stream import cli, synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.engine.phases import StepClock, no_reads
from dsv4stream.errors import CheckpointError, Dsv4Error, InternalError, ReadError, ShortReadError
from dsv4stream.model.ops import topk_lowest_index
from dsv4stream.store.directio import FileSet, aligned_buffer, plan_slot
from dsv4stream.streaming.expert_layout import expert_layouts
from dsv4stream.streaming.rows import RowReader
from dsv4stream.trunkpack.format import digest_run


@pytest.fixture(scope="module")
def truncated(tmp_path_factory) -> Catalog:
    """A catalog opened on whole shards, which were then cut to half their size."""
    ckpt = synth.make_checkpoint(tmp_path_factory.mktemp("e") / "tiny", preset="tiny", seed=2)
    cat = Catalog.open(ckpt)
    for shard in Path(ckpt).glob("*.safetensors"):
        os.truncate(shard, shard.stat().st_size // 2)
    return cat


def last_in_its_shard(cat: Catalog, prefix: str = "") -> str:
    """A tensor whose bytes now lie past the cut."""
    return max((e for e in cat.entries.values() if e.name.startswith(prefix)), key=lambda e: e.offset).name


def test_a_truncated_shard_is_one_short_read_error_wherever_it_is_read(truncated):
    """The catalog, the expert store's aligned reads, the embedding rows and the packed
    trunk's checksums all read the same truncated bytes: one error class."""
    cat = truncated
    errors = []
    with pytest.raises(ShortReadError) as e:
        cat.read(last_in_its_shard(cat))
    errors.append(e.value)
    embed = cat.entry("embed.weight")
    with pytest.raises(ShortReadError) as e:
        cat.read_rows("embed.weight", np.array([embed.shape[0] - 1]))
    errors.append(e.value)
    layouts = expert_layouts(cat.entries, cat.config.num_hidden_layers).layouts
    key = max(layouts, key=lambda k: max(r.end for r in layouts[k]))
    plan = plan_slot(layouts[key])
    files = FileSet("buffered")
    with pytest.raises(ShortReadError) as e:
        buf = aligned_buffer(plan.nbytes)
        for w in plan.windows:
            files.read(w, buf)
    files.close()
    errors.append(e.value)
    rows = RowReader(embed)
    with pytest.raises(ShortReadError) as e:
        rows.rows(np.array([embed.shape[0] - 1]))
    rows.close()
    errors.append(e.value)
    last = cat.entry(last_in_its_shard(cat))
    fd = os.open(last.path, os.O_RDONLY)
    with pytest.raises(ShortReadError) as e:
        digest_run(fd, last.offset, last.nbytes, (), path=last.path)
    os.close(fd)
    errors.append(e.value)
    # one class, still a checkpoint problem for code that catches those, one line each
    assert all(isinstance(x, ReadError) and isinstance(x, CheckpointError) for x in errors)
    assert all("\n" not in str(x) and "short read" in str(x) for x in errors) and len(errors) == 5


def test_a_bug_keeps_its_traceback_and_a_user_problem_is_one_line(monkeypatch, capsys):
    def boom(kind):
        def cmd(*a, **k):
            raise kind("the thing went wrong")

        return cmd

    from dsv4stream.cli import tokenizer as tok_cmd

    monkeypatch.setattr(tok_cmd.tokenize_cmd, "callback", boom(ShortReadError))
    with pytest.raises(SystemExit) as e:
        cli.main(["tokenize", "--tok", "t", "x"])
    assert e.value.code == 2 and capsys.readouterr().err == "dsv4: the thing went wrong\n"
    monkeypatch.setattr(tok_cmd.tokenize_cmd, "callback", boom(InternalError))
    with pytest.raises(InternalError, match="the thing went wrong"):
        cli.main(["tokenize", "--tok", "t", "x"])
    assert not issubclass(InternalError, Dsv4Error)


def test_invariants_are_checked_even_without_asserts():
    """Explicit checks, not `assert` (which `python -O` strips): a broken contract raises
    InternalError."""
    with pytest.raises(InternalError, match="need 1 <= k"):
        topk_lowest_index(np.zeros((2, 3), np.float32), 4)
    with pytest.raises(InternalError, match=r"end\(\) without begin\(\)"):
        StepClock(no_reads).end()
