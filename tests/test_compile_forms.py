"""Compiling only what a checkpoint needs, in parallel children (run/compile.py, kernels/warm.py).

The forms a checkpoint's weights reach (V4 as released, V4.1, float32 scales), the split of the
units among children (each numba function in one child), a fresh process that runs a checkpoint
after warming only its forms (it must compile nothing), children that leave a complete cache
and show `compiling kernels: N of M`, a failing child's one-line error, and a changed shared
helper (jit.py) that makes a fresh process compile the kernels again.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from dsv4stream import kernels, synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.errors import Dsv4Error
from dsv4stream.kernels import warm
from dsv4stream.run import compile as kcompile
from dsv4stream.run import ticker

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(kernels.backend_name() != "fast", reason="numba is not installed")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tiny_v41):
    d = tmp_path_factory.mktemp("forms")
    return {
        "v4": synth.make_checkpoint(d / "v4", preset="tiny", seed=2),
        "v4-float-scales": synth.make_checkpoint(d / "f32", preset="tiny", seed=2, scale_fmt="float"),
        "v41": tiny_v41,
        # experts 256 wide both ways: the width the FP4 x int8 kernel takes (tiny's 64 and 32 are not)
        "v4-256": synth.make_checkpoint(d / "w256", preset="tiny", seed=2, hidden_size=256, moe_intermediate_size=256),
    }


def test_each_checkpoint_kind_needs_its_own_forms(ckpts):
    forms = {k: kcompile.checkpoint_forms(Catalog.open(p)) for k, p in ckpts.items()}
    assert forms["v4"] == ("base", "fp4/e8m0", "fp8/e8m0", "bf16", "f32")
    assert forms["v4-float-scales"] == ("base", "fp4/f32", "fp8/f32", "bf16", "f32")
    assert "fp8-32/e8m0" in forms["v41"] and "fp8/e8m0" not in forms["v41"] and "fp8/f32" not in forms["v41"]
    assert warm.form_of("fp8", 4, (32, 32)) == "fp8/f32"  # float32 scales keep the generic kernels


def test_the_split_keeps_each_function_in_one_child_and_balances_by_cost():
    units = warm.units(warm.FORMS)
    assert len(units) == len(set(units)) and all(u in warm.COST for u in units)
    bins = kcompile.split(units, 2)
    assert len(bins) == 2 and sorted(u for b in bins for u in b) == sorted(units)
    owner = {}
    for i, b in enumerate(bins):
        for u in b:
            assert owner.setdefault(warm.function_of(u), i) == i  # two signatures of one function: one child
    loads = [sum(map(warm.cost, b)) for b in bins]
    biggest = max(sum(warm.cost(u) for u in units if warm.function_of(u) == f) for f in owner)
    assert max(loads) - min(loads) <= biggest
    assert kcompile.split(units[:1], 8) == [units[:1]]
    assert kcompile.estimate_seconds(bins) == pytest.approx(max(loads) + warm.START_SECONDS)


_RUN_AFTER_FORMS = r"""
import json, sys
from dsv4stream import kernels
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.kernels import attn, fp4, fp8, plain, qdq, sinkhorn
from dsv4stream.run.compile import checkpoint_forms
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime

def sigs():
    return {f"{m.__name__}.{k}": set(v.signatures) for m in (fp4, fp8, plain, attn, qdq, sinkhorn)
            for k, v in vars(m).items() if hasattr(v, "py_func")}

kernels.warmup(checkpoint_forms(Catalog.open(sys.argv[1])))
before = sigs()
with Runtime.open(sys.argv[1], RunOptions(budget=int(3e9))) as rt:
    got = list(rt.generate(rt.session(), list(range(5, 75)), 4))  # a long prefill, then decode
grown = {k: sorted(map(str, v - before[k])) for k, v in sigs().items() if v - before[k]}
print(json.dumps({"tokens": len(got), "grown": grown}))
"""


@pytest.mark.parametrize("kind", ["v4", "v4-float-scales", "v41"])
def test_a_fresh_process_warming_only_its_forms_compiles_nothing_in_the_run(ckpts, kind):
    """What the budgeted process does after the children: load its forms, then run. Any signature
    the run still reaches would be compiled inside --budget."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", _RUN_AFTER_FORMS, str(ckpts[kind])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens"] == 4 and out["grown"] == {}


