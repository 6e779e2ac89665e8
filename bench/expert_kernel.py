"""Routed FP4 experts through `kernels.experts_q8`'s layer drivers: GB of weight per CPU-second.

    python bench/expert_kernel.py [--threads 1 2] [--rows 1 2 4 8] [--gb 1.2] [--reps 5] [--shape v4|v41]
                                  [--baseline /work/main]

Issue 44: the experts' FP4 x int8 products should run near the memory read rate. Per thread
count and token count T (1: a decode step; 2-8: a short prompt's prefill), in one process:

- `dram`: one MoE layer's routed experts per call (`experts_q8.Layer.whole`, the path
  `model.moe` takes), each token choosing 6 of 24 candidates (T = 1: 6 experts; T = 7: about 21,
  as a short prompt routes), the candidates drawn from a pool of distinct experts of the real size
  (V4-Flash w1 / w3 2048x4096, w2 4096x2048, E2M1 with per-32 E8M0 scales) adding up to --gb, so
  every call reads its weights from DRAM. Figure: expert bytes of the call / its process CPU time
  (both threads' at 2), and per wall second.
- the same call broken down (each part timed alone, best of --reps, CPU ms per call): the
  activation rounding of x and of the SwiGLU (`q8._quantize`), the gate/up driver and the down
  driver (each with its rounding), the SwiGLU in numpy, and what is left (routing, address
  tables, Python).
- `l2`: the drivers' row kernels with the weights in L2: the gate/up driver on 128 rows of w1 and
  of w3 (256 KB each) and the down driver on 512 rows of w2 (512 KB), one expert, T tokens
  (each call also rounds its activations and opens a parallel region: at one token the rounding
  of x alone is about as long as the 512 KB of products), and `rows`: the row kernels alone
  (`q8.row_groups` over 512 rows of w1's width, 16 rows a call, from a numba loop).
- the machine's read rate at that thread count (`measure.readrate`), so dram's figure reads as
  the issue's ratio: time / (bytes / read rate), wanted <= 1.5 (per CPU second).
`--baseline TREE` loads TREE's `kernels/q8.py` and `kernels/experts_q8.py` (copied to a temporary
folder: numba caches beside them) as a second set of drivers and measures both in turn, call by
call, so a before/after pair shares the machine's load (which moves even CPU-second figures by
1.5x here: other processes share the caches and the memory).
Prints the CPU, its SIMD and the load with every line.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
import time
import types
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba
import numpy as np

from dsv4stream.checkpoint.formats import QWeight
from dsv4stream.kernels import cpu, experts_q8, jit
from dsv4stream.measure import readrate
from dsv4stream.measure.machine import load_text, machine_line
from dsv4stream.model.moe import ExpertWeights, _glu

SHAPES = {"v4": (4096, 2048), "v41": (4096, 2304)}  # (hidden D, moe_intermediate_size I)
K, CANDIDATES, LIMIT = 6, 24, 10.0


def fp4(rows: int, cols: int, rng) -> QWeight:
    data = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scale = (120 + rng.integers(0, 6, (rows, cols // 32))).astype(np.uint8)
    return QWeight("fp4", data, scale, rows, cols, role="experts")


def expert(d: int, i: int, rng) -> ExpertWeights:
    return ExpertWeights(fp4(i, d, rng), fp4(d, i, rng), fp4(i, d, rng))


def routing(t: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """T tokens each choosing K distinct experts of CANDIDATES (ids 0 .. CANDIDATES-1)."""
    experts = np.stack([rng.choice(CANDIDATES, K, replace=False) for _ in range(t)]).astype(np.int64)
    weights = rng.random((t, K), dtype=np.float32) + np.float32(0.1)
    return experts, weights


def cpu_call(fn) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


class Pool:
    """Distinct experts adding up to `gb`, handed out in turn (each call's weights come from DRAM)."""

    def __init__(self, d: int, i: int, gb: float, rng) -> None:
        one = 3 * d * i // 2 + 3 * d * i // 32
        self.experts = [expert(d, i, rng) for _ in range(max(2 * CANDIDATES, int(gb * 1e9 // one)))]
        self.next = 0

    def take(self, n: int) -> list[ExpertWeights]:
        out = [self.experts[(self.next + j) % len(self.experts)] for j in range(n)]
        self.next = (self.next + n) % len(self.experts)
        return out


def load_baseline(tree: Path) -> types.ModuleType:
    """TREE's experts_q8 driving TREE's q8, as modules of this package (its other kernel modules
    are this tree's: the two files are all the expert path's kernel code)."""
    tmp = Path(tempfile.mkdtemp(prefix="expert_kernel_"))
    mods = {}
    for name in ("q8", "experts_q8"):
        src = (tree / "dsv4stream/kernels" / f"{name}.py").read_text()
        src = src.replace("from . import jit, q8, simd", "from . import jit, simd\nfrom . import base_q8 as q8")
        src = src.replace("from .q8 import", "from .base_q8 import")
        path = tmp / f"base_{name}.py"
        path.write_text(src)
        mod = types.ModuleType(f"dsv4stream.kernels.base_{name}")
        mod.__file__, mod.__package__ = str(path), "dsv4stream.kernels"
        sys.modules[mod.__name__] = mod
        exec(compile(src, str(path), "exec"), mod.__dict__)  # noqa: S102 (another tree's module, on purpose)
        mods[name] = mod
    return mods["experts_q8"]


def layer_call(xq8, variant: str, x, experts, weights, es):
    """`model.moe._layer`'s path for a layer whose experts all came in one group (with the SwiGLU's
    limit where the tree's `Layer` takes it: `experts_q8.swiglu_sum`)."""
    ids = np.unique(experts)
    group = list(zip(ids.tolist(), es, strict=True))
    kw = {"limit": LIMIT} if "limit" in inspect.signature(xq8.Layer).parameters else {}
    layer = xq8.Layer(variant, x, experts, weights, partial(_glu, limit=LIMIT), **kw)
    out = layer.whole(group)
    assert out is not None
    return out


def dram(impls: dict, variant: str, pool: Pool, t: int, reps: int, rng) -> dict[str, dict[str, float]]:
    """Whole-layer calls of each implementation in turn on the same routing, best of reps (per
    CPU second); each call reads experts no call read just before (the pool's next ones)."""
    d = pool.experts[0].w2.rows
    best: dict[str, dict[str, float]] = {k: {} for k in impls}
    for _ in range(reps):
        x = rng.standard_normal((t, d), dtype=np.float32)
        experts, weights = routing(t, rng)
        outs = []
        for name, xq8 in impls.items():
            es = pool.take(np.unique(experts).size)
            nbytes = sum(e.w1.nbytes + e.w2.nbytes + e.w3.nbytes for e in es)
            call = partial(layer_call, xq8, variant, x, experts, weights, es)
            got = []
            wall, cpu_s = cpu_call(lambda call=call, got=got: got.append(call()))
            outs.append((es, got[0]))
            b = best[name]
            if cpu_s and nbytes / cpu_s > b.get("cpu_gbps", 0):
                b.update(
                    cpu_gbps=nbytes / cpu_s / 1e9, wall_gbps=nbytes / wall / 1e9, cpu_ms=cpu_s * 1e3, wall_ms=wall * 1e3
                )
                b.update(gb=nbytes / 1e9, experts=len(es))
        if len(outs) == 2:  # the same routing on other experts: compare on the first's experts
            same = layer_call(impls[list(impls)[1]], variant, x, experts, weights, outs[0][0])
            if not np.array_equal(same.view(np.int32), outs[0][1].view(np.int32)):
                raise SystemExit("expert_kernel: the baseline's bits differ from this tree's")
    return best


def tables(xq8, experts, weights, w2s):
    return xq8.Routing(experts, weights), xq8._address_table([[a, b] for a, b in w2s])


def parts(xq8, variant: str, pool: Pool, t: int, reps: int, rng) -> dict[str, float]:
    """CPU ms per call of each part of a layer call, each timed alone (best of reps)."""
    q8 = xq8.q8
    d = pool.experts[0].w2.rows
    i = pool.experts[0].w1.rows
    s = q8.span(variant)
    got: dict[str, float] = {}

    def keep(name, fn):
        got[name] = min(got.get(name, np.inf), cpu_call(fn)[1] * 1e3)

    for _ in range(reps):
        x = rng.standard_normal((t, d), dtype=np.float32)
        experts, weights = routing(t, rng)
        es = pool.take(np.unique(experts).size)
        rt = xq8.Routing(experts, weights)
        p = rt.tok.size
        w1s, w2s, w3s = ([xq8._parts(getattr(e, m)) for e in es] for m in ("w1", "w2", "w3"))
        xg = np.ascontiguousarray(x[rt.tok])
        qa, bias, da = xq8._scratch(p, d)
        keep("quant x", partial(q8._quantize, xg, s, qa, bias, da))
        gate, up = xq8.pair_products(variant, x, rt, w1s, w3s)
        es = pool.take(len(es))  # weights no call has just read
        w1s, w2s, w3s = ([xq8._parts(getattr(e, m)) for e in es] for m in ("w1", "w2", "w3"))
        keep("gate/up", partial(xq8.pair_products, variant, x, rt, w1s, w3s))
        keep("swiglu", partial(_glu, gate.copy(), up.copy(), LIMIT))
        h = _glu(gate, up, LIMIT)
        qh, bh, dh = xq8._scratch(p, i)
        keep("quant h", partial(q8._quantize, h, s, qh, bh, dh))
        keep("down", partial(xq8.down_sum, variant, h, rt, w2s))
        keep("routing+tables", partial(tables, xq8, experts, weights, w2s))
    return got


def l2(xq8, variant: str, d: int, i: int, t: int, reps: int, rng) -> dict[str, float]:
    """The drivers on L2-sized slices of one expert (w1 and w3 128 rows, w2 512 rows), called
    directly (no Python around them): GB of weight per CPU second."""
    q8 = xq8.q8
    w1, w3, w2 = fp4(128, d, rng), fp4(128, d, rng), fp4(512, i, rng)
    rt = xq8.Routing(np.zeros((t, 1), np.int64), np.ones((t, 1), np.float32))
    x = rng.standard_normal((t, d), dtype=np.float32)
    h = rng.standard_normal((t, i), dtype=np.float32)
    s = q8.span(variant)
    pair = xq8.driver_for("pair", variant)
    down = xq8.driver_for("down", variant)
    t13 = xq8._address_table([[w1.data, w1.scale, w3.data, w3.scale]])
    t2 = xq8._address_table([[w2.data, w2.scale]])
    g, u = np.empty((t, 128), np.float32), np.empty((t, 128), np.float32)
    y, out = np.empty((t, w2.rows), np.float32), np.empty((t, w2.rows), np.float32)
    sx, sh = xq8._scratch(t, d), xq8._scratch(t, i)
    sdt = xq8.U8_LIKE
    got = {}
    for name, fn, nbytes in (
        ("gate/up", lambda: pair(t13, rt.lo, rt.hi, sdt, x, s, g, u, *sx), w1.nbytes + w3.nbytes),
        ("down", lambda: down(t2, rt.lo, rt.hi, sdt, h, s, rt.wp, rt.tp, y, out, *sh), w2.nbytes),
    ):
        fn()
        n = 50
        best = np.inf
        for _ in range(reps):
            c0 = time.process_time()
            for _ in range(n):
                fn()
            best = min(best, (time.process_time() - c0) / n)
        got[name] = nbytes / best / 1e9
    return got


def _row_loop(rg):
    """A numba loop calling the row kernels `rg` (`q8.row_groups`) over w's rows, 16 a call (trees
    before issue 44's last stop take a float32 scratch for the scales: `sw`)."""
    if "sw" in inspect.signature(rg.py_func).parameters:

        @numba.njit
        def loop_sw(n, w, s, sw, qa, bias, da, t, out):
            for _ in range(n):
                for r0 in range(0, w.shape[0], 16):
                    rg(w, s, r0, r0 + 16, sw, qa, bias, da, 0, t, out)

        return loop_sw

    @numba.njit
    def loop(n, w, s, sw, qa, bias, da, t, out):
        for _ in range(n):
            for r0 in range(0, w.shape[0], 16):
                rg(w, s, r0, r0 + 16, qa, bias, da, 0, t, out)

    return loop


def rows(xq8, variant: str, d: int, t: int, reps: int, rng) -> float:
    """The row kernels alone on 512 rows of w1's shape (1 MB, in L2), T tokens: GB per CPU-s."""
    q8 = xq8.q8
    w = fp4(512, d, rng)
    qa, bias, da = q8.quantize(rng.standard_normal((t, d), dtype=np.float32), variant)
    sw = np.empty((16, d // 32), np.float32)
    out = np.empty((t, w.rows), np.float32)
    loop = _row_loop(q8.row_groups(variant))
    loop(1, w.data, w.scale, sw, qa, bias, da, t, out)
    n, best = 200, np.inf
    for _ in range(reps):
        c0 = time.process_time()
        loop(n, w.data, w.scale, sw, qa, bias, da, t, out)
        best = min(best, (time.process_time() - c0) / n)
    return w.nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--gb", type=float, default=1.2, help="the pool of distinct experts (several times the LLC)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shape", choices=SHAPES, default="v4")
    ap.add_argument("--baseline", type=Path, help="another tree (e.g. /work/main): its drivers measured in turn")
    ap.add_argument("--no-parts", action="store_true", help="skip the breakdown")
    a = ap.parse_args()
    variant = cpu.variant("fp4")
    if variant is None:
        raise SystemExit("expert_kernel: no fast FP4 x int8 kernel for this CPU target")
    impls = {"this": experts_q8}
    if a.baseline:
        impls["base"] = load_baseline(a.baseline)
    d, i = SHAPES[a.shape]
    rng = np.random.default_rng(0)
    print(machine_line(), f"variant={variant} numba_threads={numba.config.NUMBA_NUM_THREADS}", flush=True)
    pool = Pool(d, i, a.gb, rng)
    print(f"pool: {len(pool.experts)} experts of {a.shape} ({d}x{i}), {a.gb:g} GB", flush=True)
    for th in a.threads:
        jit.set_threads(th)
        rate = readrate.read_rate(th, repeat=3)
        print(f"threads {th}: read rate {rate.line()} load {load_text()}", flush=True)
        for t in a.rows:
            dram(impls, variant, pool, t, 1, rng)  # compile and warm
            res = dram(impls, variant, pool, t, a.reps, rng)
            for name, r in res.items():
                ratio = rate.cpu_gbps / (r["cpu_gbps"] * th)  # its time over the bytes' at the read rate
                print(
                    f"  T={t} {name} dram: {r['experts']} experts {r['gb']:.3f} GB, {r['cpu_gbps']:.2f} GB per CPU-s,"
                    f" {r['wall_gbps']:.2f} per wall s; {r['cpu_ms']:.1f} CPU ms; ratio to the read rate {ratio:.2f}"
                    f" (CPU) load {load_text()}",
                    flush=True,
                )
            for name, xq8 in impls.items():
                if not a.no_parts:
                    p = parts(xq8, variant, pool, t, a.reps, rng)
                    print(f"    {name} parts (CPU ms): " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()), flush=True)
                q = l2(xq8, variant, d, i, t, a.reps, rng)
                q["rows"] = rows(xq8, variant, d, t, a.reps, rng)
                print(f"    {name} l2 (GB per CPU-s): " + ", ".join(f"{k} {v:.1f}" for k, v in q.items()), flush=True)


if __name__ == "__main__":
    main()
