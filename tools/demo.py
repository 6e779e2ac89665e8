#!/usr/bin/env python3
"""`make demo`: a generated checkpoint run under a budget smaller than itself.

Usage: tools/demo.py [DEMO_DIR] [--gen N] [--prompt TEXT]
The first run writes DEMO_DIR/checkpoint (synth preset "demo": the real V4 tokenizer's
vocabulary, 6 layers of 48 routed experts of 3.3 MB each, random weights; about 1.7 GB, well
under a minute), then packs its trunk and tokenizer; later runs reuse all three. Each run then
answers one chat prompt with routed experts streamed from the shards into an LRU cache that
holds about a third of them, and prints the plan, the text and the cache statistics. The
weights are random, so the text is random too: the demo shows the machinery, not a model.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

# Run from a source tree without installing: the package sits next to tools/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "Explain in one sentence why a model can run with less memory than its weights."


def prepare(root: Path) -> Path:
    """The demo checkpoint with its packed trunk and tokenizer, made once."""
    from dsv4stream import synth
    from dsv4stream.text.tokenizer import default_pack_path, pack_tokenizer
    from dsv4stream.trunkpack.writer import pack_trunk

    ckpt = root / "checkpoint"
    if not (ckpt / "config.json").is_file():  # make_checkpoint renames a finished directory into place
        t0 = time.perf_counter()
        print(f"demo: writing a generated checkpoint to {ckpt} (once) ...", flush=True)
        synth.make_checkpoint(ckpt, preset="demo", seed=0)
        print(f"demo: done in {time.perf_counter() - t0:.0f} s", flush=True)
    pack_trunk(ckpt, progress=False)  # returns at once when already packed from this checkpoint
    if not default_pack_path(ckpt).is_file():
        pack_tokenizer(ckpt)
    return ckpt


def pick_budget(ckpt: Path, opts_kw: dict) -> tuple[int, int, int]:
    """(budget, checkpoint bytes, smallest budget): the whole trunk resident and a cache of a
    third of the experts."""
    from dsv4stream.checkpoint.catalog import Catalog
    from dsv4stream.run.memory import measure
    from dsv4stream.run.planner import minimum_budget
    from dsv4stream.run.runinfo import RunOptions

    n = measure(ckpt, RunOptions(budget=1, **opts_kw))
    budget = n.trunk_resident_bytes + n.total_experts // 3 * n.slot_bytes
    return budget, Catalog.open(ckpt).nbytes, minimum_budget(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demo_dir", nargs="?", default=".demo", type=Path)
    ap.add_argument("--gen", type=int, default=24)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    import numpy as np

    from dsv4stream import kernels
    from dsv4stream.engine.numerics import RUN_DEFAULT
    from dsv4stream.errors import Dsv4Error
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime
    from dsv4stream.text import chat
    from dsv4stream.text.sampler import SamplingParams, banned_ids, make_pick
    from dsv4stream.text.tokenizer import Tokenizer, default_pack_path

    try:
        kernels.set_backend("fast")  # the numba kernels when they import; else the numpy reference
    except ImportError:
        pass
    if args.prepare_only:
        try:
            prepare(args.demo_dir)
        except Dsv4Error as e:
            print(f"dsv4: {e}", file=sys.stderr)
            return 2
        return 0
    # Writing the checkpoint holds the embedding and head in memory: do it in another
    # process, so this one's peak RSS is the budgeted run's alone.
    done = subprocess.run([sys.executable, __file__, str(args.demo_dir), "--prepare-only"], check=False)
    if done.returncode:
        return done.returncode
    try:
        ckpt = args.demo_dir / "checkpoint"
        kw = {"ctx": 1024, "numerics": RUN_DEFAULT}  # what `dsv4 run` runs, not `dsv4 logits`' default
        budget, size, floor = pick_budget(ckpt, kw)
        tok = Tokenizer.load(default_pack_path(ckpt))
        ids = chat.encode(tok, chat.one_turn(args.prompt))
        print(f"demo: checkpoint {size / 1e9:.2f} GB on disk, --budget {budget / 1e9:.2f} GB")
        with Runtime.open(ckpt, RunOptions(budget=budget, **kw), warn=lambda m: print(f"demo: {m}")) as rt:
            print("\n".join(rt.plan.lines()))
            print(f"\nuser: {args.prompt}")
            print("assistant (random weights, so random text): ", end="", flush=True)
            stream = tok.stream(skip_special=True)
            # greedy over the ids that are text (no padding rows, no reserved placeholders)
            pick = make_pick(SamplingParams(), tok.n_tokens, np.random.default_rng(0), banned_ids(tok))
            for t in rt.generate(rt.session(), ids, args.gen, pick, stop_ids=(tok.special.eos,)):
                print(stream.push(t), end="", flush=True)
            print(stream.flush() + "\n")
            print("\n".join(rt.stats().lines()))
    except Dsv4Error as e:
        print(f"dsv4: {e}", file=sys.stderr)
        return 2
    print("\n".join(next_steps(ckpt, budget, floor)))
    return 0


def next_steps(ckpt: Path, budget: int, floor: int) -> list[str]:
    """What to try next, with the command as it can be typed here (the venv's dsv4)."""
    exe = Path(sys.executable).with_name("dsv4")
    try:
        exe = Path(os.path.relpath(exe))
    except ValueError:
        pass
    dsv4 = str(exe) if exe.exists() else "dsv4"
    b, low = f"{budget / 1e9:.2f}", f"{math.ceil(floor / 1e7) / 100:.2f}"
    todo = [
        (f"{dsv4} {ckpt} --chat --budget {b}", "chat with it (/help inside)"),
        (f"{dsv4} inspect {ckpt} --budget {low} --budget {b}", "how a budget is split"),
        (f"{dsv4} doctor {ckpt}", "this machine, and which --budget"),
    ]
    width = max(len(c) for c, _ in todo)
    return [
        "",
        f"next (dsv4 is {dsv4}; or `source {exe.parent}/activate` once, then plain `dsv4`):",
        *(f"  {c:<{width}}  # {why}" for c, why in todo),
        "then docs/real-models.md for the real models (V4-Flash is about 160 GB on disk).",
    ]


if __name__ == "__main__":
    sys.exit(main())
