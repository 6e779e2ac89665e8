#!/usr/bin/env python3
"""Continuous batching of `dsv4 serve`: concurrent clients against the same requests one after another.

    bench/batching.py CHECKPOINT [--budgets 4,1.2] [--clients 1,2,4,8] [--tokens 24] [--json OUT]

For each budget, starts `dsv4 serve --max-batch <most clients> --keep-states 0` on 127.0.0.1
(no kept states, so a request sent twice is prefilled twice alike), warms it with one request,
then for each client count C sends C different greedy requests (end of sequence pushed away,
so each runs to `--tokens`) first one after another, then all at once from C threads. Prints
per budget and C: aggregate tok/s (generated tokens / wall time of the whole set, prompts
included) both ways and their ratio, the mean per-request tok/s (its tokens / its wall time
as its client saw it), and checks that every answer is the same text both ways. The server's
peak RSS is read from outside (/proc/PID/status VmHWM) at the end of each budget and set
against it; the plan's expert line says whether the experts are all in RAM or stream, and the
server's "decoding at most" line where a streaming budget lowered --max-batch.

The prompts count in both ways: one after another each is read alone; together the batching
server reads the prompts sent at once in shared passes (`engine.batch.forward_many`), so with
short answers reading them together is part of the gain. Each row also gives the seconds the
server spent reading them one after another (its `dsv4_prefill_seconds_total` counter, /metrics)
and the ratio with those seconds taken out of both walls ("decode alone": an upper bound of the
decode passes' own ratio, since the prompts read together took less than those seconds; their
counter there also holds the waits on the others' passes, so it is not used).

The server process's CPU seconds (/proc/PID/stat) both ways are printed too: at one kernel
thread their ratio is the work saved, which a busy machine disturbs much less than the walls
(with more threads it also counts the kernels' idle workers spinning).

Timed window: the client's, request sent to answer read. Only ratios from one run mean
something on a shared machine; give the load (`uptime`) with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

CODE = "from dsv4stream.cli import main; main()"


def post(port: int, body: dict) -> tuple[dict, float]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=7200) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t


def body(k: int, tokens: int, eos: int | None) -> dict:
    b = {"messages": [{"role": "user", "content": f"Request {k}: write about topic number {k}."}],
         "max_tokens": tokens, "temperature": 0}  # fmt: skip
    if eos is not None:
        b["logit_bias"] = {str(eos): -100}
    return b


def text_and_tokens(out: dict) -> tuple[str, int]:
    return out["choices"][0]["message"]["content"] or "", out["usage"]["completion_tokens"]


def prefill_seconds(port: int) -> float:
    """The server's seconds spent reading prompts so far (/metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("dsv4_prefill_seconds_total "):
                return float(line.split()[1])
    return 0.0


