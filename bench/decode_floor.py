"""Decode s/token at a streaming budget against its two floors (compute, disk), in one run.

    python bench/decode_floor.py CHECKPOINT [--budget 2.2] [--cached-budget 6] [--gen 40]
        [--prompt TEXT | --prompt-ids 0,1,2] [--io-threads 4] [--dd-mb 1024]

Three measurements, the first two each in a fresh child process (so each budget holds and
each expert cache starts cold), all on the same prompt with greedy decoding:

  streaming   `Runtime` at --budget: prefill, then --gen tokens. Timed window: the decode
              steps (`RunStats.decode_seconds_per_token`, prefill excluded). Also the bytes
              read during decode (experts + streamed trunk layers, counted from the first
              token on) per decode step.
  compute     `Runtime` at --cached-budget, which must hold every expert and the whole
              trunk: the same generation once to warm up (loads every expert the run uses,
              kernels and caches hot), then again in a fresh session of the same runtime.
              Timed window: that second run's decode steps. Its bytes read are printed and
              must be 0, else the figure is not a compute floor.
  disk        `dd if=SHARD of=/dev/null bs=EXPERT iflag=direct` over --dd-mb of the largest
              shard (where the experts are), expert-sized blocks, at queue depth 1 and at
              --io-threads (that many dd processes on disjoint ranges); the faster rate.
              disk floor = bytes read per decode step / that rate.

ratio = streaming / max(compute floor, disk floor): 1.0 means decode is as fast as the slower
of disk and compute allows (reads fully overlapped with compute). Token ids of the two runs
must agree. Each child also prints its per-token profile (`RunStats.decode_profile`). Prints
one line per measurement, then the summary with CPU model, SIMD flags and load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dsv4stream.cli.outputs import refuse_bad_output
from dsv4stream.files import atomic_write

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog."

CHILD = r"""
import json, sys
from dsv4stream.run.runtime import Runtime
from dsv4stream.run.runinfo import RunOptions
ck, budget, gen, io_threads, warm = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
ids = [int(i) for i in sys.argv[6].split(",")]

def run(rt):
    before, out = None, []
    for tok in rt.generate(rt.session(), ids, gen):
        if before is None:
            before = rt.stats()  # prefill done: reads from here on are the decode's
        out.append(tok)
    return before, rt.stats(), out

with Runtime.open(ck, RunOptions(budget=int(budget * 1e9), io_threads=io_threads)) as rt:
    if warm:
        run(rt)
    a, b, out = run(rt)
steps = b.decode_tokens - a.decode_tokens
secs = b.decode_seconds_per_token * b.decode_tokens - a.decode_seconds_per_token * a.decode_tokens
read = b.bytes_read + b.trunk_bytes_read - a.bytes_read - a.trunk_bytes_read
pa, pb = getattr(a, "decode_profile", None), getattr(b, "decode_profile", None)
prof = {k: (v * b.decode_tokens - pa.get(k, 0.0) * a.decode_tokens) / steps for k, v in pb.items()} if pb else None
print(json.dumps({"ids": out, "steps": steps, "s_per_token": secs / steps, "read_per_token": read / steps,
                  "hit_rate": b.hit_rate, "slots": b.cache_slots, "pinned": b.trunk_pinned_layers,
                  "streamed": b.trunk_streamed_layers, "peak_rss": b.peak_rss_bytes, "profile": prof}))
