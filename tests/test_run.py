"""`dsv4 run` end to end on generated checkpoints: the stats JSON, the route log, --verify,
the plan and its warnings, text prompts through the tokenizer, and one-line errors."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numba
import pytest
from cli_runs import dsv4
from click.testing import CliRunner
from store_files import o_direct_refusal

from dsv4stream import kernels, synth
from dsv4stream.cli.run import run as run_cmd
from dsv4stream.engine.numerics import RUN_DEFAULT  # what `dsv4 run` / `serve` compute with
from dsv4stream.engine.session import Engine
from dsv4stream.run import planner
from dsv4stream.run.memory import measure
from dsv4stream.run.runinfo import RunOptions

FIELDS = (
    "generated_ids", "expert_requests", "expert_hits", "expert_misses", "bytes_read", "verified_reads",
    "verify_mismatches", "cache_slots", "working_set_experts", "peak_rss_bytes", "budget_bytes", "io_mode",
    "prefill_seconds", "decode_seconds_per_token",
)  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return synth.make_checkpoint(tmp_path_factory.mktemp("r") / "tiny", preset="tiny", seed=5)


def gb(ckpt: Path, slots: int) -> str:
    """--budget (GB) giving `slots` expert slots with the whole trunk resident, at the default overhead."""
    n = measure(ckpt, RunOptions(budget=1))
    return f"{math.ceil(planner.budget_for(n, slots) / 1e3) / 1e6:.9f}"


def invoke(*args: str):
    res = CliRunner().invoke(run_cmd, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res


def test_stats_json_route_log_and_verify(ckpt, tmp_path) -> None:
    stats, route = tmp_path / "stats.json", tmp_path / "route.log"
    res = invoke(
        str(ckpt), "--prompt-ids", "1,2,3,4,5", "--gen", "6", "--greedy", "--budget", gb(ckpt, 32),
        "--verify", "--stats-json", str(stats), "--route-log", str(route),
    )  # fmt: skip
    s = json.loads(stats.read_text())
    assert all(f in s for f in FIELDS)
    want = list(Engine.open(ckpt, numerics=RUN_DEFAULT).session().generate([1, 2, 3, 4, 5], 6))
    assert s["generated_ids"] == want and res.stdout.strip() == ",".join(map(str, want))
    assert s["verified_reads"] == s["expert_misses"] > 0 and s["verify_mismatches"] == 0
    assert len(route.read_text().splitlines()) == s["expert_requests"] == s["expert_hits"] + s["expert_misses"]
    assert s["cache_slots"] == 32 and s["working_set_experts"] == 8
    # O_DIRECT must work where the file system takes it; elsewhere the fallback is reported
    refused = o_direct_refusal(ckpt)
    assert (s["io_mode"], s["io_fallback_files"] == 0) == (
        ("direct (buffered fallback)", False) if refused else ("direct", True)
    ), refused
    assert s["budget_bytes"] == int(float(gb(ckpt, 32)) * 1e9) and s["peak_rss_bytes"] > 0
    assert s["prefill_seconds"] > 0 and s["decode_seconds_per_token"] > 0
    assert "planned total" in res.stderr and "peak RSS" in res.stderr


def test_decode_profile_in_stats_and_json(ckpt, tmp_path) -> None:
    """--stats shows where decode time went; --stats-json has the same phases, which add up to
    the decode step time (the sampler is outside the step)."""
    from dsv4stream.engine.phases import PROFILE_PHASES

    stats = tmp_path / "stats.json"
    res = invoke(
        str(ckpt), "--prompt-ids", "1,2,3", "--gen", "8", "--greedy", "--budget", gb(ckpt, 3),
        "--stats", "--stats-json", str(stats),
    )  # fmt: skip
    s = json.loads(stats.read_text())
    p = s["decode_profile"]
    assert tuple(p) == PROFILE_PHASES and all(v >= 0 for v in p.values())
    assert p["experts"] > 0 and p["trunk"] > 0 and p["head"] > 0 and p["sampler"] > 0
    step = sum(v for k, v in p.items() if k != "sampler")
    assert step == pytest.approx(s["decode_seconds_per_token"], rel=0.02, abs=1e-4)
    assert "decode per token" in res.stderr and "waiting on expert reads" in res.stderr


def test_below_the_working_set_warns_with_the_amount_and_keeps_the_ids(ckpt, tmp_path) -> None:
    stats = tmp_path / "s.json"
    # a 4-token segment: with the default 64, the smallest pool already holds 13 of these tiny slots
    n = measure(ckpt, RunOptions(budget=1, prefill_segment=4))
    budget = f"{math.ceil(planner.budget_for(n, 5) / 1e3) / 1e6:.9f}"
    res = invoke(str(ckpt), "--prompt-ids", "7,8,9", "--gen", "5", "--budget", budget, "--io", "buffered",
                 "--prefill-segment", "4", "--stats-json", str(stats))  # fmt: skip
    assert "working set of 8" in res.stderr and "add " in res.stderr and " to --budget" in res.stderr
    s = json.loads(stats.read_text())
    assert s["cache_slots"] == 5 and s["io_mode"] == "buffered"
    assert s["generated_ids"] == list(Engine.open(ckpt, numerics=RUN_DEFAULT).session().generate([7, 8, 9], 5))


def test_errors_are_one_line(ckpt, tmp_path) -> None:
    r = dsv4("run", str(ckpt), "--prompt-ids", "1,2", "--budget", "0.01")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    floor = planner.minimum_budget(measure(ckpt, RunOptions(budget=1)))
    assert r.stderr.startswith("dsv4: --budget 0.01 GB is below the minimum of") and "raise --budget" in r.stderr
    assert planner.gb_up(floor) in r.stderr  # rounded up, as the message prints a minimum
    r = dsv4("run", str(ckpt), "--gen", "2")
    assert r.returncode == 2 and r.stderr.startswith("dsv4: give --prompt TEXT, --prompt-file F or --prompt-ids")
    r = dsv4("run", str(tmp_path), "--prompt-ids", "1")
    assert r.returncode == 2 and "not a checkpoint directory" in r.stderr


def test_text_prompt_with_the_real_vocabulary(tmp_path) -> None:
    ck = synth.make_checkpoint(tmp_path / "vocab", preset="tiny", vocab_size=synth.REAL_VOCAB)
    stats = tmp_path / "s.json"
    res = invoke(str(ck), "--prompt", "Hello there", "--gen", "4", "--budget", "1", "--stats-json", str(stats))
    s = json.loads(stats.read_text())
    from dsv4stream.text.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(ck)
    assert s["prompt_tokens"] == 1 + len(tok.encode("Hello there"))
    assert res.stdout == tok.decode(s["generated_ids"]) + "\n"


def test_decode_reads_per_token_leave_the_prefill_out(ckpt) -> None:
    """The report's per-token bytes are the decode steps' reads only: a run that stops after its
    first token read exactly the prefill's bytes, and the longer run's extra bytes are the steps'."""
    from dsv4stream.run.report import report_lines
    from dsv4stream.run.runtime import Runtime
    from dsv4stream.store.rowcache import RowStats

    opts = RunOptions(budget=int(float(gb(ckpt, 3)) * 1e9), io="buffered")
    with Runtime.open(ckpt, opts) as rt:
        list(rt.generate(rt.session(), [4, 5, 6], 1))
        prefill = rt.stats()
    assert prefill.decode_tokens == 0 and prefill.decode_expert_bytes_per_token == 0.0
    with Runtime.open(ckpt, opts) as rt:
        list(rt.generate(rt.session(), [4, 5, 6], 7))
        s = rt.stats()
    assert s.decode_tokens == 6 and s.bytes_read > prefill.bytes_read
    assert s.decode_expert_bytes_per_token * 6 == pytest.approx(s.bytes_read - prefill.bytes_read)
    assert s.decode_engram_bytes_per_token == 0.0 and s.engram_cache_rows == 0  # V4: no Engram
    line = next(x for x in report_lines(s) if x.startswith("read per token"))
    assert "of experts per decode step (over 6 steps)" in line and "Engram" not in line
    rows = RowStats(
        requests=48, hits=12, misses=36, evictions=0, prefetches=0, prefetch_used=0, prefetch_unused=0, rows_read=36,
        reads=36, bytes_read=36 * 8192, read_seconds=0.1, wait_seconds=0.5, verified_rows=0, verify_mismatches=0,
        capacity=100, resident=36, row_bytes=8192, io="buffered", fallback_files=0,
    )  # fmt: skip
    engram = replace(s, engram=rows, phases=replace(s.phases, decode_engram_bytes=6 * 49152))
    assert engram.engram_hit_rate == 0.25 and engram.decode_engram_bytes_per_token == 49152.0
    lines = report_lines(engram)
    assert next(x for x in lines if x.startswith("Engram hit rate")).endswith(
        "25.0% (12 of 48 rows; cache 100 rows, 36 read)"
    )
    assert ", 49.2 kB of Engram per decode step" in next(x for x in lines if x.startswith("read per token"))
    assert "Engram 0.50" in next(x for x in lines if x.startswith("I/O not hidden"))
    assert any(x.startswith("engram: 48 rows asked, 12 hits (25.0%), 36 rows read") for x in engram.lines())
    assert not any(x.startswith("engram") for x in s.lines())


