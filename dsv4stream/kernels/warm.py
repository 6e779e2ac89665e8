"""Which numba kernels a checkpoint needs, compiling them one unit at a time, and the markers
that say a warm-up finished.

Owns: the weight forms the kernels are compiled for (`FORMS`: a weight kind with its scale
format, plus "base" for attention, the activation grid and Sinkhorn, which every model runs),
the units of compilation (one numba function at one form: `units`), what each costs to
compile (`COST`, for balancing parallel children and the estimate shown), `warm_unit` (the
call that makes numba compile or load exactly that unit), `warmup` (every unit of some forms),
the child process entry (`python -m dsv4stream.kernels.warm UNIT ...`) and the cache's
bookkeeping: a marker per form in the kernels' cache folder once its units are all in it
(`mark_cache_complete`, `missing_forms`, `compiled_cache_exists`). Does not own where that
folder is nor what its name is keyed on (`jit.cache_dir`, `jit.cache_stamp`: numba needs them
before the first kernel is defined), nor when and where children run (`run/compile.py`).

A checkpoint reaches only some forms: V4 as released has FP4 experts and FP8 128x128 blocks,
both with E8M0 scales, BF16 and float32 weights; V4.1 has FP8 with 32x32 E8M0 blocks instead;
float32 scales come from generated checkpoints. Compiling every form costs about twice what
one checkpoint needs (docs/kernels.md has the figures).

The `fast-*` forms are the fast-numerics drivers (`q8.py`, `bf16.py`) at this CPU's variant:
only runs whose numerics are fast need them, and only for weights whose widths the fast kernels
take (`fast_form_of`, `run/compile.checkpoint_forms`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import numba
import numpy as np

from . import jit

# form -> (numba function, how the dispatch reaches it) for the fast backend's products. How:
# "par" / "serial" a matvec above / below the parallel floor,
# "pair" two weights times one token, "few" / "fewpair" one or two weights times 2 tokens (FP4's
# `_fp4_mvt`, FP8's `_fp8_mvt`: each weight decoded once for a few tokens), "mm" tokens in tiles.
_FP4 = (
    ("_fp4_mv", "par"),
    ("_fp4_mv_serial", "serial"),
    ("_fp4_mv2", "pair"),
    ("_fp4_mvt", "few"),
    ("_fp4_mvt2", "fewpair"),
    ("_fp4_mm", "mm"),
)
# FP8 with blocks a multiple of 32 wide (V4, V4.1); other widths compile the generic `_fp8_mv`
# family at first use (generated checkpoints only)
_FP8 = (
    ("_fp8_mvv", "par"),
    ("_fp8_mvv_serial", "serial"),
    ("_fp8_mv2v", "pair"),
    ("_fp8_mvt", "few"),
    ("_fp8_mvt2", "fewpair"),
    ("_fp8_mm", "mm"),
)
_PRODUCTS: dict[str, tuple[tuple[str, str], ...]] = {
    "fp4/e8m0": _FP4,
    "fp4/f32": _FP4,
    "fp8/e8m0": _FP8,
    "fp8/f32": _FP8,
    # V4.1's 32x32 blocks: the same kernels at the same signatures as fp8/e8m0 (compiled once for both)
    "fp8-32/e8m0": _FP8,
    "bf16": (("_plain_mv", "par"), ("_plain_mv_serial", "serial"), ("_plain_mm", "mm")),
    "f32": (("_plain_mv", "par"), ("_plain_mv_serial", "serial"), ("_plain_mm", "mm")),
}
# attention's kernels share a helper (`attn._attend_item`, `_index_item`), so they are one unit:
# two processes adding signatures to one function's cache index would lose one of them
_BASE = ("attn", "qdq", "sinkhorn", "trunkops")
# `--numerics fast` (kernels/numerics.py): one numba driver per weight kind and CPU variant
# (`q8._driver`, `bf16._driver`), the activation rounding it calls with it (`q8._quantize`,
# `bf16._round_rows`). A form names no variant: the variant follows the CPU target, and so does
# the cache folder (`jit.cache_stamp`). FP8's block is an argument of the driver, so V4's
# 128x128 and V4.1's 32x32 blocks share one form. Only runs whose numerics are fast reach them.
# FP4's routed experts also run `experts_q8`'s two drivers (gate and up; down and the weighted
# sum), which call the same row kernels, and a whole layer the two with the SwiGLU inside
# (`experts_q8.swiglu_sum`: "xq8fused").
_FAST: dict[str, tuple[str, ...]] = {
    "fast-fp4/e8m0": ("fp4q8", "xq8pair", "xq8down", "xq8fused"),
    "fast-fp4/f32": ("fp4q8", "xq8pair", "xq8down", "xq8fused"),
    "fast-fp8/e8m0": ("fp8bf16",),
    "fast-fp8/f32": ("fp8bf16",),
    "fast-bf16": ("bf16bf16",),
    "fast-head-q8": ("headq8",),  # the int8 head copy's driver (`headq8`, `head.head_logits`)
}
FORMS = ("base", *_PRODUCTS, *_FAST)

# CPU seconds to compile each unit: one process, empty NUMBA_CACHE_DIR, idle 2-core AMD EPYC
# (Zen 4, AVX-512), numba 0.63, 2026-12-04 (`bench/cold_compile.py --units` prints them again;
# 76.7 s for every form). The few-token kernels cost most: 4 rows x 3 tokens x 32 lanes of FMAs.
COST: dict[str, float] = {
    "attn:base": 7.50,
    "qdq:base": 0.52,
    "sinkhorn:base": 0.35,
    "trunkops:base": 5.0,  # 8.3 CPU-s measured at load 6 (Sapphire Rapids, 2026-12-06), not idle as the others
    "_fp4_mv:fp4/e8m0": 1.17,
    "_fp4_mv_serial:fp4/e8m0": 0.59,
    "_fp4_mv2:fp4/e8m0": 2.15,
    "_fp4_mvt:fp4/e8m0": 1.86,  # measured at 00:24, load 1.8, after the others
    "_fp4_mvt2:fp4/e8m0": 2.53,
    "_fp4_mm:fp4/e8m0": 6.88,
    "_fp4_mv:fp4/f32": 1.60,
    "_fp4_mv_serial:fp4/f32": 0.92,
    "_fp4_mv2:fp4/f32": 2.49,
    "_fp4_mvt:fp4/f32": 1.16,
    "_fp4_mvt2:fp4/f32": 2.39,
    "_fp4_mm:fp4/f32": 6.90,
    # the FP8 units measured again at 05:36 (main at 0635faa + the vector FP8 matvec, load 1.0),
    # times 1.20: the ratio of the old to the new figures of the 27 units in both runs (the machine
    # compiled faster at 05:36 than when the others were measured); V4.1's units are the same code
    # at the same signatures
    "_fp8_mvv:fp8/e8m0": 2.56,
    "_fp8_mvv_serial:fp8/e8m0": 1.08,
    "_fp8_mv2v:fp8/e8m0": 2.90,
    "_fp8_mvt:fp8/e8m0": 1.38,
    "_fp8_mvt2:fp8/e8m0": 2.05,
    "_fp8_mm:fp8/e8m0": 6.99,
    "_fp8_mvv:fp8/f32": 2.55,
    "_fp8_mvv_serial:fp8/f32": 1.23,
    "_fp8_mv2v:fp8/f32": 2.90,
    "_fp8_mvt:fp8/f32": 1.63,
    "_fp8_mvt2:fp8/f32": 2.37,
    "_fp8_mm:fp8/f32": 6.58,
    "_fp8_mvv:fp8-32/e8m0": 2.56,
    "_fp8_mvv_serial:fp8-32/e8m0": 1.08,
    "_fp8_mv2v:fp8-32/e8m0": 2.90,
    "_fp8_mvt:fp8-32/e8m0": 1.38,
    "_fp8_mvt2:fp8-32/e8m0": 2.05,
    "_fp8_mm:fp8-32/e8m0": 6.99,
    "_plain_mv:bf16": 0.75,
    "_plain_mv_serial:bf16": 0.37,
    "_plain_mm:bf16": 4.92,
    "_plain_mv:f32": 0.78,
    "_plain_mv_serial:f32": 0.26,
    "_plain_mm:f32": 4.06,
    # the fast-numerics drivers (avx512 variant) measured at 07:27 on 2026-12-06: one child, empty
    # NUMBA_CACHE_DIR, 2-vCPU Intel Emerald Rapids, load 1.3 (`_plain_mm:bf16` took 4.84 s there,
    # so the figures above hold for it); fp4's first figure less the child's kernel imports
    "fp4q8:fast-fp4/e8m0": 1.90,
    "fp4q8:fast-fp4/f32": 1.53,
    "fp8bf16:fast-fp8/e8m0": 2.59,
    "fp8bf16:fast-fp8/f32": 2.24,
    "bf16bf16:fast-bf16": 1.33,
    # the int8 head's driver: CPU seconds in children with an empty NUMBA_CACHE_DIR beside bf16bf16,
    # both orders twice (2026-12-06 15:14, Emerald Rapids, load 17): headq8 1.30 / 1.45 / 1.35 /
    # 1.81 s, bf16bf16 1.62 / 1.42 / 1.59 / 1.56 s, mean ratio 0.95, times bf16bf16's 1.33 above
    "headq8:fast-head-q8": 1.27,
    # experts_q8's drivers: CPU seconds in one child after fp4q8 (empty NUMBA_CACHE_DIR, Emerald
    # Rapids, 2026-12-06 12:13, load 17), divided by 1.29, the ratio of fp4q8's two figures in that
    # child (2.67, 1.82) to the ones above
    "xq8pair:fast-fp4/e8m0": 1.60,
    "xq8pair:fast-fp4/f32": 1.51,
    "xq8down:fast-fp4/e8m0": 1.82,
    "xq8down:fast-fp4/f32": 2.10,
    # swiglu_sum's two drivers: not measured cold; estimated as xq8pair's and xq8down's together
    "xq8fused:fast-fp4/e8m0": 3.42,
    "xq8fused:fast-fp4/f32": 3.61,
}
START_SECONDS = 0.5  # a child's python, numba and kernel imports (0.4-0.5 s wall, same machine)


def form_of(kind: str, scale_itemsize: int | None = None, block: tuple[int, int] = (128, 128)) -> str:
    """The form a weight of `kind` ("fp4", "fp8", "bf16", "f32") compiles for: E8M0 scales are one
    byte, anything else is multiplied as float32 (`fast._scale`)."""
    if kind in ("bf16", "f32"):
        return kind
    scale = "e8m0" if scale_itemsize == 1 else "f32"
    if kind == "fp8" and scale == "e8m0" and block[1] == 32:
        return "fp8-32/e8m0"
    if kind in ("fp4", "fp8"):
        return f"{kind}/{scale}"
    raise ValueError(f"unknown weight kind {kind!r}")


def fast_form_of(kind: str, scale_itemsize: int | None, cols: int) -> str | None:
    """The fast-numerics form a weight of `kind` and `cols` columns reaches on this CPU target, or
    None where its products run the exact kernels: float32 weights, a kind `cpu.variant` gives
    no fast kernel, or a width the fast kernel does not take (`q8.supports`, `bf16.supports`),
    the same tests `numerics.fast_variant` makes per call."""
    from . import bf16, cpu, q8

    if kind not in ("fp4", "fp8", "bf16") or cpu.variant(kind) is None:
        return None
    if not (q8.supports(cols) if kind == "fp4" else bf16.supports(cols)):
        return None
    if kind == "bf16":
        return "fast-bf16"
    return f"fast-{kind}/{'e8m0' if scale_itemsize == 1 else 'f32'}"


def units(forms: Iterable[str]) -> list[str]:
    """The units ("function:form") that the forms need, in a fixed order."""
    want = set(forms)
    bad = want - set(FORMS)
    if bad:
        raise ValueError(f"unknown kernel forms {sorted(bad)}")
    out = [f"{m}:base" for m in _BASE] if "base" in want else []
    for form, products in _PRODUCTS.items():
        if form in want:
            out += [f"{fn}:{form}" for fn, _ in products]
    out += [f"{fn}:{form}" for form, fns in _FAST.items() if form in want for fn in fns]
    return out


def function_of(unit: str) -> str:
    return unit.split(":", 1)[0]


def cost(unit: str) -> float:
    return COST.get(unit, 2.0)


def _sample(form: str):
    """A small weight of the form and a few tokens of input (writable arrays, as a run's are)."""
    from ..checkpoint.formats import QWeight

    rng = np.random.default_rng(0)
    kind = form.split("/")[0].split("-")[0]
    sdt = np.uint8 if form.endswith("e8m0") else np.float32
    if kind == "fp4":
        w = QWeight("fp4", rng.integers(0, 256, (4, 16), dtype=np.uint8), np.full((4, 1), 127, sdt), 4, 32)
    elif kind == "fp8":
        block = (32, 32) if form.startswith("fp8-32") else (128, 128)
        w = QWeight("fp8", rng.integers(0, 126, (4, 32), dtype=np.uint8), np.full((1, 1), 127, sdt), 4, 32, block=block)
    elif kind == "bf16":
        w = QWeight("bf16", np.zeros((4, 32), np.uint16), None, 4, 32)
    else:
        w = QWeight("f32", np.zeros((4, 32), np.float32), None, 4, 32)
    from . import fast

    # "mm" must reach the tile kernels: past FP4's and FP8's few-token kernels
    tokens = 1 + max(fast.FEW_TOKENS, fast.FP8_PER_TOKEN, fast.FP8_FEW)
    return w, rng.standard_normal((tokens, 32)).astype(np.float32)


def warm_unit(unit: str) -> float:
    """Compile (or load from numba's cache) one unit; returns the seconds it took."""
    from . import fast

    t0 = time.perf_counter()
    name, form = unit.split(":", 1)
    if form == "base":
        from . import attn, qdq, sinkhorn, trunkops

        {"attn": attn.warmup, "qdq": qdq.warmup, "sinkhorn": sinkhorn.warmup, "trunkops": trunkops.warmup}[name]()
        return time.perf_counter() - t0
    if form in _FAST:
        _warm_fast(name, form)
        return time.perf_counter() - t0
    how = dict(_PRODUCTS[form])[name]
    w, x = _sample(form)
    keep = fast.PARALLEL_MIN_BYTES
    try:
        fast.PARALLEL_MIN_BYTES = 1 << 62 if how == "serial" else 0
        if how == "pair":
            fast.matmul_pair(w, w, x[:1])
        elif how == "few":
            fast.matmul(w, x[:2])
        elif how == "fewpair":
            fast.matmul_pair(w, w, x[:2])
        elif how == "mm":
            fast.matmul(w, x)
        else:
            fast.matvec(w, x[0])
    finally:
        fast.PARALLEL_MIN_BYTES = keep
    return time.perf_counter() - t0


def _warm_fast(name: str, form: str) -> None:
    """One token through the fast product of `form`, the way a run's `numerics.Router` goes
    (prepared activations, the variant's driver); nothing where this target has no variant."""
    from ..checkpoint.formats import QWeight
    from . import cpu, fast
    from .numerics import Router

    if name not in _FAST[form]:
        raise KeyError(f"no fast kernel {name!r} for form {form!r}")
    if form == "fast-head-q8":
        from . import headq8

        if headq8.variant() != "plain":  # else fast reads the BF16 head by the exact kernels (`head.copy_runs`)
            headq8.matmul(np.ones((4, 64), np.int8), np.ones(4, np.float32), np.ones((1, 64), np.float32))
        return
    kind = form.removeprefix("fast-").split("/")[0]
    if cpu.variant(kind) is None:
        return  # these products run the exact kernels on this target
    rng = np.random.default_rng(0)
    sdt = np.uint8 if form.endswith("e8m0") else np.float32
    if kind == "fp4":  # the widths the kernels take: 256 columns (q8.supports), 64 (bf16.supports)
        w = QWeight("fp4", rng.integers(0, 256, (4, 128), dtype=np.uint8), np.full((4, 8), 127, sdt), 4, 256)
    elif kind == "fp8":
        w = QWeight("fp8", rng.integers(0, 126, (4, 64), dtype=np.uint8), np.full((1, 1), 127, sdt), 4, 64)
    else:
        w = QWeight("bf16", np.zeros((4, 64), np.uint16), None, 4, 64)
    x = rng.standard_normal((1, w.cols)).astype(np.float32)
    if name.startswith("xq8"):
        from . import experts_q8

        v = cpu.variant(kind)
        rt = experts_q8.Routing(np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32))
        part = (w.data, w.scale)
        if name == "xq8pair":
            experts_q8.pair_products(v, x, rt, [part], [part])
        elif name == "xq8fused":  # w1, w3 and w2 all 256 x 256 (h is w2's input: 256 wide)
            sq = QWeight("fp4", rng.integers(0, 256, (256, 128), dtype=np.uint8), np.full((256, 8), 127, sdt), 256, 256)
            three = [(sq.data, sq.scale)]
            experts_q8.swiglu_sum(v, x, rt, three, three, three, 10.0)
        else:
            experts_q8.down_sum(v, x, rt, [part])
        return
    router = Router("fast", lambda: fast, numba.get_num_threads)
    router.matmul(w, x)
    if kind == "fp8":  # the shared expert's pair has its own driver (`bf16.fp8_matmul_pair`)
        router.matmul_pair(w, w, x)
        from . import trunkq8

        if trunkq8.wanted():  # the int8 trunk's drivers (DSV4_INT8_TRUNK=1)
            q = trunkq8.quantize(w)
            router.matmul(q, x)
            router.matmul_pair(q, q, x)


