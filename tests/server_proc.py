"""A real `dsv4 serve` subprocess on 127.0.0.1 and a free port, with its log collected."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

CODE = "from dsv4stream.cli import main; main()"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, ckpt: Path, *args: str, budget: str = "1") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # one kernel thread: on a loaded machine tiny matrices pay more for thread sync than they gain
        cmd = [sys.executable, "-c", CODE, "serve", str(ckpt), "--port", str(self.port), "--budget", budget]
        cmd += ["--threads", "1", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float = 300.0, after: int = 0) -> str:
        """The first log line at index >= `after` containing `text` (the default timeout covers a
        cold numba compile on a loaded machine)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in self.lines[after:]:
                if text in line:
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log}")
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in the server log within {timeout} s:\n{self.log}")

    def __enter__(self) -> Self:
        self.wait_for("listening on http://127.0.0.1")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        return self.proc.returncode


@contextlib.contextmanager
def trickling(port: int, opening: bytes, count: int, every: float, byte: bytes = b"X") -> Iterator[list[socket.socket]]:
    """`count` slow clients of 127.0.0.1:`port`: each sends `opening`, then `byte` every `every`
    seconds while the block runs (the sockets are yielded oldest first, closed after)."""
    slow: list[socket.socket] = []
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(every):
            for s in slow:
                try:
                    s.sendall(byte)
                except OSError:
                    pass

    t = threading.Thread(target=trickle, daemon=True)
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(opening)
            slow.append(s)
            time.sleep(0.02)  # distinct arrival times: slow[0] has waited longest
        t.start()
        yield slow
    finally:
        stop.set()
        if t.is_alive():
            t.join(5)
        for s in slow:
            s.close()


def health_seconds(srv: Server, timeout: float = 5.0) -> float:
    """Seconds a new connection's GET /health takes; AssertionError unless it answers 200."""
    import http.client

    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    return time.monotonic() - t0


def one_thread_engine(ckpt: Path):
    """An in-process Engine on one kernel thread, as the test servers run (fixture body; the
    thread count is global, so it is put back after)."""
    import numba

    from dsv4stream import kernels
    from dsv4stream.engine.numerics import RUN_DEFAULT  # what the test servers compute with
    from dsv4stream.engine.session import Engine

    yield Engine.open(ckpt, threads=1, numerics=RUN_DEFAULT)
    kernels.set_threads(numba.config.NUMBA_NUM_THREADS)