"""


def child(ck: Path, budget: float, gen: int, io_threads: int, warm: bool, ids: list[int]) -> dict:
    cmd = [sys.executable, "-c", CHILD, str(ck), str(budget), str(gen), str(io_threads), "1" if warm else "0"]
    out = subprocess.run([*cmd, ",".join(map(str, ids))], capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"decode_floor: child at --budget {budget} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def dd_rate(path: Path, block: int, mb: int, q: int) -> float:
    """GB/s of q `dd iflag=direct` processes reading disjoint ranges of `path` in `block`-byte blocks."""
    blocks = max(q, min(mb * 2**20, path.stat().st_size) // block)
    per = blocks // q
    cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={block}", "iflag=direct", "status=none"]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([*cmd, f"skip={i * per}", f"count={per}"]) for i in range(q)]
    if any(p.wait() for p in procs):
        sys.exit(f"decode_floor: dd iflag=direct failed on {path}")
    return q * per * block / (time.perf_counter() - t0) / 1e9


def expert_bytes(ck: Path) -> int:
    from dsv4stream.checkpoint.catalog import Catalog
    from dsv4stream.run.memory import main_expert_layouts
    from dsv4stream.store import ExpertStore

    layouts, _ = main_expert_layouts(Catalog.open(ck))
    return ExpertStore.slot_nbytes(layouts)


def machine() -> str:
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        k, _, v = line.partition(":")
        info.setdefault(k.strip(), v.strip())
    flags = set(info.get("flags", "").split())
    simd = ",".join(f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni") if f in flags)
    load = os.getloadavg()
    return f"cpu={info.get('model name', '?')!r} cores={os.cpu_count()} simd={simd or 'none'} load={load[0]:.2f},{load[1]:.2f}"


def prompt_ids(ck: Path, text: str | None, ids: str | None) -> list[int]:
    if ids:
        return [int(i) for i in ids.split(",")]
    from dsv4stream.text.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(ck)
    return [tok.special.bos, *tok.encode(text or DEFAULT_PROMPT)]


def profile_text(p: dict | None) -> str:
    if not p:
        return ""
    total = sum(p.values()) or 1.0
    return " | profile " + ", ".join(f"{k} {v * 1e3:.1f} ms ({v / total:.0%})" for k, v in p.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--budget", type=float, default=2.2, help="streaming budget, GB")
    ap.add_argument("--cached-budget", type=float, default=6.0, help="a budget that holds everything, GB")
    ap.add_argument("--gen", type=int, default=40)
    ap.add_argument("--prompt", default=None, help=f"text (BOS + its tokens) [default: {DEFAULT_PROMPT!r}]")
    ap.add_argument("--prompt-ids", default=None, help="comma-separated ids instead of --prompt")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--dd-mb", type=int, default=1024, help="MiB each dd measurement reads")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure (and the ids) here")
    args = ap.parse_args()
    refuse_bad_output(args.json, "--json")  # never over a checkpoint or pack file
    ck = args.checkpoint
    ids = prompt_ids(ck, args.prompt, args.prompt_ids)
    print(f"# {machine()} prompt={len(ids)} tokens gen={args.gen}", flush=True)

    stream = child(ck, args.budget, args.gen, args.io_threads, False, ids)
    print(
        f"streaming --budget {args.budget}: {stream['s_per_token']:.3f} s/token, read"
        f" {stream['read_per_token'] / 1e6:.1f} MB/token, hit {stream['hit_rate']:.1%}, slots {stream['slots']},"
        f" trunk {stream['pinned']} pinned / {stream['streamed']} streamed, peak RSS {stream['peak_rss'] / 1e9:.2f} GB"
        + profile_text(stream["profile"]),
        flush=True,
    )
    cached = child(ck, args.cached_budget, args.gen, args.io_threads, True, ids)
    print(
        f"compute --budget {args.cached_budget} (warmed up): {cached['s_per_token']:.3f} s/token, read"
        f" {cached['read_per_token'] / 1e6:.1f} MB/token (must be 0), trunk {cached['streamed']} streamed"
        + profile_text(cached["profile"]),
        flush=True,
    )
    shard = max(ck.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    block = expert_bytes(ck)
    rates = {q: dd_rate(shard, block, args.dd_mb, q) for q in sorted({1, args.io_threads})}
    disk = max(rates.values())
    print("disk: dd iflag=direct bs=" + str(block) + " " + ", ".join(f"qd{q} {r:.2f} GB/s" for q, r in rates.items()))
    disk_floor = stream["read_per_token"] / disk / 1e9
    floor = max(cached["s_per_token"], disk_floor)
    same = "identical" if stream["ids"] == cached["ids"] else "DIFFERENT"
    print(
        f"decode_floor: decode {stream['s_per_token']:.3f} s/token | compute floor {cached['s_per_token']:.3f}"
        f" | disk floor {disk_floor:.3f} ({stream['read_per_token'] / 1e6:.1f} MB / {disk:.2f} GB/s)"
        f" | ratio {stream['s_per_token'] / floor:.2f} | ids {same} | {machine()}"
    )
    if args.json is not None:
        doc = {"streaming": stream, "compute": cached, "dd_gbps": rates, "disk_floor": disk_floor, "machine": machine()}
        atomic_write(args.json, json.dumps(doc, indent=1) + "\n")
    if same != "identical":
        sys.exit(1)


if __name__ == "__main__":
    main()