def warmup(forms: Iterable[str] | None = None) -> float:
    """Compile (or load from numba's cache) every unit of `forms` (None: every form), then mark
    those forms complete; returns the seconds it took."""
    forms = _all_forms(forms)
    t0 = time.perf_counter()
    for unit in units(forms):
        warm_unit(unit)
    mark_cache_complete(forms)
    return time.perf_counter() - t0


def _all_forms(forms: Iterable[str] | None) -> tuple[str, ...]:
    return tuple(FORMS if forms is None else forms)


def _marker(form: str) -> Path:
    return jit.cache_dir() / f"{form.replace('/', '-')}.ok"


def mark_cache_complete(forms: Iterable[str] | None = None) -> None:
    """Leave a marker per form whose kernels are all in numba's cache (None: every form)."""
    for form in _all_forms(forms):
        marker = _marker(form)
        if marker.is_file():
            continue  # every run warms up: write once per cache folder and form
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=marker.parent, prefix=".dsv4-kernels-")
            os.close(fd)
            os.replace(tmp, marker)
        except OSError:
            return  # an unwritable cache folder: numba cannot cache there either, so every run compiles


def missing_forms(forms: Iterable[str] | None = None) -> tuple[str, ...]:
    """The forms (None: every form) whose kernels the cache folder of this source, numba and CPU
    does not hold: no completed warm-up's marker (index files alone may be from a warm-up that
    did not finish)."""
    return tuple(f for f in _all_forms(forms) if not _marker(f).is_file())


def compiled_cache_exists(forms: Iterable[str] | None = None) -> bool:
    """Whether the cache holds every kernel of `forms` (None: every form); else warmup compiles."""
    return not missing_forms(forms)


def child_main(argv: list[str]) -> int:
    """Warm each unit named on the command line, printing `done UNIT SECONDS` as each ends (the
    parent counts them); `python -m dsv4stream.kernels.warm UNIT ...`."""
    for unit in argv:
        took = warm_unit(unit)
        print(f"done {unit} {took:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
