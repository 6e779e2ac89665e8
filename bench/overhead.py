"""Baseline memory of a run whose weights are negligible: what `planner.DEFAULT_OVERHEAD` covers.

One fresh process per backend runs, through `Runtime`, a "tiny" generated checkpoint with the
real V4 vocabulary (so the packed tokenizer is the real one): load the tokenizer, encode a
chat prompt, open the runtime (budget ample, overhead 0), generate --gen tokens, decode them.
The figure is the process's peak RSS (ru_maxrss, the kernel's high-water mark) minus the
weight bytes the plan placed and touched (head group, pinned layers, expert slots used):
interpreter, numpy, numba and its compiled kernels, tokenizers, thread stacks, allocator
slack, activations. Prints one line per backend and the machine state.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys
from dsv4stream import kernels
kernels.set_backend(sys.argv[2])
from dsv4stream.text import chat
from dsv4stream.text.messages import one_turn
from dsv4stream.run.runtime import Runtime
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.memory import peak_rss_bytes
from dsv4stream.text.tokenizer import Tokenizer
tok = Tokenizer.load(sys.argv[1])
ids = chat.encode(tok, one_turn("How much memory does a small run need?"))
with Runtime.open(sys.argv[1], RunOptions(budget=10**10, overhead=0, trunk="")) as rt:
    out = list(rt.generate(rt.session(), ids, int(sys.argv[3]), lambda l: int(l[: tok.n_tokens].argmax())))
    tok.decode(out)
    s = rt.stats()
    n = rt.plan.needs
    weights = n.head_resident_bytes + rt.plan.pinned_bytes + min(s.expert_misses, s.cache_slots) * s.slot_bytes
print(json.dumps({"peak": peak_rss_bytes(), "weights": weights, "backend": s.kernel_backend}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--backends", default="fast,reference")
    args = ap.parse_args()
    from dsv4stream import synth
    from dsv4stream.text.tokenizer import pack_tokenizer

    parts = []
    with tempfile.TemporaryDirectory() as d:
        ck = synth.make_checkpoint(Path(d) / "ck", preset="tiny", vocab_size=synth.REAL_VOCAB)
        pack_tokenizer(ck)
        for backend in args.backends.split(","):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(ck), backend, str(args.gen)],
                check=False,
                capture_output=True,
                text=True,
            )
            if out.returncode:
                sys.exit(f"overhead: {backend} run failed:\n{out.stderr}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            parts.append(
                f"{r['backend']}: peak RSS {r['peak'] / 1e6:.0f} MB, weights {r['weights'] / 1e6:.1f} MB,"
                f" overhead {(r['peak'] - r['weights']) / 1e6:.0f} MB"
            )
    load = os.getloadavg()[0]
    print(f"overhead: {' | '.join(parts)} | python {sys.version.split()[0]} cpus={os.cpu_count()} load={load:.2f}")


if __name__ == "__main__":
    main()
