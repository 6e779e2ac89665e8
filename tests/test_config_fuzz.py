"""Random mutations of a valid config.json (V4 and V4.1) either run or are refused with one
`dsv4:` line, within seconds: never a traceback, never a hang, never unbounded memory.

Each mutant replaces the config.json of a generated checkpoint (its shards linked, not copied)
and goes through the real command in-process: `dsv4 run` on V4 (a greedy token from a prompt
of ids), `dsv4 inspect --budget` on V4.1 (validation and the plan; its forward pass is another
module's). A mutant whose parsed config equals the original's (a training-only or runtime flag
changed, a key reordered) must generate exactly the original's ids: a field that is accepted
either changes the model or provably does not.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4stream.checkpoint.config import ModelConfig
from dsv4stream.cli import main
from dsv4stream.errors import Dsv4Error
from dsv4stream.synth import make_checkpoint

EDGE_NUMBERS = [0, -1, 1, 2, 3, 32, 10**9, 2**31, 2**63 - 1, -(2**63), 1e300, -1e300, 1e-300, 0.5, 1e-20, 4096]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGE_NUMBERS),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["deepseek_v4", "deepseek_v41", "yarn", "fp8", "ue8m0", "fp4", "silu", "noaux_tc"]),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def _paths(doc, prefix=()):
    """Every (path) to a value in the document: dict keys and list indices."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


def _parent(doc, path):
    for k in path[:-1]:
        doc = doc[k]
    return doc


@st.composite
def mutants(draw, base: dict) -> dict:
    doc = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        op = draw(st.sampled_from(["set", "set", "set", "delete", "add", "nudge", "resize"]))
        path = draw(st.sampled_from(paths))
        parent, key = _parent(doc, path), path[-1]
        if op == "set":
            parent[key] = draw(JSON_VALUES)
        elif op == "delete":
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["extra", "num_hash_layers", "text_config", "vision_config", key]))] = draw(
                JSON_VALUES
            )
        elif op == "nudge" and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
            v = parent[key]
            parent[key] = draw(st.sampled_from([v + 1, v - 1, v * 2, -v, v // 2 if isinstance(v, int) else v / 2]))
        elif op == "resize" and isinstance(parent[key], list):
            lst = parent[key]
            parent[key] = lst[: draw(st.integers(0, len(lst)))] if draw(st.booleans()) else lst + lst[:3]
    return doc


def _linked_checkpoint(src: Path, dst: Path, config: dict) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            os.symlink(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(config, allow_nan=True))
    return dst


def _invoke(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


def _same_config(a: dict, b: dict) -> bool:
    try:
        return ModelConfig.from_dict(a) == ModelConfig.from_dict(b)
    except Dsv4Error:
        return False


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fuzz") / "v4", "tiny", seed=3)


@pytest.fixture(scope="module")
def v41_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fuzz") / "v41", "tiny-v41", seed=3)


RUN = ["--prompt-ids", "1,2,3", "--gen", "2", "--greedy", "--budget", "1"]
FUZZ = settings(
    max_examples=int(os.environ.get("DSV4_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SECONDS = 60  # per mutant, on a loaded 2-core machine; a hang or a runaway loop takes far longer


def _check(rc: int, out: str, err: str, seconds: float, listing: bool = False) -> None:
    assert seconds < SECONDS, f"took {seconds:.1f} s"
    assert rc in (0, 2), f"exit {rc}: {err[-2000:]}"
    if rc == 2:
        lines = [line for line in err.splitlines() if line.strip()]  # not err.strip(): it eats the indent
        if listing:  # `inspect` lists each tensor problem it found before its one `dsv4:` line
            lines = [line for line in lines if not line.startswith("  problem: ")]
        assert len(lines) == 1 and lines[0].startswith("dsv4: "), err[-2000:]


def test_v4_config_mutants_run_or_are_refused_in_one_line(v4_ckpt, tmp_path_factory, capsys):
    base = json.loads((v4_ckpt / "config.json").read_text())
    rc, expected, err = _invoke(["run", str(v4_ckpt), *RUN], capsys)
    assert rc == 0, err

    @FUZZ
    @given(doc=mutants(base))
    def check(doc):
        ck = _linked_checkpoint(v4_ckpt, tmp_path_factory.mktemp("m") / "ck", doc)
        t0 = time.perf_counter()
        rc, out, err = _invoke(["run", str(ck), *RUN], capsys)
        _check(rc, out, err, time.perf_counter() - t0)
        if _same_config(doc, base):
            assert rc == 0 and out == expected, "an accepted field that does not change the model changed the ids"

    check()


def test_v41_config_mutants_validate_or_are_refused_in_one_line(v41_ckpt, tmp_path_factory, capsys):
    base = json.loads((v41_ckpt / "config.json").read_text())
    rc, _, err = _invoke(["inspect", str(v41_ckpt), "--budget", "1"], capsys)
    assert rc == 0, err

    @FUZZ
    @given(doc=mutants(base))
    def check(doc):
        ck = _linked_checkpoint(v41_ckpt, tmp_path_factory.mktemp("m") / "ck", doc)
        t0 = time.perf_counter()
        rc, out, err = _invoke(["inspect", str(ck), "--budget", "1"], capsys)
        _check(rc, out, err, time.perf_counter() - t0, listing=True)

    check()


@pytest.mark.parametrize(
    "edit",
    [
        {"hc_sinkhorn_iters": 10**9},
        {"n_routed_experts": 10**9},
        {"n_routed_experts": 4096},
        {"num_hidden_layers": 512, "compress_ratios": [0] * 513},
        {"vocab_size": 2**20},
    ],
)
def test_runaway_counts_are_one_line_in_seconds(v4_ckpt, tmp_path, capsys, edit):
    doc = {**json.loads((v4_ckpt / "config.json").read_text()), **edit}
    ck = _linked_checkpoint(v4_ckpt, tmp_path / "ck", doc)
    t0 = time.perf_counter()
    rc, _, err = _invoke(["run", str(ck), *RUN], capsys)
    seconds = time.perf_counter() - t0
    assert rc == 2 and err.startswith("dsv4: ") and len(err.strip().splitlines()) == 1, err
    assert seconds < 20, seconds
    assert not math.isnan(seconds)