STATS_JSON_KEYS = (
    "generated_ids", "prompt_tokens", "expert_requests", "expert_hits", "expert_misses", "expert_evictions",
    "expert_prefetches", "prefetch_used", "hit_rate", "bytes_read", "read_seconds", "read_gbps",
    "exposed_io_seconds", "verified_reads", "verify_mismatches", "cache_slots", "slot_bytes",
    "working_set_experts", "trunk_pinned_layers", "trunk_streamed_layers", "trunk_reads", "trunk_bytes_read",
    "trunk_wait_seconds", "trunk_out_of_order", "trunk_verified_reads", "peak_rss_bytes", "budget_bytes",
    "planned_bytes", "io_mode", "io_fallback_files", "kernel_backend", "prefill_seconds", "decode_tokens",
    "decode_seconds_per_token", "prefill_tokens_per_second", "turn_prompt_tokens", "first_token_seconds",
    "warnings", "kernel_warmup_seconds", "prefill_segment", "prefill_stopped", "decode_profile", "load_seconds",
    "decode_tokens_per_second", "stop_reasons", "stop_reason", "stopped_in_think", "unused", "engram_cache_rows",
    "engram_requests", "engram_hits", "engram_misses", "engram_hit_rate", "engram_rows_read", "engram_bytes_read",
    "engram_wait_seconds", "decode_expert_bytes_per_token", "decode_engram_bytes_per_token", "decode_threads",
    "numerics", "speculation",
)  # fmt: skip


