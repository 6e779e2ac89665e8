"""What a person sees of a run's figures: the prefill progress bar and the final report.

Owns: `PrefillBar` (a tqdm bar on stderr fed by `Runtime.generate`'s progress callback, with
a ticker thread so the clock, hit rate and bytes read move during a long chunk) and
`report_lines` (the short report printed at the end of a run, or by the REPL's `/stats`).
The figures themselves come from `RunStats`; nothing here measures anything.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Self

from tqdm import tqdm

from ..errors import InternalError
from .runinfo import RunStats


@dataclass(frozen=True)
class Reads:
    """Cumulative figures the bar shows as growth since it opened."""

    expert_requests: int
    expert_hits: int
    bytes_read: int  # experts + streamed trunk layers


def size(n: float) -> str:
    """Bytes as GB (decimal) when at least 10 MB, else MB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.1f} MB"


class PrefillBar:
    """`bar(done, total)` after each prefill chunk; `close()` when the prefill is over.

    Shows tokens, tokens/s, ETA, and this prefill's expert hit rate and bytes read. A
    ticker thread refreshes it twice a second: one chunk of a big model takes a minute,
    and a frozen line looks like a hang. Disabled (no output) when `file` is not a terminal
    unless `enabled` says otherwise."""

    def __init__(
        self,
        reads: Callable[[], Reads],
        *,
        file: IO[str] | None = None,
        enabled: bool | None = None,
        leave: bool = True,
        tick: float = 0.5,
    ) -> None:
        self._reads = reads
        self._file = file if file is not None else sys.stderr
        self._enabled = enabled if enabled is not None else _isatty(self._file)
        self._leave = leave
        self._tick = tick
        self._bar: tqdm | None = None
        self._start = reads() if self._enabled else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._where = ""

    def __call__(self, done: int, total: int, where: str = "") -> None:
        """`where`: the prefill's place, e.g. "layer 12/43, segment 1/3" (after each layer)."""
        if not self._enabled:
            return
        bar = self._bar if self._bar is not None else self._open(total)
        if where:
            self._where = where
        bar.set_postfix_str(self._figures(), refresh=False)
        bar.update(done - bar.n)

    def note(self, msg: str) -> None:
        """A line above the bar, at once (from a signal handler too): e.g. acknowledging Ctrl-C."""
        if self._bar is not None:
            self._bar.write(msg, file=self._file)
        else:
            print(msg, file=self._file, flush=True)

    def start(self, total: int) -> None:
        """Show the bar at 0 before the first chunk runs."""
        if self._enabled and self._bar is None:
            self._open(total)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._bar is not None:
            self._bar.set_postfix_str(self._figures(), refresh=False)
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, total: int) -> tqdm:
        bar = self._bar = tqdm(
            total=total,
            desc="prefill",
            unit="tok",
            file=self._file,
            leave=self._leave,
            dynamic_ncols=True,
            postfix=self._figures(),
            bar_format="{desc} {percentage:3.0f}%|{bar}| {n}/{total} tokens [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
        )
        if self._tick > 0:
            self._thread = threading.Thread(target=self._ticker, name="dsv4-prefill-bar", daemon=True)
            self._thread.start()
        return bar

    def _ticker(self) -> None:
        while not self._stop.wait(self._tick):
            bar = self._bar
            if bar is not None:
                bar.set_postfix_str(self._figures(), refresh=False)
                bar.refresh()

    def _figures(self) -> str:
        now, s = self._reads(), self._start
        if s is None:
            raise InternalError("prefill figures asked of a disabled bar")
        req = now.expert_requests - s.expert_requests
        hits = now.expert_hits - s.expert_hits
        rate = f"{hits / req:.0%}" if req else "-"
        where = f"{self._where}, " if self._where else ""
        return f"{where}hit {rate}, read {size(now.bytes_read - s.bytes_read)}"


def _isatty(f: IO[str]) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False


STOP_TEXT = {  # each reads after "stopped "
    "eos": "at EOS (end of text)",
    "gen_limit": "at the --gen limit",
    "context_full": "with the context full (--ctx)",
    "interrupted": "by Ctrl-C",
}


def stop_text(reason: str, in_think: bool = False) -> str:
    """Why an answer ended, in words: `engine.STOP_REASONS` plus whether <think> was still open."""
    text = STOP_TEXT.get(reason, reason or "before it started")
    return f"stopped {text}" + (", inside <think> (reasoning only, no answer yet)" if in_think else "")


