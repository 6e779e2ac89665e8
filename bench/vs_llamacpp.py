"""dsv4 against llama.cpp on one generated checkpoint: decode and prefill tok/s and peak memory,
with the model in RAM and under a memory limit below the model's size, in one run.

Inputs: a llama.cpp build (`--llama BUILD_DIR` holding bin/llama-bench and bin/llama-simple), the
GGUF that llama.cpp's own convert_hf_to_gguf.py wrote from `CHECKPOINT` (docs/performance.md says
how both are made), and the checkpoint itself. Each measurement is a fresh child process; the two
programs alternate (llama.cpp, dsv4, llama.cpp, dsv4, ... `--repeat` rounds) so that a change in
the machine's load hits both. Per figure the median over rounds is printed, with the ratio dsv4 /
llama.cpp (tok/s: above 1 is dsv4 faster; memory: below 1 is dsv4 smaller).

Regimes:
- in RAM (warm): llama-bench with its defaults (load mode auto, CPU weight repacking, one warm-up
  run first), `-p 128,512,2048 -n GEN -r 1` per round; with `--llama-repack 0`, `--repack 0` (no
  extra buffer types: on a CPU with AMX, llama.cpp 0.3.36's AMX / repack buffers abort on this
  model's graph, `GGML_ASSERT(*cur_backend_id != -1)`, llama-simple included: docs/performance.md). dsv4 at `--budget-ram` (every expert fits):
  one process opens the run, prefills a warm-up prompt of the longest length so every expert it
  routes to is cached (random ids touch nearly all), then times a fresh session's prefill of each
  length (`Session.prefill(ids, last_only=True)`: prompt in, last logits out) and GEN greedy
  decode steps after a one-token prompt. Peak memory: `/usr/bin/time`'s maximum RSS.
- limited (cold): both inside a cgroup limited to `--limit` GB (memory.max / memory.limit_in_bytes,
  page cache counted; `measure/memlimit.py`), the GGUF's and the checkpoint's pages dropped from
  the page cache before each run. llama.cpp memory-maps the GGUF without repacking (`-lm mmap
  --repack 0`, what fits in a limit below the model), `-p LIMITED_LENGTH -n GEN`, its warm-up run
  included (under the limit the pages it touched do not stay). dsv4 at `--budget-limited`,
  experts read from disk: one run started cold times a fresh session's prefill of each
  LIMITED_LENGTH (random ids; as llama-bench does, later lengths find what earlier ones left
  cached), then GEN decode steps. Peak memory: the cgroup's peak charge (anonymous memory plus page cache) for both.
  With `--defaults-too`, llama.cpp with its defaults (repacked weights) is also run under the
  limit: on a model larger than the limit it is killed (out of memory).
Prompts are random token ids (fixed seed) for both: llama-bench's prompts are random too, and the
experts a prompt routes to decide what dsv4 reads.

dsv4 runs with `--numerics` (default fast, the commands' default: int8 / BF16 activations on
the CPU's dot-product instructions, docs/numerics.md); the numerics each child ran is printed,
with the CPU model, its SIMD features, the kernel variants and the load.

Agreement: before the figures, llama-simple greedy-decodes `--check-tokens` tokens after a short
text prompt and dsv4 does the same from the same ids (BOS + the prompt's tokens); the bytes of the
generated tokens' pieces must match, else the run stops (the two would not be running one model).
With `--check-agree N` the first N must (random weights leave near-ties that a different
summation order flips: llama.cpp without its repacked buffers parts from dsv4 at the second
token on M5, where dsv4 fast and exact still print what llama.cpp printed on M3).

    python bench/vs_llamacpp.py CHECKPOINT --gguf /work/peer/flash-experts.gguf --llama /work/peer/llama.cpp/build
        [--numerics fast] [--threads 2] [--lengths 128,512,2048] [--limited-lengths 128,512] [--gen 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

GB = 1e9
SEED = 1234
CHECK_PROMPT = "The quick brown fox jumps over the lazy dog."


# ---- dsv4 children ---------------------------------------------------------------------------------


def dsv4_child(args: argparse.Namespace) -> dict:
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    opts = RunOptions(budget=int(args.budget * GB), threads=args.threads, numerics=args.numerics)
    out: dict = {}
    with Runtime.open(args.checkpoint, opts) as rt:
        out["numerics"] = rt.stats().numerics
        vocab = rt.cfg.vocab_size
        rng = np.random.default_rng(SEED)
        if args.mode == "check":
            ids = [int(i) for i in json.loads(args.ids)]
            session = rt.session()
            logits = session.prefill(ids, last_only=True)
            got = []
            for _ in range(args.gen):
                got.append(int(np.argmax(logits)))
                logits = session.step(got[-1])
            return {"ids": got, "numerics": out["numerics"]}
        lengths = [int(n) for n in args.lengths.split(",")]
        if args.mode == "warm":
            rt.session().prefill(rng.integers(2, vocab, size=max(lengths)), last_only=True)
        timed_read = 0  # expert bytes read inside the timed windows: 0 when warm means every expert was cached
        for n in lengths:
            ids = rng.integers(2, vocab, size=n)
            session = rt.session()
            b0, t0 = rt.store.stats().bytes_read, time.perf_counter()
            session.prefill(ids, last_only=True)
            out[f"pp{n}"] = n / (time.perf_counter() - t0)
            timed_read += rt.store.stats().bytes_read - b0
        session = rt.session()
        logits = session.prefill([int(rng.integers(2, vocab))], last_only=True)
        b0, t0 = rt.store.stats().bytes_read, time.perf_counter()
        for _ in range(args.gen):
            logits = session.step(int(np.argmax(logits)))
        out[f"tg{args.gen}"] = args.gen / (time.perf_counter() - t0)
        s = rt.store.stats()
        out["timed_expert_bytes_read"] = timed_read + s.bytes_read - b0
        out["expert_bytes_read"] = s.bytes_read
        out["cache_slots"] = s.slots
    return out


# ---- running both ----------------------------------------------------------------------------------


def timed(cmd: list[str], limit: float | None, evict: list[str]) -> tuple[int, str, str, int, bool]:
    """(returncode, stdout, stderr, peak bytes, killed by OOM): under /usr/bin/time (max RSS) in RAM,
    in a limited cgroup (its peak charge) otherwise."""
    from dsv4stream.measure import memlimit

    for path in evict:
        memlimit.evict(path)
    if limit is None:
        p = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M", *cmd], capture_output=True, text=True, check=False)
        m = re.findall(r"maxrss_kb=(\d+)", p.stderr)
        return p.returncode, p.stdout, p.stderr, int(m[-1]) * 1024 if m else 0, False
    r = memlimit.run_limited(cmd, int(limit * GB))
    return r.returncode, r.stdout, r.stderr, r.peak_bytes, r.oom_killed


def llama_bench(a: argparse.Namespace, lengths: list[int], limit: float | None, defaults: bool) -> dict:
    cmd = [str(Path(a.llama) / "bin" / "llama-bench"), "-m", a.gguf, "-t", str(a.threads), "-r", "1", "-o", "json"]
    cmd += ["-p", ",".join(map(str, lengths)), "-n", str(a.gen)]
    if limit is not None and not defaults:
        cmd += ["-lm", "mmap", "--repack", "0"]
    elif limit is None and not a.llama_repack:
        cmd += ["--repack", "0"]
    rc, out, err, peak, oom = timed(cmd, limit, [a.gguf] if limit is not None else [])
    if rc != 0:
        return {
            "error": "killed (out of memory)" if oom else (err.strip().splitlines() or ["failed"])[-1],
            "peak": peak,
        }
    rec: dict = {"peak": peak}
    for test in json.loads(out):
        key = f"pp{test['n_prompt']}" if test["n_prompt"] else f"tg{test['n_gen']}"
        rec[key] = float(test["avg_ts"])
    return rec


def dsv4(a: argparse.Namespace, mode: str, lengths: list[int], budget: float, limit: float | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), a.checkpoint, "--child", mode, "--budget", f"{budget:g}"]
    cmd += ["--lengths", ",".join(map(str, lengths)), "--gen", str(a.gen), "--threads", str(a.threads)]
    cmd += ["--numerics", a.numerics]
    rc, out, err, peak, oom = timed(cmd, limit, [a.checkpoint] if limit is not None else [])
    if rc != 0:
        return {
            "error": "killed (out of memory)" if oom else (err.strip().splitlines() or ["failed"])[-1],
            "peak": peak,
        }
    rec = json.loads(out.strip().splitlines()[-1])
    rec["peak"] = peak
    return rec


def agreement(a: argparse.Namespace) -> str:
    """The first greedy tokens of both, compared as the bytes of their pieces."""
    from dsv4stream.text.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(a.checkpoint)
    # BOS spelled in the prompt: llama-simple parses control tokens, and the GGUF keeps the
    # checkpoint's add_bos_token (false), so it would not add one itself
    text = tok.token_text(tok.special.bos) + CHECK_PROMPT
    ids = tok.encode(text)
    if ids[0] != tok.special.bos:
        sys.exit(f"the check prompt does not start with BOS: {ids[:3]}")
    cmd = [str(Path(a.llama) / "bin" / "llama-simple"), "-m", a.gguf, "-n", str(a.check_tokens), text]
    p = subprocess.run(cmd, capture_output=True, check=False)
    if p.returncode:
        sys.exit(f"llama-simple failed: {p.stderr.decode(errors='replace').strip().splitlines()[-1:]}")
    theirs = p.stdout.rstrip(b"\n")
    prompt = b"".join(piece_bytes(tok, i) for i in ids)
    if not theirs.startswith(prompt):
        sys.exit(f"llama.cpp tokenized the prompt otherwise: {theirs[: len(prompt) + 20]!r} vs {prompt!r}")
    child = [
        sys.executable,
        os.path.abspath(__file__),
        a.checkpoint,
        "--child",
        "check",
        "--budget",
        f"{a.budget_ram:g}",
    ]
    child += ["--gen", str(a.check_tokens), "--ids", json.dumps(ids), "--threads", str(a.threads)]
    child += ["--numerics", a.numerics]
    c = subprocess.run(child, capture_output=True, text=True, check=False)
    if c.returncode:
        sys.exit(f"dsv4 failed: {(c.stderr.strip().splitlines() or ['?'])[-1]}")
    rec = json.loads(c.stdout.strip().splitlines()[-1])
    ours_ids = rec["ids"]
    theirs = theirs[len(prompt) :]
    same = agreeing(tok, theirs, ours_ids)
    ours_ids, ours = printed(tok, ours_ids)
    need = a.check_agree if a.check_agree is not None else len(ours_ids)
    if same < need or (a.check_agree is None and theirs != ours):
        sys.exit(f"the greedy tokens differ: llama.cpp {theirs!r}, dsv4 {ours!r} (ids {ours_ids})")
    if theirs == ours:
        return f"first {len(ours_ids)} greedy tokens agree (dsv4 numerics {rec['numerics']}): {ours!r}"
    return (
        f"first {same} of {len(ours_ids)} greedy tokens agree (--check-agree {need}; dsv4 numerics"
        f" {rec['numerics']}): llama.cpp {theirs!r}, dsv4 {ours!r}"
    )


def printed(tok, ids: list[int]) -> tuple[list[int], bytes]:
    """What llama-simple prints for generated ids: it stops at EOS without printing it."""
    if tok.special.eos in ids:
        ids = ids[: ids.index(tok.special.eos)]
    return ids, b"".join(piece_bytes(tok, i) for i in ids)


def agreeing(tok, theirs: bytes, ids: list[int]) -> int:
    """How many of the leading ids print (as llama-simple would) a prefix of `theirs`."""
    same = 0
    for i in range(1, len(ids) + 1):
        if not theirs.startswith(printed(tok, ids[:i])[1]):
            break
        same = i
    return same


_BYTE_OF: dict[str, int] = {}


def piece_bytes(tok, token_id: int) -> bytes:
    """A token's bytes as llama.cpp prints them: byte-level BPE pieces mapped back from the
    printable alphabet they are stored in; special tokens as their text."""
    if not _BYTE_OF:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        extra = 0
        for b in range(256):
            if b in printable:
                _BYTE_OF[chr(b)] = b
            else:
                _BYTE_OF[chr(256 + extra)] = b
                extra += 1
    text = tok.token_text(token_id)
    if token_id in set(tok.special_ids()):
        return text.encode()
    return bytes(_BYTE_OF[ch] for ch in text) if all(ch in _BYTE_OF for ch in text) else text.encode()


def median(recs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in recs if key in r]
    return statistics.median(vals) if vals else None


def row(name: str, theirs: float | None, ours: float | None, unit: str, higher_better: bool = True) -> str:
    def fmt(v: float | None) -> str:
        return "—" if v is None else (f"{v / GB:.2f} GB" if unit == "GB" else f"{v:.2f} {unit}")

    ratio = "—" if not theirs or not ours else f"{ours / theirs:.2f}"
    return f"| {name} | {fmt(theirs)} | {fmt(ours)} | {ratio} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--gguf", required=False)
    ap.add_argument("--llama", required=False, help="llama.cpp build folder (bin/llama-bench, bin/llama-simple)")
    ap.add_argument("--lengths", default="128,512,2048", help="prefill lengths in RAM")
    ap.add_argument("--limited-lengths", default="128,512", help="prefill lengths under the limit")
    ap.add_argument("--gen", type=int, default=32, help="decode steps timed")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=3, help="alternating rounds")
    ap.add_argument("--budget-ram", type=float, default=10.0, help="dsv4 --budget with the model in RAM (GB)")
    ap.add_argument("--limit", type=float, default=2.6, help="memory limit of the limited regime (GB)")
    ap.add_argument("--budget-limited", type=float, default=2.2, help="dsv4 --budget under the limit (GB)")
    ap.add_argument("--check-tokens", type=int, default=7)
    ap.add_argument(
        "--check-agree",
        type=int,
        default=None,
        help="leading greedy tokens that must agree (default: all); random weights give near-ties",
    )
    ap.add_argument("--numerics", default="fast", help="dsv4's --numerics: exact, official or fast (the default)")
    ap.add_argument(
        "--llama-repack",
        type=int,
        choices=(0, 1),
        default=1,
        help="llama.cpp's extra buffer types (CPU repack, AMX) in RAM: 1 its default; 0 where they abort",
    )
    ap.add_argument("--defaults-too", action="store_true", help="also run llama.cpp's defaults under the limit")
    ap.add_argument("--json", help="also write every record here")
    ap.add_argument("--child", choices=("warm", "cold", "check"), help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        a.mode = a.child
        print(json.dumps(dsv4_child(a)))
        return
    if not a.gguf or not a.llama:
        ap.error("--gguf and --llama are required")
    from dsv4stream.measure.machine import machine_line

    lengths = [int(n) for n in a.lengths.split(",")]
    limited = [int(n) for n in a.limited_lengths.split(",")]
    gguf_bytes = os.path.getsize(a.gguf)
    from dsv4stream.kernels import cpu

    print(f"# machine: {machine_line()} threads={a.threads}; kernel targets: {cpu.describe()}")
    print(f"# gguf {a.gguf} {gguf_bytes / GB:.2f} GB; checkpoint {a.checkpoint}; limit {a.limit:g} GB")
    print(
        f"# llama.cpp in RAM: --repack {a.llama_repack} ({'its default' if a.llama_repack else 'no extra buffer types'})"
    )
    print(f"# {agreement(a)}")
    recs: dict[str, list[dict]] = {k: [] for k in ("llama_ram", "dsv4_ram", "llama_lim", "dsv4_lim", "llama_def")}
    for r in range(a.repeat):
        recs["llama_ram"].append(llama_bench(a, lengths, None, True))
        recs["dsv4_ram"].append(dsv4(a, "warm", lengths, a.budget_ram, None))
        recs["llama_lim"].append(llama_bench(a, limited, a.limit, False))
        recs["dsv4_lim"].append(dsv4(a, "cold", limited, a.budget_limited, a.limit))
        if a.defaults_too and r == 0:
            recs["llama_def"].append(llama_bench(a, limited[:1], a.limit, True))
        print(f"# round {r + 1}/{a.repeat} done, load {os.getloadavg()[0]:.2f}", flush=True)
    for k, v in recs.items():
        for rec in v:
            if "error" in rec:
                print(f"# {k}: {rec['error']}")
    lr, dr, ll, dl = recs["llama_ram"], recs["dsv4_ram"], recs["llama_lim"], recs["dsv4_lim"]
    used = sorted({r["numerics"] for r in recs["dsv4_ram"] + recs["dsv4_lim"] if "numerics" in r})
    print(f"# dsv4 numerics: {', '.join(used) or '?'} (asked for: {a.numerics})")
    print("\n| | llama.cpp | dsv4 | dsv4 / llama.cpp |\n|---|---|---|---|")
    print(
        row(
            f"decode, in RAM (dsv4 --budget {a.budget_ram:g})",
            median(lr, f"tg{a.gen}"),
            median(dr, f"tg{a.gen}"),
            "tok/s",
        )
    )
    for n in lengths:
        print(row(f"prefill {n} tokens, in RAM", median(lr, f"pp{n}"), median(dr, f"pp{n}"), "tok/s"))
    print(row("peak RSS, in RAM", median(lr, "peak"), median(dr, "peak"), "GB", higher_better=False))
    lim = f"limit {a.limit:g} GB (llama.cpp mmap, no repack; dsv4 --budget {a.budget_limited:g})"
    print(row(f"decode, {lim}", median(ll, f"tg{a.gen}"), median(dl, f"tg{a.gen}"), "tok/s"))
    for n in limited:
        print(row(f"prefill {n} tokens, {lim}", median(ll, f"pp{n}"), median(dl, f"pp{n}"), "tok/s"))
    print(row("peak memory charged, limited", median(ll, "peak"), median(dl, "peak"), "GB", higher_better=False))
    if recs["llama_def"]:
        d = recs["llama_def"][0]
        print(f"| llama.cpp defaults (repacked) under the limit | {d.get('error') or 'ran'} | — | — |")
    print(f"\n# load_avg after: {','.join(f'{x:.2f}' for x in os.getloadavg())}")
    if a.json:
        Path(a.json).write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
