"""Peak RSS of `dsv4 run` against its `--budget`, one fresh process per budget and kernel backend.

With --dd, each run is preceded by `dd if=SHARD of=/dev/null bs=13369344 iflag=direct` over the
checkpoint's largest shard (the drive's own O_DIRECT rate at expert-sized reads, same files,
same run), printed beside the store's read rate (bytes read / time with a read in flight).

For each budget: `dsv4 run CHECKPOINT --prompt-ids ... --gen N --budget B --stats-json`, run
in a child process (the kernel backend set first). The parent samples the child's RSS with
psutil every 5 ms; the child's own high-water mark comes from wait4 (ru_maxrss). Timed
window: the whole process (imports, planning, loading, prefill, decode). Prints one line per
run: budget, the plan (pinned layers, expert slots), psutil's sampled peak, the kernel's peak,
peak / budget, and whether the ids equal the first run's; then the machine state.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

CHILD = "import sys; from dsv4stream import kernels; kernels.set_backend(sys.argv.pop(1)); from dsv4stream.cli import main; main()"


def run_once(ckpt: str, budget: float, backend: str, gen: int, prompt: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        stats_path = Path(d) / "stats.json"
        cmd = [sys.executable, "-c", CHILD, backend, "run", ckpt, "--prompt-ids", prompt, "--gen", str(gen)]
        cmd += ["--budget", f"{budget:g}", "--stats-json", str(stats_path), *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ps = psutil.Process(proc.pid)
        sampled = 0
        while proc.poll() is None:
            try:
                sampled = max(sampled, ps.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.005)
        # poll() reaped the child: its rusage is in RUSAGE_CHILDREN only as a max over all
        # children, so each run is measured alone and compared with the stats' own figure.
        err = proc.stderr.read() if proc.stderr else ""
        if proc.returncode:
            return {"budget": budget, "error": err.strip().splitlines()[-1] if err.strip() else "failed"}
        s = json.loads(stats_path.read_text())
    plan = next((ln for ln in err.splitlines() if ln.strip().startswith("trunk:")), "").strip()
    return {"budget": budget, "sampled": sampled, "kernel_peak": s["peak_rss_bytes"], "slots": s["cache_slots"],
            "plan": plan, "ids": s["generated_ids"], "hit_rate": s["hit_rate"], "s_tok": s["decode_seconds_per_token"],
            "gb_read": s["bytes_read"] / 1e9, "gbps": s["read_gbps"], "exposed": s["exposed_io_seconds"],
            "requests": s["expert_requests"], "io": s["io_mode"]}  # fmt: skip


def dd_gbps(ckpt: str) -> float:
    shard = max(Path(ckpt).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    cmd = ["dd", f"if={shard}", "of=/dev/null", "bs=13369344", "iflag=direct", "status=none"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return shard.stat().st_size / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--budgets", default="0.85,1.0,1.3,1.7", help="GB, comma separated")
    ap.add_argument("--backends", default="fast,reference")
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--prompt-ids", default="0,100,2000,30000,400,5000,60000,700,8000,90000,10,11")
    ap.add_argument("--extra", default="", help="more dsv4 run options, space separated")
    ap.add_argument("--dd", action="store_true", help="time dd iflag=direct on the largest shard before each run")
    args = ap.parse_args()
    for backend in args.backends.split(","):
        first = None
        for b in (float(x) for x in args.budgets.split(",")):
            dd = f" | dd iflag=direct {dd_gbps(args.checkpoint):.2f} GB/s" if args.dd else ""
            r = run_once(args.checkpoint, b, backend, args.gen, args.prompt_ids, args.extra.split())
            if "error" in r:
                print(f"rss_budget: {backend} --budget {b:g}: {r['error']}")
                continue
            first = first or r["ids"]
            peak = max(r["sampled"], r["kernel_peak"])
            print(
                f"rss_budget: {backend} --budget {b:g} GB | {r['plan']}, {r['slots']} expert slots"
                f" | peak RSS psutil {r['sampled'] / 1e9:.3f} GB, kernel {r['kernel_peak'] / 1e9:.3f} GB"
                f" = {peak / (b * 1e9):.0%} of budget | hit rate {r['hit_rate']:.1%}, {r['s_tok']:.2f} s/token"
                f" | {r['requests']} requests, {r['gb_read']:.2f} GB read at {r['gbps']:.2f} GB/s ({r['io']}),"
                f" {r['exposed']:.2f} s exposed{dd} | ids {'same' if r['ids'] == first else 'DIFFER'}"
            )
    mem = psutil.virtual_memory()
    print(f"rss_budget: cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f} mem_avail={mem.available / 2**30:.1f}GiB")


if __name__ == "__main__":
    main()