_LOADS = r"""
import sys
from dsv4stream.kernels import attn, fp4, fp8, plain, qdq, sinkhorn, warm
for u in sys.argv[1:]:
    warm.warm_unit(u)
print(sum(d.stats.cache_misses.get(s, 0) for m in (fp4, fp8, plain, attn, qdq, sinkhorn) for d in vars(m).values()
          if hasattr(d, "py_func") for s in d.stats.cache_misses))
"""


def test_children_leave_a_complete_cache_and_count_the_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))  # a fresh installation
    said: list[str] = []
    shown = io.StringIO()
    monkeypatch.setattr(kcompile.ticker, "elapsed", partial(ticker.elapsed, file=shown, tick=0.01, enabled=True))
    assert warm.missing_forms(["bf16"]) == ("bf16",)
    n, took = kcompile.compile_kernels_apart(("bf16",), said.append, children=2)
    units = warm.units(["bf16"])
    assert n == len(units) and took > 0
    assert f"compiling kernels: {n} of {n}" in shown.getvalue() and "compiling kernels: 0 of" in shown.getvalue()
    assert f"compiling {n} numba kernels" in said[0] and "in 2 separate processes" in said[0]
    assert said[-1].startswith(f"compiled {n} kernels in ")
    assert warm.missing_forms(["bf16"]) == () and warm.missing_forms(["fp4/e8m0"]) == ("fp4/e8m0",)
    assert kcompile.compile_kernels_apart(("bf16",), said.append) is None  # marked: nothing to do
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", _LOADS, *units], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "0"  # every signature loaded from the children's cache


def test_a_failing_child_gives_one_line_and_marks_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(warm, "units", lambda forms: ["_no_such_kernel:bf16"])
    with pytest.raises(Dsv4Error) as ex:
        kcompile.compile_kernels_apart(("bf16",))
    msg = str(ex.value)
    assert "\n" not in msg and "compiling the numba kernels failed in a child process" in msg and "KeyError" in msg
    assert warm.missing_forms(["bf16"]) == ("bf16",)


_PLAIN_PRODUCT = r"""
import json
import numpy as np
from dsv4stream.kernels import QWeight, attn, fast, fp4, fp8, jit, plain, qdq, sinkhorn
# 3 rows, fewer than a pass of `plain.MV_ROWS`: row by row through `plain._plain_row` and `jit._fma`
w = QWeight("f32", np.full((3, 32), 0.5, np.float32), None, 3, 32)
y = fast.matvec(w, np.ones(32, np.float32))  # below the parallel floor: `plain._plain_mv_serial`
stats = fast._plain_mv_serial.stats
every = {d.stats.cache_path for m in (fp4, fp8, plain, attn, qdq, sinkhorn) for d in vars(m).values()
         if hasattr(d, "py_func")}
print(json.dumps({"y": float(y[0]), "dir": str(jit.cache_dir()), "cached_in": stats.cache_path,
                  "every_kernel_in": sorted(every),
                  "hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values())}))
"""
_FMA = "return builder.call(fn, args)"  # `jit._fma`'s codegen


