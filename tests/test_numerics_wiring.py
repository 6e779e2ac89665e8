"""`--numerics` through the product: the option reaches the kernels (exact keeps today's bits,
fast differs within bounds), V4.1's grids follow it, the report shows it, and on the oracle
fixtures `fast` is at least as close to the float32 reference as `official` (V4 and V4.1,
prefill and step), here and with the AVX2 variants (`NUMBA_CPU_NAME=haswell`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numerics_deviation as nd
import numpy as np
import pytest
from cli_runs import stats_of

from dsv4stream import kernels
from dsv4stream.engine.session import Engine
from dsv4stream.engine.stack_v41 import V41Options
from dsv4stream.errors import UsageError

MIXED = nd.FIXTURES / "mixed"
V41 = nd.FIXTURES / "v41" / nd.V41_NAMES[0]


@pytest.fixture(autouse=True)
def _exact_after():
    yield
    kernels.set_numerics("exact")  # the other tests' process numerics


def logits(path: Path, **kw) -> np.ndarray:
    ids = nd._oracle(path)["token_ids"][:32]
    return Engine.open(path, **kw).session().prefill(ids)


def test_each_mode_reaches_the_kernels_and_exact_keeps_the_bits():
    base = logits(MIXED)  # no mode: V4's default, exact
    assert kernels.get_numerics() == "exact"
    for name in ("exact", "fp32"):
        eng = Engine.open(MIXED, numerics=name)
        assert eng.numerics == "exact" and kernels.get_numerics() == "exact"
        np.testing.assert_array_equal(eng.session().prefill(nd._oracle(MIXED)["token_ids"][:32]), base)
    for name in ("official", "fast"):
        got = logits(MIXED, numerics=name)
        assert kernels.get_numerics() == name
        err = np.abs(got - base).max(axis=1) / np.abs(base).max(axis=1)
        # official's E4M3 per 128 moves these random-weight logits by ~15% (median), fast by ~0.3%
        assert 0 < np.median(err) < (0.3 if name == "official" else 0.02), (name, np.median(err))
    with pytest.raises(UsageError, match="--numerics"):
        Engine.open(MIXED, numerics="bf16")


def test_v41_modes_set_the_grid_and_the_kernels():
    cases = {"official": ("exact", True), "exact": ("exact", False), "fp32": ("exact", False), "fast": ("fast", False)}
    for name, (kernel_mode, grid) in cases.items():
        eng = Engine.open(V41, numerics=name)
        assert kernels.get_numerics() == kernel_mode and eng.stack.options.grid.quantise is grid, name
    Engine.open(V41)  # no mode: official, as `dsv4 logits` has always run V4.1
    assert kernels.get_numerics() == "exact"
    # V41Options' numerics is used when Engine gets none, and Engine's wins over it
    assert Engine.open(V41, v41=V41Options("fp32")).numerics == "exact"
    assert Engine.open(V41, v41=V41Options("fp32"), numerics="fast").numerics == "fast"


def test_run_reports_the_numerics_and_exact_gives_todays_ids(tmp_path):
    args = (str(MIXED), "--prompt-ids", "1,2,3,4,5", "--gen", "6")
    exact, _ = stats_of(tmp_path, *args, "--numerics", "exact")
    fast, _ = stats_of(tmp_path, *args)  # the default
    assert exact["numerics"] == "exact" and fast["numerics"].startswith("fast (")
    s = Engine.open(MIXED).session()
    want, tok = [], int(np.argmax(s.prefill(np.array([1, 2, 3, 4, 5]))[-1]))
    for _ in range(6):
        want.append(tok)
        tok = int(np.argmax(s.step(tok)))
    assert exact["generated_ids"] == want


QUICK = ("mixed", "clamp")  # one V4 and one V4.1 fixture in `make test`; every one in the slow tests


def check_fast_within_official(dev: dict) -> None:
    """fast's median error <= official's and its argmax agreement >= official's, every case."""
    bad = {k: v for k, v in dev.items() if v["fast"][0] > v["official"][0] or v["fast"][1] < v["official"][1]}
    assert not bad, bad


def test_fast_is_as_close_to_the_float32_reference_as_official_on_two_fixtures():
    dev = nd.deviations(("official", "fast"), QUICK)
    assert len(dev) == 4  # V4 and V4.1, prefill and step
    check_fast_within_official(dev)


@pytest.mark.slow
def test_fast_is_as_close_to_the_float32_reference_as_official_on_every_fixture():
    check_fast_within_official(nd.deviations(("official", "fast")))


@pytest.mark.slow
def test_fast_is_as_close_as_official_with_the_avx2_variants():
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    code = "import json, numerics_deviation as nd; from dsv4stream.engine.numerics import label; " \
        "print(label('fast')); print(json.dumps(nd.deviations(('official', 'fast'))))"  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    variant, doc = r.stdout.strip().splitlines()[-2:]
    assert variant == "fast (avx2: fma)", variant
    check_fast_within_official(json.loads(doc))


def test_a_session_keeps_its_engines_numerics_when_another_engine_changed_the_process():
    ids = nd._oracle(MIXED)["token_ids"][:16]
    fast = Engine.open(MIXED, numerics="fast")
    want = fast.session().prefill(ids)
    Engine.open(MIXED)  # exact, for the whole process
    assert kernels.get_numerics() == "exact"
    np.testing.assert_array_equal(fast.session().prefill(ids), want)
    assert kernels.get_numerics() == "fast"
