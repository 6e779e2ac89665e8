"""Stands in for `dsv4 run` in the sweep tests: same options, a stats JSON and a route log.

The route log is a seeded model-like log (identical at every budget); hits come from the
simulator at slots = 10 x budget; memory proportional to the budget is touched so peak RSS
grows with it. FAKE_DIFF_AT=<budget> changes one token id at that budget; FAKE_FAIL=1 exits 2.
"""

import argparse
import json
import os
import sys

import numpy as np

from dsv4stream.measure import simulate as sim
from dsv4stream.run.memory import peak_rss_bytes

ap = argparse.ArgumentParser()
ap.add_argument("cmd")
ap.add_argument("checkpoint")
ap.add_argument("--prompt")
ap.add_argument("--prompt-ids")
ap.add_argument("--gen", type=int)
ap.add_argument("--greedy", action="store_true")
ap.add_argument("--budget", type=float)
ap.add_argument("--io")
ap.add_argument("--numerics")
ap.add_argument("--stats-json")
ap.add_argument("--route-log")
a = ap.parse_args()
if os.environ.get("FAKE_FAIL"):
    print("dsv4: something went wrong", file=sys.stderr)
    sys.exit(2)
rng = np.random.default_rng(0)
rows = [(la, e) for _ in range(a.gen + 1) for la in range(4) for e in sorted(rng.choice(8, 2, replace=False).tolist())]
log = np.array(rows)
with open(a.route_log, "w") as f:
    f.writelines(f"{la} {e}\n" for la, e in rows)
slots = int(10 * a.budget)
r = sim.replay_store(log, slots, hash_layers=1)
ballast = np.ones(int(a.budget * 100e6), dtype=np.uint8)  # touched: counts in RSS
ids = list(range(100, 100 + a.gen))

if os.environ.get("FAKE_DIFF_AT") == f"{a.budget:g}":
    ids[1] += 1
stats = {
    "generated_ids": ids, "prompt_tokens": 5, "expert_requests": r.requests, "expert_hits": r.hits,
    "expert_misses": r.misses, "bytes_read": r.misses * 1000, "cache_slots": slots, "working_set_experts": 8,
    "peak_rss_bytes": peak_rss_bytes(), "budget_bytes": int(a.budget * 1e9), "io_mode": a.io, "prefill_seconds": 0.5,
    "decode_seconds_per_token": 1.0 / a.budget, "store": {"read_gbps": 1.5, "read_seconds": 0.1, "wait_seconds": 0.05},
}  # fmt: skip
with open(a.stats_json, "w") as f:
    json.dump(stats, f)
print("generated", int(ballast.sum()))
