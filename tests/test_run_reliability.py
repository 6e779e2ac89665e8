"""`dsv4 run` when something is wrong: damaged trunks, NaN weights, mid-run errors, odd values.

Each test injects the failure itself (a flipped byte, a NaN row, an error after two tokens,
bytes that are not UTF-8) and checks the run says so in one `dsv4:` line, exit 2, keeping
what it produced so far (ids on stdout, --stats-json)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import cli_runs
import numpy as np
import pytest
from click.testing import CliRunner

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.cli.run import run as run_cmd
from dsv4stream.engine.numerics import RUN_DEFAULT  # what `dsv4 run` / `serve` compute with
from dsv4stream.engine.session import Engine
from dsv4stream.errors import ReadError
from dsv4stream.run.memory import measure
from dsv4stream.run.planner import minimum_budget
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.trunkpack.reader import TrunkFile
from dsv4stream.trunkpack.writer import pack_trunk

CODE = "from dsv4stream.cli import main; main()"


def dsv4(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """`dsv4 ARGS` by `main()` in this process (cli_runs.dsv4), its output as bytes."""
    r = cli_runs.dsv4(*args, input=stdin)
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.encode(), r.stderr.encode())


def dsv4_child(*args: str | bytes, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """`dsv4 ARGS` in a child: argv bytes and the locale's stdin decoding are a process's."""
    return subprocess.run(
        [sys.executable, "-c", CODE, *args], input=stdin, capture_output=True, check=False, timeout=300, env=env
    )


def one_line(r: subprocess.CompletedProcess, *words: str) -> str:
    err = r.stderr.decode()
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert r.returncode == 2, err
    assert last.startswith("dsv4: ") and "Traceback" not in err, err
    for w in words:
        assert w in last, (w, last)
    return last


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return synth.make_checkpoint(tmp_path_factory.mktemp("rr") / "tiny", preset="tiny", seed=5)


@pytest.fixture(scope="module")
def tok_ckpt(real_vocab_ckpt) -> Path:
    return real_vocab_ckpt  # tiny, seed 3, the real vocabulary and its packed tokenizer (conftest.py)


def copy(src: Path, tmp: Path) -> Path:
    dst = tmp / "ck"
    shutil.copytree(src, dst)
    return dst


def flip(path: str | Path, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def greedy(ckpt: Path, ids: list[int], n: int) -> list[int]:
    return list(Engine.open(ckpt, numerics=RUN_DEFAULT).session().generate(ids, n))


# ---- a byte flipped inside the packed trunk is caught at run time ---------------------


@pytest.mark.parametrize("key", ["layers.1", "head", "embed", "layers.3"])
@pytest.mark.parametrize("budget", ["1", "stream"])
def test_a_flipped_trunk_byte_stops_the_run_naming_the_run_and_file(ckpt, tmp_path, key, budget):
    c = copy(ckpt, tmp_path)
    pack_trunk(c, progress=False)
    tf = TrunkFile.open(c / "dsv4-trunk", Catalog.open(c))
    run = tf.run(key)
    big = max(run.tensors, key=lambda t: t.nbytes)  # not the small tensor the open compares with the shards
    if budget == "stream":  # the smallest budget: layers stream through the ring
        budget = f"{minimum_budget(measure(c, RunOptions(budget=1))) / 1e9 * 1.001:.6f}"
    flip(tf.path, big.offset + big.nbytes // 3)
    for extra in ([], ["--verify"]):
        r = dsv4("run", str(c), "--prompt-ids", "1,2,3", "--gen", "3", "--budget", budget, *extra)
        one_line(r, f"run '{key}'", "trunk.bin", "fails its checksum")
    r = dsv4("inspect", str(c))
    one_line(r, f"run '{key}'", "fails its checksum")


def test_inspect_reports_a_good_pack(ckpt, tmp_path):
    c = copy(ckpt, tmp_path)
    pack_trunk(c, progress=False)
    r = dsv4("inspect", str(c))
    assert r.returncode == 0 and b"every checksum verified" in r.stdout


def test_a_manifest_whose_tensors_overlap_is_refused(ckpt, tmp_path):
    c = copy(ckpt, tmp_path)
    pack_trunk(c, progress=False)
    m = json.loads((c / "dsv4-trunk" / "manifest.json").read_text())
    ts = m["runs"][1]["tensors"]
    ts[1]["offset"] = ts[0]["offset"]  # two tensors read from the same bytes
    (c / "dsv4-trunk" / "manifest.json").write_text(json.dumps(m))
    r = dsv4("run", str(c), "--prompt-ids", "1,2", "--gen", "2", "--budget", "1")
    one_line(r, "misplaced", ts[1]["name"])


# ---- NaN weights stop the run with the layer and tensor -----------------------------


def test_a_nan_head_row_stops_greedy_decoding(ckpt, tmp_path):
    c = copy(ckpt, tmp_path)
    want = greedy(c, [1, 2, 3], 1)[0]
    e = Catalog.open(c).entries["head.weight"]
    row = e.nbytes // e.shape[0]
    with open(e.path, "r+b") as f:  # BF16 NaN (0x7FC0) over the row greedy would pick
        f.seek(e.offset + want * row)
        f.write(np.full(e.shape[1], 0x7FC0, "<u2").tobytes())
    r = dsv4("run", str(c), "--prompt-ids", "1,2,3", "--gen", "8", "--budget", "1")
    one_line(r, "logits", "head", "NaN")


def test_a_nan_scale_names_the_layer_and_tensor(ckpt, tmp_path):
    c = copy(ckpt, tmp_path)
    e = Catalog.open(c).entries["layers.2.attn.wq_a.scale"]
    with open(e.path, "r+b") as f:
        f.seek(e.offset)
        f.write(b"\xff")  # E8M0 0xFF is NaN
    r = dsv4("run", str(c), "--prompt-ids", "1,2,3", "--gen", "3", "--budget", "1")
    one_line(r, "layer 2", "layers.2.attn.wq_a.scale")


@pytest.mark.parametrize("field, value", [("rms_norm_eps", "NaN"), ("routed_scaling_factor", "Infinity"),
                                          ("rope_theta", "0")])  # fmt: skip
def test_non_finite_config_values_are_one_line(ckpt, tmp_path, field, value):
    c = copy(ckpt, tmp_path)
    d = json.loads((c / "config.json").read_text())
    d[field] = "@"
    (c / "config.json").write_text(json.dumps(d).replace('"@"', value))
    r = dsv4("run", str(c), "--prompt-ids", "1,2,3", "--gen", "3", "--budget", "1")
    one_line(r, field)


# ---- ids as they come, stats on every exit, EOS stops ---------------------------------


def test_ids_and_stats_survive_a_mid_run_error(ckpt, tmp_path, monkeypatch):
    stats = tmp_path / "s.json"
    real = Runtime.generate

    def failing(self, *a, **k):
        for n, t in enumerate(real(self, *a, **k)):
            yield t
            if n == 1:
                raise ReadError("layer 3 expert 5: read failed: injected")

    monkeypatch.setattr(Runtime, "generate", failing)
    res = CliRunner().invoke(run_cmd, [str(ckpt), "--prompt-ids", "1,2,3", "--gen", "8", "--budget", "1",
                                       "--stats-json", str(stats)])  # fmt: skip
    assert isinstance(res.exception, ReadError)
    want = greedy(ckpt, [1, 2, 3], 2)
    assert res.stdout.strip() == ",".join(map(str, want))
    s = json.loads(stats.read_text())
    assert s["exit"]["status"] == "error" and "injected" in s["exit"]["message"]
    assert s["generated_ids"] == want


def test_stats_are_written_when_a_second_ctrl_c_ends_the_run(ckpt, tmp_path, monkeypatch):
    stats = tmp_path / "s.json"
    real = Runtime.generate

    def interrupted(self, *a, **k):
        for t in real(self, *a, **k):
            yield t
            raise KeyboardInterrupt  # what a second Ctrl-C raises inside a forward pass

    monkeypatch.setattr(Runtime, "generate", interrupted)
    res = CliRunner().invoke(run_cmd, [str(ckpt), "--prompt-ids", "1,2,3", "--gen", "8", "--budget", "1",
                                       "--stats-json", str(stats)])  # fmt: skip
    assert res.exit_code != 0
    s = json.loads(stats.read_text())
    assert s["exit"]["status"] == "interrupted" and s["generated_ids"] == greedy(ckpt, [1, 2, 3], 1)
    assert res.stdout.strip() == str(s["generated_ids"][0])


def test_stats_are_written_when_the_runtime_cannot_open(ckpt, tmp_path):
    stats = tmp_path / "s.json"
    r = dsv4("run", str(ckpt), "--prompt-ids", "1,2", "--budget", "0.001", "--stats-json", str(stats))
    msg = one_line(r, "--budget")
    s = json.loads(stats.read_text())
    assert s["exit"]["status"] == "error" and s["exit"]["message"] == msg.removeprefix("dsv4: ")


def test_prompt_ids_stop_at_eos(ckpt, tmp_path):
    c = copy(ckpt, tmp_path)
    free = greedy(c, [4, 5, 6], 8)
    at = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    d = json.loads((c / "config.json").read_text())
    d["eos_token_id"] = free[at]  # the model's own output id becomes EOS
    (c / "config.json").write_text(json.dumps(d))
    res = CliRunner().invoke(run_cmd, [str(c), "--prompt-ids", "4,5,6", "--gen", "8", "--budget", "1"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == ",".join(map(str, free[: at + 1]))


# ---- values the run cannot honour ------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["--budget", "inf"], ["--budget inf", "finite"]),
        (["--budget", "1e400"], ["--budget inf", "finite"]),
        (["--budget", "nan"], ["--budget nan"]),
        (["--budget", "100000"], ["physical memory"]),
        (["--seed", "-1", "--temperature", "1"], ["--seed -1"]),
        (["--ctx", "99999999"], ["--ctx 99999999", "max_position_embeddings"]),
        (["--ctx", "1000000", "--gen", "1"], ["--ctx 1000000", "GB of sequence state"]),
    ],
)
def test_odd_values_are_one_line(ckpt, args, words):
    budget = [] if "--budget" in args else ["--budget", "0.05"]
    r = dsv4("run", str(ckpt), "--prompt-ids", "1,2", *budget, *args)
    one_line(r, *words)


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ",1", "99999999999999999999999", "1;2", "1,-", ""])
def test_bad_id_lists_are_one_line(ckpt, ids):
    one_line(dsv4("run", str(ckpt), "--prompt-ids", ids, "--budget", "1"), "--prompt-ids")


def test_ids_with_spaces_are_fine(ckpt):
    r = CliRunner().invoke(run_cmd, [str(ckpt), "--prompt-ids", "1, 2  3", "--gen", "2", "--budget", "1"])
    assert r.exit_code == 0 and r.stdout.strip() == ",".join(map(str, greedy(ckpt, [1, 2, 3], 2)))


# ---- bytes that are not UTF-8 ----------------------------------------------------------


def test_non_utf8_prompts_are_one_line(tok_ckpt, tmp_path):
    bad = b"caf\xe9 \xff"
    one_line(dsv4_child("run", str(tok_ckpt), "--prompt", bad, "--budget", "1"), "UTF-8")
    one_line(dsv4("run", str(tok_ckpt), "--prompt-file", "-", "--budget", "1", stdin=bad), "UTF-8")
    (tmp_path / "p.txt").write_bytes(bad)
    one_line(dsv4("run", str(tok_ckpt), "--prompt-file", str(tmp_path / "p.txt"), "--budget", "1"), "UTF-8")
    for lang in ("C", "C.UTF-8"):  # a strict UTF-8 locale decodes stdin differently from the C locale
        env = dict(os.environ, LC_ALL=lang, PYTHONUTF8="0")
        one_line(dsv4_child("tokenize", "--tok", str(tok_ckpt), "-", stdin=bad, env=env), "UTF-8")
        one_line(dsv4_child("run", str(tok_ckpt), "--prompt-file", "-", "--budget", "1", stdin=bad, env=env), "UTF-8")
    one_line(dsv4_child("tokenize", "--tok", str(tok_ckpt), bad), "UTF-8")


@pytest.mark.parametrize("lang", ["C.UTF-8"])  # strict UTF-8 stdin; (LC_ALL=C cannot print the reply)
def test_a_non_utf8_chat_line_is_refused_and_the_chat_goes_on(tok_ckpt, tmp_path, lang):
    stats = tmp_path / "s.json"
    r = dsv4_child("run", str(tok_ckpt), "--chat", "--greedy", "--gen", "2", "--budget", "1", "--stats-json", str(stats),
             stdin=b"Hi\n\xff\xfe bad\nOk\n", env=dict(os.environ, LC_ALL=lang, PYTHONUTF8="0"))  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    assert b"not valid UTF-8" in r.stderr
    assert len(json.loads(stats.read_text())["turn_prompt_tokens"]) == 2  # Hi and Ok, not the bad line


# ---- OSErrors name the file and give advice that fits ---------------------------------


def test_an_io_error_reading_a_shard_names_it(ckpt, monkeypatch, capsys):
    import errno

    from dsv4stream.checkpoint import catalog
    from dsv4stream.cli import main

    real = os.preadv

    def eio(fd, bufs, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("model-00002-of-00005.safetensors"):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(catalog.os, "preadv", eio)
    with pytest.raises(SystemExit) as ex:
        main(["run", str(ckpt), "--prompt-ids", "1,2", "--gen", "2", "--budget", "1"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert ex.value.code == 2 and last.startswith("dsv4: ")
    assert "model-00002-of-00005.safetensors" in last and "Input/output error" in last


def test_os_errors_without_a_file_say_so_and_a_full_disk_is_not_a_permission_problem():
    import errno

    from dsv4stream.cli import os_error_line

    line = os_error_line(OSError(errno.ENOSPC, "No space left on device"))
    assert "free space" in line and "permission" not in line and ":  " not in line and "did not say which file" in line
    line = os_error_line(OSError(errno.EIO, "Input/output error", "/x/trunk.bin"))
    assert line.startswith("/x/trunk.bin: Input/output error") and "did not say" not in line


# ---- a cold numba cache is compiled outside the budgeted process -------------------------


def test_a_cold_kernel_cache_is_compiled_in_a_child_process(monkeypatch):
    """The compile children run apart from this process (tests/test_compile_forms.py runs real
    ones against an empty cache); a warm cache starts none."""
    from dsv4stream.run import compile as kcompile

    said: list[str] = []
    started: list[list[str]] = []
    monkeypatch.setattr(kcompile.warm, "missing_forms", lambda forms=None: ("bf16",))  # as on a fresh installation

    def run_children(bins, count):
        started.extend(bins)
        for _ in (u for b in bins for u in b):
            count()
        return []

    monkeypatch.setattr(kcompile, "_run_children", run_children)
    monkeypatch.setattr(kcompile.warm, "mark_cache_complete", lambda forms=None: None)
    got = kcompile.compile_kernels_apart(("bf16",), said.append)
    assert got is not None and got[0] == len(kcompile.warm.units(["bf16"])) and started
    assert "separate process" in said[0] and "outside --budget" in said[0]
    monkeypatch.setattr(kcompile.warm, "missing_forms", lambda forms=None: ())
    assert kcompile.compile_kernels_apart(("bf16",), said.append) is None and len(said) == 2


def test_the_cache_check_follows_numba_cache_dir_and_wants_a_finished_warmup(tmp_path, monkeypatch):
    from dsv4stream.kernels import jit, warm

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert not warm.compiled_cache_exists()
    (tmp_path / "work" / "x").mkdir(parents=True)
    (tmp_path / "work" / "x" / "fast._plain_mv-361.py311.nbi").write_bytes(b"")
    assert not warm.compiled_cache_exists()  # index files alone may be an older source's
    warm.mark_cache_complete()
    assert warm.compiled_cache_exists()
    monkeypatch.setattr(jit, "cache_stamp", lambda source=None: "0" * 16)
    assert not warm.compiled_cache_exists()  # the kernels' source changed: compile apart again


def test_the_cache_stamp_changes_with_the_kernel_source_and_the_cpu(monkeypatch):
    from dsv4stream.kernels import jit

    here = jit.cache_stamp()
    assert here == jit.cache_stamp() and len(here) == 16
    assert jit.cache_stamp(b"def k(): pass") != here
    monkeypatch.setenv("NUMBA_CPU_NAME", "generic")  # numba then compiles for another target
    assert jit.cache_stamp() != here


def _kernel_signatures() -> dict[str, set]:
    """Every compiled signature of every numba kernel, by kernel name."""
    from dsv4stream.kernels import fast

    return {v.py_func.__name__: set(v.signatures) for v in vars(fast).values() if hasattr(v, "py_func")}


def _grown_since(before: dict[str, set]) -> dict[str, set]:
    """Kernel name -> the signatures compiled since `before` (only those that grew)."""
    return {k: v - before[k] for k, v in _kernel_signatures().items() if v - before[k]}


def test_a_run_after_warmup_compiles_nothing_new(ckpt):
    """Every signature a run reaches is one warmup compiles (so a warm cache, or the child that
    filled a cold one, leaves nothing for numba to compile inside the budgeted process)."""
    from dsv4stream import kernels
    from dsv4stream.run.runtime import Runtime

    if kernels.backend_name() != "fast":
        pytest.skip("numba is not installed: the reference kernels compile nothing")
    kernels.warmup()
    before = _kernel_signatures()
    with Runtime.open(ckpt, RunOptions(budget=int(3e9))) as rt:
        got = list(rt.generate(rt.session(), list(range(5, 75)), 6))  # a long prefill, then decode
    assert len(got) == 6
    grown = _grown_since(before)
    assert not grown, grown


def test_grouped_products_of_every_kind_compile_nothing_after_warmup():
    """The grouped output projection joins its row blocks into one weight; at V4-Flash's sizes
    that weight is FP8, which the tiny checkpoints never reach."""
    from dsv4stream import kernels
    from dsv4stream.kernels import QWeight

    if kernels.backend_name() != "fast":
        pytest.skip("numba is not installed: the reference kernels compile nothing")
    kernels.warmup()
    before = _kernel_signatures()
    rng = np.random.default_rng(5)
    g, rows, cols = 2, 128, 256
    whole = {
        "fp8": (rng.integers(0, 126, (g * rows, cols), dtype=np.uint8), np.full((g * rows // 128, 2), 127, np.uint8)),
        "fp4": (
            rng.integers(0, 256, (g * rows, cols // 2), dtype=np.uint8),
            np.full((g * rows, cols // 32), 127, np.uint8),
        ),
        "bf16": (rng.integers(0, 1 << 14, (g * rows, cols), dtype=np.uint16), None),
        "f32": (rng.standard_normal((g * rows, cols)).astype(np.float32), None),
    }
    x = rng.standard_normal((1, g, cols)).astype(np.float32)
    for kind, (data, scale) in whole.items():
        srows = rows // 128 if kind == "fp8" else rows
        ws = [
            QWeight(
                kind,
                data[i * rows : (i + 1) * rows],
                None if scale is None else scale[i * srows : (i + 1) * srows],
                rows,
                cols,
            )
            for i in range(g)
        ]
        y = kernels.matmul_grouped(ws, x)
        assert np.array_equal(y[0], np.concatenate([kernels.matvec(w, x[0, i]) for i, w in enumerate(ws)]))
    grown = _grown_since(before)
    assert not grown, grown


def test_a_budget_too_small_for_the_ctx_state_names_both(ckpt):
    from dsv4stream.checkpoint.config import ModelConfig
    from dsv4stream.run.planner import state_bytes_for

    cfg = ModelConfig.from_json(ckpt / "config.json")
    floor = minimum_budget(measure(ckpt, RunOptions(budget=1)))
    ctx = 200_000  # its state pushes the minimum past a budget that fits the default --ctx
    assert state_bytes_for(cfg, ctx) < floor
    r = dsv4("run", str(ckpt), "--prompt-ids", "1,2", "--ctx", str(ctx), "--budget", f"{floor / 1e9 * 1.05:.6f}")
    one_line(r, "state for --ctx", "lower --ctx")
