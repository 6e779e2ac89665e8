#!/usr/bin/env python3
"""A batching server's request that drafts again once alone (issue 41, `worker._SoloDrafts`), in process.

    bench/speculate_rejoin.py [CHECKPOINT] [--gen 96] [--speculate 2|auto] [--real] [--rounds 3]

A batching `Worker` (--max-batch 4) on a V4.1 checkpoint (default: a generated tiny-v41, seed 1,
made in a temporary folder) takes a short greedy request (`off`, 8 tokens) and a long one
(`--speculate`, --gen tokens) at once, so the long one is taken beside the short one and decodes
in batched passes. Two ways, alternating in this one process, `--rounds` times each:
`rejoin` (the server's: it drafts again `worker.SETTLE` boundaries after the short one has ended)
and `never` (`SETTLE` set past the reply: it stays in batched passes, what a request taken beside
another did before). The drafter is a STAND-IN that proposes the long request's own greedy ids
(every draft right), unless --real (the checkpoint's own drafter; random weights accept almost
nothing). Every round must give `off`'s ids (checked). Prints per round: the wall and the process
CPU seconds from the submits to both answers, and the long request's main-model passes: those of
the batch (`Usage.batch_passes`) and its own (its drafting calls' one-token prompts, cycles and
re-feeds, from their records; tests/test_server_speculate_rejoin.py checks, by counting the
session's calls, that nothing else runs). Give the load with the figures (printed before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from dsv4stream import synth
from dsv4stream.engine.speculate_v41 import ScriptedDrafter
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.server import worker as W
from dsv4stream.server.cache import StateCache
from dsv4stream.server.reply import ReplyStream
from dsv4stream.text.sampler import SamplingParams
from dsv4stream.text.tokenizer import Tokenizer
from dsv4stream.text.vocab import write_tokenizer_files

SHORT = 8
P_LONG, P_SHORT = [5, 17, 99, 5, 17, 200, 3, 44], [7, 8, 9, 10, 11]


def release_tokenizer(d: Path) -> Tokenizer:
    """The V4.1 release tokenizer (it decodes a generated checkpoint's ids too)."""
    write_tokenizer_files(d, "v41")
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": {"vocab_size": 129280}}))
    return Tokenizer.from_checkpoint(d)


def send(w: W.Worker, tok: Tokenizer, prompt: list[int], n: int, speculate):
    done, got = threading.Event(), []

    class Kept(ReplyStream):
        def push(self, token_id: int):
            got.append(token_id)
            return super().push(token_id)

    reply = Kept(tok, thinking=False, tools=False, eos=-1)  # no stop before n tokens
    job = W.Job(list(prompt), n, SamplingParams(0.0), reply,
                lambda kind, _: done.set() if kind in ("done", "error") else None, speculate=speculate)  # fmt: skip
    w.submit(job)
    return done, got, job


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", nargs="?", help="a V4.1 checkpoint (default: a generated tiny-v41)")
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--speculate", default="2")
    ap.add_argument("--real", action="store_true", help="the checkpoint's own drafter, not the stand-in")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    spec = int(a.speculate) if a.speculate.isdigit() else a.speculate
    with tempfile.TemporaryDirectory() as tmp:
        ck = Path(a.checkpoint) if a.checkpoint else synth.make_checkpoint(Path(tmp) / "ck", "tiny-v41", seed=1)
        (Path(tmp) / "tok").mkdir()
        tok = release_tokenizer(Path(tmp) / "tok")
        with Runtime.open(ck, RunOptions(budget=10**9, io="buffered", ctx=512, threads=1)) as rt:

            def worker() -> W.Worker:
                return W.Worker(rt, rt.cfg.vocab_size, StateCache(0), None, lambda _: None, [], tok.decode,
                                tok.special.user, max_batch=4)  # fmt: skip

            w = worker()
            done, off, _ = send(w, tok, P_LONG, a.gen, "off")
            done.wait()
            w.close()
            full = [*P_LONG, *off]
            if not a.real:
                block = rt.cfg.dspark.block_size
                rt.speculator.drafter = lambda s: ScriptedDrafter(lambda pos, t, k: full[pos + 2 : pos + 2 + k], block)
            print(f"load {load()}; drafter {'the checkpoint' if a.real else 'STAND-IN (always right)'}, "
                  f"speculate {spec}, {a.gen} tokens", flush=True)  # fmt: skip
            for r in range(a.rounds):
                for way, settle in (("rejoin", W.SETTLE), ("never", a.gen + 1)):
                    saved, W.SETTLE = W.SETTLE, settle
                    w, turns0 = worker(), len(rt.engine.phases.turns)
                    t0, c0 = time.perf_counter(), time.process_time()
                    (d1, _, _), (d2, got, job) = send(w, tok, P_SHORT, SHORT, "off"), send(w, tok, P_LONG, a.gen, spec)
                    d1.wait()
                    d2.wait()
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    counts = w.stats.speculation()
                    calls = [t.speculation for t in rt.engine.phases.turns[turns0:] if t.speculation is not None]
                    own = len(calls) + sum(
                        c.cycles + c.refeeds for c in calls
                    )  # at most: a re-feed may ride a cycle's pass
                    w.close()
                    W.SETTLE = saved
                    if got != off:
                        raise SystemExit(f"round {r} {way}: ids differ from off's")
                    print(f"round {r} {way:6s} wall {wall:6.2f} s  cpu {cpu:6.2f} s  long request: batch passes "
                          f"{job.usage.batch_passes:3d}, own passes {own:3d}, drafted "
                          f"{counts.drafted if counts else 0}", flush=True)  # fmt: skip
            print(f"load {load()}", flush=True)


if __name__ == "__main__":
    main()
