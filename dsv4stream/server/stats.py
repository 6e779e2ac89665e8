"""Live figures of the server behind `GET /v1/stats` and the chat page's panel.

Owns: what the engine thread reports as it works (the request's phase, prefill progress by
tokens and by layer, one history sample per decode pass and per first token: the expert hit
rate and read rate since the last one)
and the published snapshot the HTTP side reads. Only the engine thread calls the update
methods; `snapshot()` and `counters()` take the lock and copy, and read the run's live
counters (`Runtime.counters`: one call, which waits for no read in flight), so handlers
never touch engine state. Request times are the sessions' own (the worker times them).

History figures: hit rate = expert hits / requests of that pass; read rate = routed-expert
bytes read during it / its wall time (GB/s, 10^9 bytes).

Several requests run at once (continuous batching): each has its `RequestStats` (the worker
holds it); the snapshot's `batch` lists them (prompt progress, tokens, decode tok/s so far) with
the passes run and their mean rows; `phase` is prefill while a request reads its prompt.

Speculation (`--speculate`, issue 41): the snapshot's `speculation` sums `engine.spec_stats.SpecCounts`
over every generate call that could draft and has ended (None until one has): acceptance, mean
accepted length, drafted / accepted / verified tokens, expert bytes per token, decode seconds with
drafts and the estimate without (tokens x the mean measured one-token pass). The engine thread
folds the engine's ended turns in at each request's end (`end`); a turn still running (a request of
a batch) is folded when it has ended.

Per request (for the chat page, through the job's events): one sample per prefill segment
and per generated token (`t` seconds since the request was taken from the queue, tokens/s,
expert-read MB/s, hit rate; the first token's sample covers the end of the prefill), and a
summary at the end: prefill and decode tokens/s, tokens reused from a kept state, the
request's expert hit rate and the MB it read from disk (routed experts plus streamed trunk
layers; 10^6 bytes).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engine.spec_stats import SpecCounts
from ..run.memory import peak_rss_bytes
from ..run.runtime import Runtime

HISTORY_SECONDS = 300.0


@dataclass
class RequestStats:
    """One request's marks, held by the worker while it runs (`LiveStats.begin`)."""

    n_prompt: int
    cached: int
    t0: float  # monotonic, when it was taken from the queue
    store0: tuple[int, int, int]  # the store's counts then
    trunk0: int
    mark: tuple[int, int, int]  # the store's counts at its last sample
    mark_t: float
    fed: int  # prompt position at its last sample
    done: int = 0  # prompt tokens read so far
    generated: int = 0
    first_t: float | None = None  # monotonic, at its first token

    def tok_s(self, now: float) -> float:
        """Its decode rate so far (tokens after the first over the time since the first)."""
        if self.first_t is None or self.generated < 2:
            return 0.0
        return round((self.generated - 1) / max(now - self.first_t, 1e-9), 3)


