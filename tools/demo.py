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
    from dsv4stream.pack import pack_trunk
    from dsv4stream.tokenizer import default_pack_path, pack_tokenizer

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


def pick_budget(ckpt: Path, opts_kw: dict) -> tuple[int, int]:
    """(budget, checkpoint bytes): the whole trunk resident and a cache of a third of the experts."""
    from dsv4stream.catalog import Catalog
    from dsv4stream.runtime import RunOptions, measure

    n = measure(ckpt, RunOptions(budget=1, **opts_kw))
    return n.trunk_resident_bytes + n.total_experts // 3 * n.slot_bytes, Catalog.open(ckpt).nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demo_dir", nargs="?", default=".demo", type=Path)
    ap.add_argument("--gen", type=int, default=24)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    from dsv4stream import chat, kernels
    from dsv4stream.errors import Dsv4Error
    from dsv4stream.runtime import RunOptions, Runtime
    from dsv4stream.tokenizer import Tokenizer, default_pack_path

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
        kw = {"ctx": 1024}
        budget, size = pick_budget(ckpt, kw)
        tok = Tokenizer.load(default_pack_path(ckpt))
        ids = chat.encode(tok, chat.one_turn(args.prompt))
        print(f"demo: checkpoint {size / 1e9:.2f} GB on disk, --budget {budget / 1e9:.2f} GB")
        with Runtime.open(ckpt, RunOptions(budget=budget, **kw), warn=lambda m: print(f"demo: {m}")) as rt:
            print("\n".join(rt.plan.lines()))
            print(f"\nuser: {args.prompt}")
            print("assistant (random weights, so random text): ", end="", flush=True)
            stream = tok.stream(skip_special=True)
            pick = lambda logits: int(logits[: tok.n_tokens].argmax())  # greedy over real tokens
            for t in rt.generate(rt.session(), ids, args.gen, pick, stop_ids=(tok.special.eos,)):
                print(stream.push(t), end="", flush=True)
            print(stream.flush() + "\n")
            print("\n".join(rt.stats().lines()))
    except Dsv4Error as e:
        print(f"dsv4: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