def test_stats_json_keeps_its_flat_keys_while_the_records_nest(ckpt) -> None:
    """The run's figures nest the store's, ring's and phases' own records; --stats-json still
    writes the flat document it always did, each value read from the record that owns it."""
    from dsv4stream.run.runtime import Runtime

    opts = RunOptions(budget=int(float(gb(ckpt, 3)) * 1e9), io="buffered")
    with Runtime.open(ckpt, opts) as rt:
        ids = list(rt.generate(rt.session(), [4, 5, 6], 5))
        s = rt.stats()
        assert s.store == rt.store.stats() and s.trunk == rt.trunk.stats()
    d = s.as_dict()
    assert tuple(d) == STATS_JSON_KEYS and json.loads(json.dumps(d)) == d
    assert (d["expert_hits"], d["expert_misses"], d["bytes_read"]) == (s.store.hits, s.store.misses, s.store.bytes_read)
    assert (d["cache_slots"], d["exposed_io_seconds"]) == (s.store.slots, s.store.wait_seconds)
    assert (d["trunk_reads"], d["trunk_bytes_read"]) == (s.trunk.reads, s.trunk.bytes_read)
    assert d["generated_ids"] == ids and d["turn_prompt_tokens"] == [3] and d["decode_tokens"] == 4
    assert d["io_mode"] == "buffered" and d["engram_cache_rows"] == 0 and d["stop_reason"] == "gen_limit"
    d["generated_ids"].append(-1)  # the document is a copy
    assert s.generated_ids == ids


def test_a_reply_continued_from_logits_counts_only_its_own_reads(ckpt) -> None:
    """A server's second choice starts from the prompt's logits: its decode bytes are the reads
    of its own steps, not everything read since the store opened (the prefill's included)."""
    from dsv4stream.run.runtime import Runtime

    with Runtime.open(ckpt, RunOptions(budget=int(float(gb(ckpt, 3)) * 1e9), io="buffered")) as rt:
        s = rt.session()
        logits = s.prefill([4, 5, 6], last_only=True)
        before = rt.store.stats().bytes_read
        got = list(rt.generate(s, [], 5, logits=logits))
        after = rt.store.stats().bytes_read
    assert len(got) == 5 and s.turn.decode_steps == 4 and s.turn.prompt_tokens is None
    assert before > 0 and s.turn.decode_expert_bytes == after - before


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 cores")
def test_a_run_without_threads_gets_a_governor_and_the_same_ids(ckpt, monkeypatch):
    """Runtime without --threads: the governor picks each step's count (forced to alternate
    here); the ids equal a --threads 1 run's and a --threads 2 run's, the counts are reported,
    and the count is back at the most threads after the generation."""
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    budget = int(float(gb(ckpt, 3)) * 1e9)
    ids = {}
    for n in (1, 2):
        with Runtime.open(ckpt, RunOptions(budget=budget, threads=n)) as rt:
            assert rt.engine.governor is None
            ids[n] = list(rt.generate(rt.session(), [4, 5, 6], 12))
            assert rt.stats().decode_threads == {}
    kernels.set_threads(2)
    with Runtime.open(ckpt, RunOptions(budget=budget)) as rt:
        gov = rt.engine.governor
        assert gov is not None and gov.most == 2
        monkeypatch.setattr(gov, "next_threads", lambda: 1 + gov._step % 2)
        seen = []
        real = kernels.set_threads
        monkeypatch.setattr(kernels, "set_threads", lambda n: (seen.append(n), real(n)))
        got = list(rt.generate(rt.session(), [4, 5, 6], 12))
        s = rt.stats()
    assert got == ids[1] == ids[2]
    assert set(seen) == {1, 2} and seen[-1] == 2 and kernels.get_threads() == 2
    assert sum(s.decode_threads.values()) == 11 and set(s.decode_threads) == {"1", "2"}
    assert any(line.startswith("decode threads") for line in s.lines())
