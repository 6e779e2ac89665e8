"""Seconds per decode step of a DeepSeek-V4.1 checkpoint, and where they go (cProfile).

Opens CHECKPOINT through `Runtime` (budget ample: every expert stays cached after its first
read, so from the second step on no expert is read and the step is compute and Python), prefills
--prompt tokens (ids 3, 4, ...), then decodes --gen tokens greedily. Timed window of one step:
from one yielded token to the next (the session's forward pass of one token, the head, the
pick); the first --skip steps are left out (first expert reads). `--kernels generic` runs
the path the V4.1 kernels replaced, in the same process and numba cache: FP8 32x32 products
through the generic FP8 matvec (`_fp8_mv`: the scalar decode, the same bits) and the
activation grid and the Sinkhorn passes through numpy (`model.v41.quant.fp8_qdq`,
`model.mhc.split_mixes`'s loop; the same bits). Each step is timed in wall seconds and in
process CPU seconds (all threads; on a shared machine the CPU figure is the work, the wall
figure adds the wait for a core). `--profile N` prints
the N functions with the most own time over the timed steps.

Prints a header (machine, load), one line `kernels=... step_ms_median=... step_ms_min=...
cpu_ms_median=... steps=... tokens=...` (the generated ids, to check that both paths agree) and the profile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

from dsv4stream.measure.machine import cpu_description


def use_generic_kernels() -> None:
    """Route the FP8 matvecs and V4.1's activation grid to what ran before their kernels (the FP8
    tile kernel is shared by both paths since it decodes 32 columns per vector op)."""
    from dsv4stream.kernels import fast
    from dsv4stream.model import mhc
    from dsv4stream.model.v41 import attention as v41_attention
    from dsv4stream.model.v41 import engram, quant
    from dsv4stream.model.v41 import moe as v41_moe

    fast._fp8_mvv = lambda w, s, br, bc, wide, x, rpg, out: fast._fp8_mv(w, s, br, bc, x, rpg, out)
    fast._fp8_mvv_serial = lambda w, s, br, bc, wide, x, rpg, out: fast._fp8_mv_serial(w, s, br, bc, x, rpg, out)
    fast._fp8_mv2v = lambda w1, s1, w3, s3, br, bc, x, o1, o3: fast._fp8_mv2(w1, s1, w3, s3, br, bc, x[0], o1, o3)
    for mod in (engram, v41_attention, v41_moe):
        mod.act_qdq = lambda x: quant.fp8_qdq(x, 32)
    mhc._fast_sinkhorn = lambda hc: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--gen", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--budget", type=float, default=8.0, help="GB")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kernels", choices=("v41", "generic"), default="v41")
    ap.add_argument("--profile", type=int, default=0)
    a = ap.parse_args()

    from dsv4stream import kernels
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    kernels.set_backend("fast")
    if a.kernels == "generic":
        use_generic_kernels()
    load = os.getloadavg()
    print(f"# machine: {cpu_description()} cores={os.cpu_count()} load_avg={load[0]:.2f},{load[1]:.2f},{load[2]:.2f}")
    opts = RunOptions(budget=int(a.budget * 1e9), threads=a.threads, trunk="")
    with Runtime.open(a.checkpoint, opts) as rt:
        ids = [3 + i for i in range(a.prompt)]
        stamps, cpu, out = [], [], []
        prof = cProfile.Profile()
        for tok in rt.generate(rt.session(), ids, a.gen, None):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            out.append(tok)
            if a.profile and len(stamps) == a.skip + 1:
                prof.enable()
        prof.disable()
    steps = [b - s for s, b in zip(stamps[a.skip :], stamps[a.skip + 1 :], strict=False)]
    ms = [s * 1e3 for s in steps]
    cpu_ms = [(b - s) * 1e3 for s, b in zip(cpu[a.skip :], cpu[a.skip + 1 :], strict=False)]
    load = os.getloadavg()
    print(
        f"kernels={a.kernels} step_ms_median={statistics.median(ms):.2f} step_ms_min={min(ms):.2f}"
        f" cpu_ms_median={statistics.median(cpu_ms):.2f}"
        f" steps={len(ms)} load_end={load[0]:.2f} tokens={','.join(map(str, out))}"
    )
    if a.profile:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.profile)
        print(buf.getvalue())


if __name__ == "__main__":
    main()
