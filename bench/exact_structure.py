"""A full-size dry run on an exact-structure V4-Flash checkpoint: validate, plan, greedy under --budget.

The checkpoint (`synth` presets `flash` = the May preview, `flash-0731` = DeepSeek-V4-Flash-0731)
has every tensor of the release at its real shape, dense weights random, routed experts as
sparse-file holes (they read as zeros, so expert reads cost no disk and the MoE adds nothing:
the figures are the trunk's, the attention's and the head's at real dimensions). With
`--make`, it is generated first (about 9 GB of real disk, 15 minutes on 2 cores).

Three steps, each timed alone and printed as one line:
1. validate: `Catalog.open` + `validate` (headers only): shards, tensors, bytes, layout.
2. plan: the planner's split of `--budget` as `dsv4 run` prints it (dsv4 inspect --budget).
3. run: `/usr/bin/time -v dsv4 run CKPT --prompt-ids IDS --greedy --gen N --budget B
   --stats-json F` in a fresh process; peak RSS is `time`'s "Maximum resident set size" (the
   process measured from outside, its whole life: imports, planning, loading, prefill, decode),
   beside the run's own VmHWM and the budget. Timed window for s/token: decode steps only.
Then the machine: CPU model, SIMD flags, load average.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.synth import EXACT_PRESETS, make_checkpoint
from dsv4stream.synth.v41 import EXACT_PRESETS_V41


def validate(ckpt: Path) -> str:
    t0 = time.perf_counter()
    cat = Catalog.open(ckpt)
    cat.validate()
    dt = time.perf_counter() - t0
    shards = len({e.path for e in cat.entries.values()})
    total = sum(e.nbytes for e in cat.entries.values())
    real = sum(os.stat(p).st_blocks * 512 for p in ckpt.glob("*.safetensors"))
    return (
        f"validate: {shards} shards, {len(cat.entries):,} tensors, {total:,} bytes"
        f" ({real / 1e9:.1f} GB on disk), layout {cat.config.layout}, all valid in {dt:.2f} s"
    )


def run(ckpt: Path, budget: float, gen: int, prompt: str) -> tuple[list[str], str]:
    with tempfile.TemporaryDirectory() as d:
        stats = Path(d) / "stats.json"
        dsv4 = [sys.executable, "-c", "from dsv4stream.cli import main; main()"]
        cmd = ["/usr/bin/time", "-v", *dsv4, "run", str(ckpt), "--prompt-ids", prompt, "--greedy"]
        cmd += ["--gen", str(gen), "--budget", f"{budget:g}", "--stats-json", str(stats)]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode:
            raise SystemExit(f"exact_structure: dsv4 run failed:\n{p.stderr[-3000:]}")
        s = json.loads(stats.read_text())
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024
    plan = [ln for ln in p.stderr.splitlines() if ln.startswith(("budget ", "  "))][:6]
    line = (
        f"run: --budget {budget:g}: peak RSS {rss / 1e9:.3f} GB from outside ({rss / (budget * 1e9):.0%} of budget;"
        f" own VmHWM {s['peak_rss_bytes'] / 1e9:.3f} GB), {len(s['generated_ids'])} tokens {s['generated_ids']},"
        f" prefill {s['prompt_tokens']} tokens in {s['prefill_seconds']:.1f} s,"
        f" decode {s['decode_seconds_per_token']:.2f} s/token, trunk read {s['trunk_bytes_read'] / 1e9:.1f} GB"
        f" ({s['trunk_pinned_layers']} pinned, {s['trunk_streamed_layers']} streamed), wall {wall:.0f} s;"
        f" {s.get('unused') or 'no mtp.* blocks'}"
    )
    return plan, line


def machine() -> str:
    cpu = re.search(r"Model name:\s+(.+)", subprocess.run(["lscpu"], check=True, capture_output=True, text=True).stdout)
    flags = Path("/proc/cpuinfo").read_text()
    simd = sorted({f for f in re.findall(r"\b(avx2|avx512f|avx512_bf16|avx512_vnni)\b", flags)})
    return f"machine: {cpu.group(1) if cpu else '?'}, {os.cpu_count()} cpus, {' '.join(simd)}; load {os.getloadavg()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument(
        "--make", choices=(*EXACT_PRESETS, *EXACT_PRESETS_V41), help="generate the checkpoint first with this preset"
    )
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--gen", type=int, default=3)
    ap.add_argument("--prompt-ids", default="0,100,2000,30000")
    args = ap.parse_args()
    if args.make:
        t0 = time.perf_counter()
        make_checkpoint(args.checkpoint, args.make, seed=0)
        print(f"make: {args.make} in {time.perf_counter() - t0:.0f} s", flush=True)
    print(validate(args.checkpoint), flush=True)
    plan, line = run(args.checkpoint, args.budget, args.gen, args.prompt_ids)
    for ln in plan:
        print(f"plan: {ln.strip()}")
    print(line)
    print(machine())


if __name__ == "__main__":
    main()