class LiveStats:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._history: deque[dict[str, float]] = deque()
        self._live: list[RequestStats] = []  # the requests running now, in the order they started
        self._layer = -1
        self._last: dict[str, Any] | None = None
        self._served = 0
        self._batch = {"passes": 0, "rows": 0, "largest": 0}  # batched decode passes and the rows they carried
        self._totals = {"prefill_tokens": 0, "prefill_seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0}
        # for /metrics: whole-run counters
        self._counts = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "cache_hits_ram": 0,
                        "cache_hits_disk": 0}  # fmt: skip
        self._mark = self._store_counts()  # the history's mark (one sample per pass)
        self._mark_t = time.monotonic()
        pinned = rt.trunk.pinned
        self._trunk = {"pinned_layers": pinned, "streamed_layers": rt.cfg.n_layers - pinned}
        self._trunk_bytes = rt.counters().trunk_bytes_read
        # --speculate: the ended turns' counts summed; turns not yet seen / not yet ended
        self._spec: SpecCounts | None = None
        self._turns_seen = len(rt.engine.phases.turns)
        self._open_turns: list = []

    # ---- engine thread ----------------------------------------------------------------------------
    def _store_counts(self) -> tuple[int, int, int]:
        c = self.rt.counters()
        return c.expert_requests, c.expert_hits, c.expert_bytes_read

    def begin(self, n_prompt: int, cached: int) -> RequestStats:
        """A request is taken from the queue: its marks (handed back to the calls below)."""
        now, counts = time.monotonic(), self._store_counts()
        r = RequestStats(
            n_prompt, cached, now, counts, self.rt.counters().trunk_bytes_read, counts, now, cached, cached
        )
        with self._lock:
            self._live.append(r)
            self._layer = -1
        return r

    def _sample(self, r: RequestStats, phase: str, tokens: int) -> dict[str, float | str]:
        """The request's figures since its last sample (reads and hits are the process's, shared
        by the requests of a batch); moves its mark."""
        now, counts = time.monotonic(), self._store_counts()
        req, hits, nbytes = (c - m for c, m in zip(counts, r.mark, strict=True))
        dt = max(now - r.mark_t, 1e-9)
        r.mark, r.mark_t = counts, now
        return {
            "t": round(now - r.t0, 4),
            "phase": phase,
            "tok_s": round(tokens / dt, 3),
            "read_mb_s": round(nbytes / dt / 1e6, 3),
            "hit_rate": round(hits / req if req else 1.0, 4),
        }

    def _history_sample(self, kind: str) -> None:
        """One history sample (hit rate and read rate since the last one) for the page's chart."""
        now, counts = time.monotonic(), self._store_counts()
        req, hits, nbytes = (c - m for c, m in zip(counts, self._mark, strict=True))
        dt = max(now - self._mark_t, 1e-9)
        self._mark, self._mark_t = counts, now
        sample = {"t": round(now - self._t0, 3), "kind": kind, "hit_rate": hits / req if req else 1.0,
                  "read_gbps": nbytes / dt / 1e9}  # fmt: skip
        with self._lock:
            self._history.append(sample)
            while self._history and sample["t"] - self._history[0]["t"] > HISTORY_SECONDS:
                self._history.popleft()

    def on_route(self, layer: int, positions: np.ndarray, experts: np.ndarray) -> None:
        """Session hook, before each layer's experts are fetched: where the forward pass is."""
        self._layer = layer

    def prefilled(self, r: RequestStats, done: int, total: int) -> dict[str, float | str]:
        """After each prefill segment (`done` prompt tokens read in all): the request's sample."""
        with self._lock:
            r.done = done
        sample = self._sample(r, "prefill", done - r.fed)
        r.fed = done
        return sample

    def token(self, r: RequestStats, first: bool) -> dict[str, float | str]:
        """After each generated token: returns the request's sample. The first token's covers the
        prompt tokens that no segment reported yet, if any (a prefill sample, also one of the
        history), else it is the first decode sample."""
        rest = r.n_prompt - r.fed if first else 0
        mine = self._sample(r, "prefill" if rest > 0 else "decode", rest if rest > 0 else 1)
        with self._lock:
            r.fed = r.done = max(r.fed, r.n_prompt)
            r.generated += 1
            if first:
                r.first_t = r.mark_t
        if first:
            self._history_sample("prefill")
        return mine

    def passed(self, rows: int) -> None:
        """A decode pass carried `rows` requests' tokens: one history sample, the batch's figures."""
        self._history_sample("decode")
        with self._lock:
            b = self._batch
            b["passes"] += 1
            b["rows"] += rows
            b["largest"] = max(b["largest"], rows)

    def _fold_speculation(self) -> None:
        """The engine's turns that ended since the last call into the speculation totals (engine thread)."""
        turns = self.rt.engine.phases.turns
        self._open_turns += turns[self._turns_seen :]
        self._turns_seen = len(turns)
        ended = [t for t in self._open_turns if t.stop_reason]
        self._open_turns = [t for t in self._open_turns if not t.stop_reason]
        parts = [t.speculation for t in ended if t.speculation is not None]
        if parts:
            total = SpecCounts.total(([self._spec] if self._spec else []) + parts)
            with self._lock:
                self._spec = total

    def end(self, usage, r: RequestStats) -> dict[str, Any]:
        """The request is over (answered or stopped): totals, and its summary (returned)."""
        self._fold_speculation()
        now = self.rt.counters()
        counts = (now.expert_requests, now.expert_hits, now.expert_bytes_read)
        req, hits, nbytes = (c - m for c, m in zip(counts, r.store0, strict=True))
        with self._lock:
            if r in self._live:
                self._live.remove(r)
            self._layer = -1 if not self._live else self._layer
            self._served += 1
            t = self._totals
            fed = usage.prompt_tokens - usage.cached_tokens
            t["prefill_tokens"] += fed
            t["prefill_seconds"] += usage.prefill_seconds
            t["decode_tokens"] += max(usage.completion_tokens - 1, 0)
            t["decode_seconds"] += usage.decode_seconds
            c = self._counts
            c["prompt_tokens"] += usage.prompt_tokens
            c["cached_tokens"] += usage.cached_tokens
            c["completion_tokens"] += usage.completion_tokens
            if usage.cache_source:
                c[f"cache_hits_{usage.cache_source}"] += 1
            self._trunk_bytes = now.trunk_bytes_read
            # a request stopped before its first token has no time to first token (None, not 0)
            first = round(usage.prefill_seconds, 4) if usage.completion_tokens else None
            self._last = {
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens,
                "completion_tokens": usage.completion_tokens,
                "time_to_first_token_s": first,
                "prefill_tokens_per_s": _rate(fed, usage.prefill_seconds),
                "decode_tokens_per_s": _rate(usage.completion_tokens - 1, usage.decode_seconds),
                "cache_source": usage.cache_source,
                "queued_s": round(usage.queued_seconds, 4),
            }
            return {
                **self._last,
                "seconds": round(time.monotonic() - r.t0, 4),
                "expert_requests": req,
                "expert_hits": hits,
                "expert_hit_rate": round(hits / req, 4) if req else None,
                "disk_mb": round((nbytes + now.trunk_bytes_read - r.trunk0) / 1e6, 3),
            }

    def running(self) -> list[dict[str, float]]:
        """The requests running now: prompt progress, tokens generated, decode tok/s so far."""
        now = time.monotonic()
        with self._lock:
            return [
                {"prompt_tokens": r.n_prompt, "cached_tokens": r.cached, "prefilled": r.done,
                 "completion_tokens": r.generated, "decode_tokens_per_s": r.tok_s(now),
                 "seconds": round(now - r.t0, 3)}
                for r in self._live
            ]  # fmt: skip

    # ---- any thread -------------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        """Totals since the start, for /metrics (monotonic; of the engine, only its live counters)."""
        c = self.rt.counters()
        with self._lock:
            return {
                **self._counts, "requests_served": self._served, "prefill_seconds": self._totals["prefill_seconds"],
                "decode_seconds": self._totals["decode_seconds"], "expert_requests": c.expert_requests,
                "expert_hits": c.expert_hits, "expert_bytes_read": c.expert_bytes_read,
                "trunk_bytes_read": self._trunk_bytes, "batch_passes": self._batch["passes"],
                "batch_rows": self._batch["rows"],
            }  # fmt: skip

    def speculation(self) -> SpecCounts | None:
        """The ended generations' speculation counts summed, for /metrics (None: none could draft yet)."""
        with self._lock:
            return self._spec

    def snapshot(self, queued: int, max_batch: int = 1) -> dict[str, Any]:
        c = self.rt.counters()
        running = self.running()
        with self._lock:
            t = self._totals
            filling = next((r for r in self._live if r.first_t is None), None)
            progress = None
            if filling is not None:  # the request whose prompt is being read (the earliest, if several)
                progress = {"done": filling.done, "total": filling.n_prompt, "cached": filling.cached,
                            "layer": self._layer, "layers": self.rt.cfg.n_layers}  # fmt: skip
            phase = "prefill" if filling is not None else ("decode" if self._live else "idle")
            b = self._batch
            batch = {
                "running": len(running),
                "max_batch": max_batch,
                "requests": running,
                "passes": b["passes"],
                "mean_rows": round(b["rows"] / b["passes"], 3) if b["passes"] else 0.0,
                "largest": b["largest"],
            }
            return {
                "phase": phase,
                "queue": queued,
                "batch": batch,
                "requests_served": self._served,
                "prefill": progress,
                "last_request": dict(self._last) if self._last else None,
                "prefill_tokens_per_s": _rate(t["prefill_tokens"], t["prefill_seconds"]),
                "decode_tokens_per_s": _rate(t["decode_tokens"], t["decode_seconds"]),
                "expert_hit_rate": c.expert_hit_rate,
                "expert_requests": c.expert_requests,
                "gb_read": (c.expert_bytes_read + self._trunk_bytes) / 1e9,
                "read_gbps": c.read_gbps,
                "trunk": dict(self._trunk),
                "peak_rss_gb": peak_rss_bytes() / 1e9,
                "budget_gb": self.rt.opts.budget / 1e9,
                "history": list(self._history),
                "speculation": _speculation(self._spec),
                # decode steps and batched passes per kernel thread count (the governor's; {} with --threads)
                "decode_threads": gov.summary() if (gov := self.rt.engine.governor) is not None else {},
            }


def _speculation(spec: SpecCounts | None) -> dict[str, Any] | None:
    """The summed `SpecCounts` for /v1/stats (None: no generate call that could draft has ended)."""
    if spec is None:
        return None
    d = spec.as_dict()
    for k in ("acceptance", "mean_accepted_length", "expert_bytes_per_token"):
        d[k] = round(d[k], 4)
    for k in ("seconds", "seconds_without_estimated", "draft_seconds", "one_token_pass_seconds"):
        d[k] = round(d[k], 4)
    return d


def _rate(n: int, seconds: float) -> float:
    return round(n / seconds, 3) if seconds > 0 and n > 0 else 0.0