def report_lines(s: RunStats) -> list[str]:
    """The final report: latency, throughput, cache, I/O and memory, one figure per line.

    Decode s/token counts decode forward passes only: the prefill is its own line (one
    engine once divided everything by the generated tokens and called it s/token)."""
    turns = s.first_token_seconds
    if not turns:
        ttft = "-"
    elif len(turns) == 1:
        ttft = f"{turns[0]:.2f} s"
    else:
        ttft = f"{turns[0]:.2f} s first turn, {turns[-1]:.2f} s last ({len(turns)} turns)"
    rate = f", {s.prefill_tokens_per_second:.1f} tokens/s" if s.prefill_seconds else ""
    decode = (
        f"{s.decode_seconds_per_token:.3f} s/token, {s.decode_tokens_per_second:.2f} tokens/s"
        f" over {s.decode_tokens} tokens (prefill excluded)"
        if s.decode_tokens
        else "no decode step (one token generated)"
    )
    reasons = s.stop_reasons
    if not reasons:
        stopped = "-"
    elif len(reasons) == 1:
        stopped = stop_text(reasons[0], bool(s.stopped_in_think and s.stopped_in_think[0]))[len("stopped ") :]
    else:
        counts = {r: reasons.count(r) for r in dict.fromkeys(reasons)}
        last = stop_text(reasons[-1], bool(s.stopped_in_think and s.stopped_in_think[-1]))
        stopped = f"last turn {last[len('stopped ') :]}; all turns: " + ", ".join(f"{r} {n}" for r, n in counts.items())
    exposed = s.exposed_io_seconds + s.trunk_wait_seconds + s.engram_wait_seconds
    pct = f" ({s.peak_rss_bytes / s.budget_bytes:.0%})" if s.budget_bytes else ""
    rows = [
        ("load", f"{s.load_seconds:.2f} s before the prefill (plan, trunk, kernels {s.kernel_warmup_seconds:.2f} s)"),
        ("generated", f"{len(s.generated_ids)} tokens"),
        ("stopped", stopped),
        ("time to first token", ttft),
        ("prefill", f"{s.prompt_tokens} tokens in {s.prefill_seconds:.2f} s{rate}"),
        ("decode", decode),
        ("expert hit rate", f"{s.hit_rate:.1%} ({s.expert_hits} of {s.expert_requests} requests)"),
        *(
            [
                (
                    "Engram hit rate",
                    (
                        f"{s.engram_hit_rate:.1%} ({s.engram_hits} of {s.engram_requests} rows; cache"
                        f" {s.engram_cache_rows} rows, {s.engram_rows_read} read)"
                    ),
                )
            ]
            if s.engram_cache_rows
            else []
        ),
        (
            "read",
            f"{size(s.bytes_read + s.trunk_bytes_read)} (experts {size(s.bytes_read)} at {s.read_gbps:.2f} GB/s"
            + (f", trunk {size(s.trunk_bytes_read)}" if s.trunk_streamed_layers else "")
            + (f", Engram {size(s.engram_bytes_read)}" if s.engram_cache_rows else "")
            + f"; {s.io_mode})",
        ),
        *([("read per token", per_token)] if (per_token := _per_token(s)) else []),
        (
            "I/O not hidden",
            f"{exposed:.2f} s the forward pass waited on reads"
            + (
                f" (experts {s.exposed_io_seconds:.2f}"
                + (f", trunk {s.trunk_wait_seconds:.2f}" if s.trunk_streamed_layers else "")
                + (f", Engram {s.engram_wait_seconds:.2f}" if s.engram_cache_rows else "")
                + ")"
                if s.trunk_streamed_layers or s.engram_cache_rows
                else ""
            ),
        ),
        ("peak RSS", f"{s.peak_rss_bytes / 1e9:.3f} GB of --budget {s.budget_bytes / 1e9:.3f} GB{pct}"),
    ]
    spec = s.phases.speculation
    if spec is not None:
        rows.extend(("speculate" if i == 0 else "", line.split(": ", 1)[1]) for i, line in enumerate(spec.lines()))
    if s.unused:
        rows.append(("not run", s.unused))
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]


def _per_token(s: RunStats) -> str:
    """Bytes one decode step read from disk, experts and Engram ("" without a decode step)."""
    if not s.decode_tokens:
        return ""
    out = f"{_fine(s.decode_expert_bytes_per_token)} of experts"
    if s.engram_cache_rows:
        out += f", {_fine(s.decode_engram_bytes_per_token)} of Engram"
    return out + f" per decode step (over {s.decode_tokens} steps)"


def _fine(n: float) -> str:
    """`size`, with kB below 1 MB (one step's Engram rows are a few hundred kB)."""
    return size(n) if n >= 1e6 else f"{n / 1e3:.1f} kB"