def test_a_changed_shared_helper_recompiles_every_kernel_that_inlines_it(tmp_path):
    """numba checks only the file a cached function is defined in, and the kernels inline helpers
    from jit.py: a fresh process whose jit.py changed must not load plain.py's old machine code.
    Here `_fma` is made to double its result in a copy of the package: a float32 matvec's lanes,
    one FMA each, then sum to twice the old value, and only if the kernel was compiled again."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "dsv4stream", src / "dsv4stream", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(src), NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    def run() -> dict:
        cmd = [sys.executable, "-c", _PLAIN_PRODUCT]
        # cwd: `-c` puts it first on sys.path, and the checkout's own package must not shadow the copy
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = run()
    assert first["y"] == 16.0 and first["misses"] == 1
    assert run() == {**first, "hits": 1, "misses": 0}  # the same sources: loaded from the cache
    jit_py = src / "dsv4stream" / "kernels" / "jit.py"
    text = jit_py.read_text()
    assert text.count(_FMA) == 1
    jit_py.write_text(text.replace(_FMA, "return builder.fmul(builder.call(fn, args), ir.Constant(_F32, 2.0))"))
    changed = run()
    assert changed["y"] == 32.0  # compiled again with the new helper (the old cache gave 16.0)
    assert changed["hits"] == 0 and changed["misses"] == 1
    # how: one folder per stamp of every kernel source, under NUMBA_CACHE_DIR, where numba caches
    assert changed["dir"] != first["dir"]
    for got in (first, changed):
        assert got["cached_in"] == got["dir"] and Path(got["dir"]).parent == tmp_path / "cache"
        assert got["every_kernel_in"] == [got["dir"]]  # every kernel of the package: one folder


def test_a_fast_run_adds_the_fast_kernels_its_weights_widths_reach_and_an_exact_run_none(ckpts, monkeypatch):
    from dsv4stream.kernels import cpu

    v4 = Catalog.open(ckpts["v4"])
    exact = kcompile.checkpoint_forms(v4)
    assert kcompile.checkpoint_forms(v4, "official") == exact and not any(f.startswith("fast-") for f in exact)
    fast = kcompile.checkpoint_forms(v4, "fast")
    assert set(exact) <= set(fast) and fast == tuple(f for f in warm.FORMS if f in fast)
    if all(cpu.variant(k) for k in ("fp4", "fp8", "bf16")):
        # tiny's FP4 experts are 64 and 32 wide: the FP4 x int8 kernel takes multiples of 256 only
        # and its BF16 head (64 wide) reaches the int8 head copy's kernel
        assert set(fast) - set(exact) == {"fast-fp8/e8m0", "fast-bf16", "fast-head-q8"}
        wide = kcompile.checkpoint_forms(Catalog.open(ckpts["v4-256"]), "fast")
        assert set(wide) - set(exact) == {"fast-fp4/e8m0", "fast-fp8/e8m0", "fast-bf16", "fast-head-q8"}
        floats = kcompile.checkpoint_forms(Catalog.open(ckpts["v4-float-scales"]), "fast")
        assert "fast-fp8/f32" in floats and "fast-fp4/f32" not in floats
        v41 = kcompile.checkpoint_forms(Catalog.open(ckpts["v41"]), "fast")
        assert "fast-fp8/e8m0" in v41  # its 32x32 blocks: the same driver, the block an argument
        units = warm.units(set(wide) - set(exact))
        assert units and all(u in warm.COST for u in units)
        assert warm.fast_form_of("fp4", 1, 4096) == "fast-fp4/e8m0" and warm.fast_form_of("fp4", 1, 4000) is None
        assert warm.fast_form_of("fp8", 4, 64) == "fast-fp8/f32" and warm.fast_form_of("f32", None, 64) is None
    monkeypatch.setattr(cpu, "variant", lambda kind: None)  # a target without AVX2: exact kernels only
    assert kcompile.checkpoint_forms(v4, "fast") == exact


_FAST_RUN = r"""
import json, sys
from dsv4stream.kernels import attn, bf16, fp4, fp8, plain, q8, qdq, sinkhorn
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime

def fast_kernels():
    ds = {f"q8.{v}": d for v, d in q8._DRIVERS.items()} | {f"bf16.{k}.{v}": d for (k, v), d in bf16._DRIVERS.items()}
    return ds | {"q8._quantize": q8._quantize, "bf16._round_rows": bf16._round_rows}

def exact_kernels():
    return {f"{m.__name__}.{k}": v for m in (fp4, fp8, plain, attn, qdq, sinkhorn)
            for k, v in vars(m).items() if hasattr(v, "py_func")}

def sigs(kernels):
    return {k: sorted(map(str, d.signatures)) for k, d in kernels.items()}

