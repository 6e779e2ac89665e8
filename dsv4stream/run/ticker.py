"""A one-line "still working" display for a silent step that takes a while (the first numba compile).

Owns only the line on a terminal: `label ... 12 s`, rewritten in place once a second from a
daemon thread (the caller may change the label meanwhile: `Line`), and ended with the total
when the step returns. Silent when the file is not
a terminal (logs get the caller's own message instead).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO


class Line:
    """The label a running `elapsed` shows; the caller may change it (`compiling kernels: 3 of 9`)."""

    def __init__(self, label: str) -> None:
        self.label = label


@contextmanager
def elapsed(label: str, file: IO[str] | None = None, tick: float = 1.0, enabled: bool | None = None) -> Iterator[Line]:
    out = file if file is not None else sys.stderr
    line = Line(label)
    if enabled is None:
        try:
            enabled = out.isatty()
        except (AttributeError, ValueError):
            enabled = False
    if not enabled:
        yield line
        return
    stop = threading.Event()
    t0 = time.perf_counter()
    width = [0]

    def show(final: bool = False) -> None:
        text = f"{line.label} ... {time.perf_counter() - t0:.0f} s"
        pad = " " * max(0, width[0] - len(text))  # a shorter label must not leave the old one's tail
        width[0] = len(text)
        out.write(f"\r{text}{pad}" + ("\n" if final else ""))
        out.flush()

    def run() -> None:
        while not stop.wait(tick):
            show()

    show()
    thread = threading.Thread(target=run, name="dsv4-ticker", daemon=True)
    thread.start()
    try:
        yield line
    finally:
        stop.set()
        thread.join()
        show(final=True)
