"""Live figures of the server behind `GET /v1/stats` and the chat page's panel.

Owns: what the engine thread reports as it works (the request's phase, prefill progress by
tokens and by layer, one sample per generated token: its expert hit rate and read rate)
and the published snapshot the HTTP side reads. Only the engine thread calls the update
methods; `snapshot()` and `counters()` take the lock and copy, and read the run's live
counters (`Runtime.counters`: one call, which waits for no read in flight), so handlers
never touch engine state. Request times are the sessions' own (`worker.request_seconds`).

Per-token figures: hit rate = expert hits / requests of that token's forward pass; read
rate = routed-expert bytes read during it / its wall time (GB/s, 10^9 bytes).

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
from typing import Any

import numpy as np

from ..run.memory import peak_rss_bytes
from ..run.runtime import Runtime

HISTORY_SECONDS = 300.0


class LiveStats:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._history: deque[dict[str, float]] = deque()
        self._phase = "idle"
        self._progress: dict[str, int] | None = None
        self._layer = -1
        self._last: dict[str, Any] | None = None
        self._served = 0
        self._totals = {"prefill_tokens": 0, "prefill_seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0}
        # for /metrics: whole-run counters
        self._counts = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "cache_hits_ram": 0,
                        "cache_hits_disk": 0}  # fmt: skip
        self._mark = self._store_counts()
        self._mark_t = time.monotonic()
        pinned = rt.trunk.pinned
        self._trunk = {"pinned_layers": pinned, "streamed_layers": rt.cfg.n_layers - pinned}
        self._trunk_bytes = rt.counters().trunk_bytes_read
        # this request: (start time, store counts, trunk bytes) and the prompt position at the last sample
        self._req: tuple[float, tuple[int, int, int], int] = (self._mark_t, self._mark, self._trunk_bytes)
        self._fed = 0

    # ---- engine thread ----------------------------------------------------------------------------
    def _store_counts(self) -> tuple[int, int, int]:
        c = self.rt.counters()
        return c.expert_requests, c.expert_hits, c.expert_bytes_read

    def begin(self, n_prompt: int, cached: int) -> None:
        with self._lock:
            self._phase = "prefill"
            self._progress = {"done": cached, "total": n_prompt, "cached": cached}
            self._layer = -1
        self._mark, self._mark_t = self._store_counts(), time.monotonic()
        self._req = (self._mark_t, self._mark, self.rt.counters().trunk_bytes_read)
        self._fed = cached

    def _sample(self, phase: str, tokens: int) -> tuple[dict[str, float | str], float, float]:
        """Figures since the last sample: (the request's sample, read GB/s, hit rate); moves the mark."""
        now, counts = time.monotonic(), self._store_counts()
        req, hits, nbytes = (c - m for c, m in zip(counts, self._mark, strict=True))
        dt = max(now - self._mark_t, 1e-9)
        self._mark, self._mark_t = counts, now
        hit_rate = hits / req if req else 1.0
        sample = {
            "t": round(now - self._req[0], 4),
            "phase": phase,
            "tok_s": round(tokens / dt, 3),
            "read_mb_s": round(nbytes / dt / 1e6, 3),
            "hit_rate": round(hit_rate, 4),
        }
        return sample, nbytes / dt / 1e9, hit_rate

    def on_route(self, layer: int, positions: np.ndarray, experts: np.ndarray) -> None:
        """Session hook, before each layer's experts are fetched: where the forward pass is."""
        self._layer = layer

    def prefilled(self, done: int, total: int) -> dict[str, float | str]:
        """After each prefill segment (`done` prompt tokens read in all): the request's sample."""
        with self._lock:
            if self._progress is not None:
                self._progress["done"] = done
        sample, _, _ = self._sample("prefill", done - self._fed)
        self._fed = done
        return sample

    def token(self, first: bool, n_prompt: int = 0) -> dict[str, float | str]:
        """After each generated token: one history sample; returns the request's. The first token's
        covers the prompt tokens up to `n_prompt` that no segment reported yet, if any (a prefill
        sample), else it is the first decode sample."""
        rest = n_prompt - self._fed if first else 0
        mine, gbps, hit_rate = self._sample("prefill" if rest > 0 else "decode", rest if rest > 0 else 1)
        self._fed = max(self._fed, n_prompt)
        sample = {
            "t": round(self._mark_t - self._t0, 3),
            "kind": "prefill" if first else "decode",
            "hit_rate": hit_rate,
            "read_gbps": gbps,
        }
        with self._lock:
            self._phase = "decode"
            self._history.append(sample)
            while self._history and sample["t"] - self._history[0]["t"] > HISTORY_SECONDS:
                self._history.popleft()
        return mine

    def end(self, usage) -> dict[str, Any]:
        """The request is over (answered or stopped): totals, and its summary (returned)."""
        now = self.rt.counters()
        t0, store0, trunk0 = self._req
        counts = (now.expert_requests, now.expert_hits, now.expert_bytes_read)
        req, hits, nbytes = (c - m for c, m in zip(counts, store0, strict=True))
        with self._lock:
            self._phase, self._progress, self._layer = "idle", None, -1
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
            }
            return {
                **self._last,
                "seconds": round(time.monotonic() - t0, 4),
                "expert_requests": req,
                "expert_hits": hits,
                "expert_hit_rate": round(hits / req, 4) if req else None,
                "disk_mb": round((nbytes + now.trunk_bytes_read - trunk0) / 1e6, 3),
            }

    # ---- any thread -------------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        """Totals since the start, for /metrics (monotonic; of the engine, only its live counters)."""
        c = self.rt.counters()
        with self._lock:
            return {
                **self._counts, "requests_served": self._served, "prefill_seconds": self._totals["prefill_seconds"],
                "decode_seconds": self._totals["decode_seconds"], "expert_requests": c.expert_requests,
                "expert_hits": c.expert_hits, "expert_bytes_read": c.expert_bytes_read,
                "trunk_bytes_read": self._trunk_bytes,
            }  # fmt: skip

    def snapshot(self, queued: int) -> dict[str, Any]:
        c = self.rt.counters()
        with self._lock:
            t = self._totals
            progress = dict(self._progress) if self._progress is not None else None
            if progress is not None:
                progress["layer"], progress["layers"] = self._layer, self.rt.cfg.n_layers
            return {
                "phase": self._phase,
                "queue": queued,
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
            }


def _rate(n: int, seconds: float) -> float:
    return round(n / seconds, 3) if seconds > 0 and n > 0 else 0.0