out = {}
for mode in ("exact", "fast"):
    with Runtime.open(sys.argv[1], RunOptions(budget=int(3e9), numerics=mode)) as rt:
        ready, ready_exact = sigs(fast_kernels()), sigs(exact_kernels())
        got = list(rt.generate(rt.session(), list(range(5, 75)), 4))  # a long prefill, then decode
    grown = {k: v for k, v in sigs(fast_kernels()).items() if v != ready.get(k)}
    grown |= {k: v for k, v in sigs(exact_kernels()).items() if v != ready_exact.get(k)}
    out[mode] = {"tokens": len(got), "ready": ready, "grown": grown}
out["misses"] = {k: sum(d.stats.cache_misses.values()) for k, d in fast_kernels().items()}
print(json.dumps(out))
"""


@pytest.mark.parametrize("kind", ["v4-256", "v4"])
def test_a_fast_run_loads_its_fast_kernels_compiled_apart_and_an_exact_run_compiles_none(ckpts, kind):
    """Runtime.open warms the forms of its numerics (children compile what the cache lacks): an
    exact run must not touch the fast kernels, a fast run must have loaded every kernel its first
    tokens use, fast or exact, from the cache before them (nothing compiled in this process: no
    new signature, no cache miss). v4-256's experts are as wide as the FP4 x int8 kernel takes,
    tiny's are not (its FP4 products stay exact, and the FP4 driver is never built)."""
    from dsv4stream.kernels import cpu

    if not all(cpu.variant(k) for k in ("fp4", "fp8", "bf16")):
        pytest.skip("this CPU target has no fast kernel for every kind")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", _FAST_RUN, str(ckpts[kind])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["exact"] == {"tokens": 4, "ready": {"q8._quantize": [], "bf16._round_rows": []}, "grown": {}}
    fast = out["fast"]
    assert fast["tokens"] == 4 and fast["grown"] == {}
    v = cpu.variant
    # bf16.fp8pair: the shared expert's w1 / w3 in one region (warmed with the FP8 form)
    used = {f"bf16.fp8.{v('fp8')}", f"bf16.fp8pair.{v('fp8')}", f"bf16.bf16.{v('bf16')}", "bf16._round_rows"}
    if kind == "v4-256":
        used |= {f"q8.{v('fp4')}", "q8._quantize"}
    assert {k for k, sig in fast["ready"].items() if sig} == used  # warmed before the first token
    assert out["misses"] and set(out["misses"].values()) == {0}  # loaded, never compiled, in the run


@pytest.mark.parametrize(
    ("kind", "numerics", "mode"), [("v4", None, "exact"), ("v4-256", "fast", "fast"), ("v41", None, "exact")]
)
def test_logits_compiles_its_forms_apart_before_the_engine_opens(ckpts, kind, numerics, mode, monkeypatch, tmp_path):
    """`dsv4 logits` opens an Engine, not a Runtime: it must still compile its checkpoint's forms
    in children (the cold cache's progress line) and load them before its pass. numerics None:
    the family's default (V4 exact; V4.1 official, whose kernels are exact)."""
    from click.testing import CliRunner

    from dsv4stream.cli import logits as logits_cli
    from dsv4stream.engine.session import Engine

    calls: list = []
    real_open = Engine.open

    def compile_apart(forms, say=None, children=None):
        calls.append(("apart", forms))

    def opened(*a, **kw):
        calls.append(("engine", None))
        return real_open(*a, **kw)

    monkeypatch.setattr(kcompile, "compile_kernels_apart", compile_apart)
    monkeypatch.setattr(kernels, "warmup", lambda forms=None: calls.append(("warmup", forms)) or 0.0)
    monkeypatch.setattr(logits_cli.Engine, "open", opened)
    args = [str(ckpts[kind]), "--tokens", "1,2,3", "--out", str(tmp_path / "l.npy")]
    res = CliRunner().invoke(logits_cli.logits, args + (["--numerics", numerics] if numerics else []))
    kernels.set_numerics("exact")
    assert res.exit_code == 0, res.output
    want = kcompile.checkpoint_forms(Catalog.open(ckpts[kind]), mode)
    assert calls == [("apart", want), ("warmup", want), ("engine", None)]