def cpu_seconds(pid: int) -> float:
    """The server process's CPU seconds so far (user + system, every thread: /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_gb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def serve(ckpt: str, budget: str, max_batch: int, threads: int | None) -> tuple[subprocess.Popen, int, list[str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["serve", ckpt, "--port", str(port), "--budget", budget, "--keep-states", "0", "--ctx", "1024",
            "--max-batch", str(max_batch)]  # fmt: skip
    if threads:
        args += ["--threads", str(threads)]
    proc = subprocess.Popen([sys.executable, "-c", CODE, *args], stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line.rstrip())
        if "listening on" in line:
            break
    else:
        raise SystemExit(f"server did not start (exit {proc.wait()}):\n" + "\n".join(lines))
    threading.Thread(target=lambda: [lines.append(ln.rstrip()) for ln in proc.stderr], daemon=True).start()
    return proc, port, lines


def run_budget(ckpt: str, budget: str, clients: list[int], tokens: int, eos: int | None, threads: int | None) -> dict:
    proc, port, lines = serve(ckpt, budget, max(clients), threads)
    try:
        post(port, body(999, 4, eos))  # warm: kernels, the head's first reads
        rows = []
        for c in clients:
            bodies = [body(k, tokens, eos) for k in range(c)]
            p0, c0, t0 = prefill_seconds(port), cpu_seconds(proc.pid), time.perf_counter()
            seq = [post(port, b) for b in bodies]
            seq_wall, p1, c1 = time.perf_counter() - t0, prefill_seconds(port), cpu_seconds(proc.pid)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                conc = list(pool.map(lambda b: post(port, b), bodies))
            conc_wall, prompts, c2 = time.perf_counter() - t0, p1 - p0, cpu_seconds(proc.pid)
            same = [text_and_tokens(a[0]) == text_and_tokens(b[0]) for a, b in zip(seq, conc, strict=True)]
            n = sum(text_and_tokens(o)[1] for o, _ in conc)
            row = {
                "clients": c,
                "tokens": n,
                "sequential_tok_s": n / seq_wall,
                "concurrent_tok_s": n / conc_wall,
                "ratio": seq_wall / conc_wall,
                "per_request_sequential_tok_s": sum(text_and_tokens(o)[1] / s for o, s in seq) / c,
                "per_request_concurrent_tok_s": sum(text_and_tokens(o)[1] / s for o, s in conc) / c,
                "identical": all(same),
                "server_cpu_seconds_sequential": c1 - c0,
                "server_cpu_seconds_concurrent": c2 - c1,
                "prompt_seconds": prompts,
                "decode_alone_ratio": (seq_wall - prompts) / max(conc_wall - prompts, 1e-9),
            }
            rows.append(row)
            print(
                f"  budget {budget} GB, {c} client(s): {row['sequential_tok_s']:.2f} tok/s one after another,"
                f" {row['concurrent_tok_s']:.2f} together ({row['ratio']:.2f}x); per request"
                f" {row['per_request_sequential_tok_s']:.2f} -> {row['per_request_concurrent_tok_s']:.2f} tok/s;"
                f" answers {'identical' if row['identical'] else 'DIFFERENT'}; prompts {prompts:.2f} s of"
                f" {seq_wall:.2f} one after another (out of both walls: {row['decode_alone_ratio']:.2f}x); server CPU"
                f" {c1 - c0:.2f} s -> {c2 - c1:.2f} s ({(c1 - c0) / max(c2 - c1, 1e-9):.2f}x)",
                flush=True,
            )
        plan = [
            ln for ln in lines if any(k in ln for k in ("experts:", "planned total", "serving:", "decoding at most"))
        ]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stats", timeout=60) as r:
            threads = json.loads(r.read()).get("decode_threads", {})
        if threads:  # the governor's choice (no --threads): passes per kernel thread count
            plan.append(f"decode steps and passes by kernel threads {threads}")
        return {"budget": budget, "rows": rows, "peak_rss_gb": peak_rss_gb(proc.pid), "plan": plan, "threads": threads}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--budgets", default="4,1.2", help="GB, comma-separated (one in RAM, one streaming)")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None, help="kernel threads of the server (default: its own)")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    clients = [int(c) for c in a.clients.split(",")]
    eos = None  # a checkpoint without a tokenizer: no bias, answers may end early
    if os.path.exists(os.path.join(a.checkpoint, "tokenizer.json")):
        from dsv4stream.text.tokenizer import Tokenizer

        eos = Tokenizer.from_checkpoint(a.checkpoint).special.eos
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    out = {"checkpoint": a.checkpoint, "tokens": a.tokens, "load_before": load, "budgets": []}
    for b in a.budgets.split(","):
        got = run_budget(a.checkpoint, b, clients, a.tokens, eos, a.threads)
        within = "within" if got["peak_rss_gb"] <= float(b) else "OVER"
        print(
            "  " + " | ".join(got["plan"]) + f" | peak RSS {got['peak_rss_gb']:.2f} GB ({within} --budget {b})",
            flush=True,
        )
        out["budgets"].append(got)
    out["load_after"] = os.getloadavg()
    print(f"load average after: {out['load_after'][0]:.2f}", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
