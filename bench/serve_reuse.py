#!/usr/bin/env python3
"""Prefix reuse of `dsv4 serve`: the second turn of a chat with and without kept states.

    bench/serve_reuse.py CHECKPOINT [--budget GB] [--words N]

Starts `dsv4 serve` twice on 127.0.0.1 (default `--keep-states 4`, then `--keep-states 0`),
sends the same two greedy turns to each (a first user message of N listed items, then a
short follow-up, `max_tokens` 4) and prints one line per server. Timed window: each
request's wall time as the client sees it (prefill + 4 decode steps); the figure that
matters is turn 2, whose prompt extends turn 1's. A ratio against the machine's own limit
does not apply here: the point is the prefill that reuse avoids.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request


def post(port: int, messages: list[dict]) -> tuple[dict, float]:
    body = json.dumps({"messages": messages, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t


def run(ckpt: str, budget: str, keep: int, words: int) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["serve", ckpt, "--port", str(port), "--budget", budget, "--keep-states", str(keep)]
    code = "from dsv4stream.cli import main; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if "listening on" in line:
                break
        else:
            raise SystemExit(f"server did not start (exit {proc.wait()})")
        text = " ".join(f"item{i} is listed here." for i in range(words))
        m1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]
        r1, s1 = post(port, m1)
        m2 = [*m1, {"role": "assistant", "content": r1["choices"][0]["message"]["content"] or ""}]
        r2, s2 = post(port, [*m2, {"role": "user", "content": "Summarise."}])
        u1, u2 = r1["usage"], r2["usage"]
        return (
            f"keep-states {keep}: turn 1 {u1['prompt_tokens']} tokens in {s1:.2f} s;"
            f" turn 2 {u2['prompt_tokens']} tokens ({u2['prompt_tokens_details']['cached_tokens']} cached)"
            f" in {s2:.2f} s"
        )
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--budget", default="1.5")
    ap.add_argument("--words", type=int, default=150)
    args = ap.parse_args()
    for keep in (4, 0):
        print(run(args.checkpoint, args.budget, keep, args.words), flush=True)


if __name__ == "__main__":
    main()
