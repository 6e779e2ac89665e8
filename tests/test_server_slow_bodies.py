"""Slow request bodies cannot lock new clients out (issue 40, item 8): a live `dsv4 serve` on
127.0.0.1 whose every connection slot holds a request that sent its headers and now trickles its
body, well within its body deadline, still answers a new client at once, in place of the slow
reader that has waited longest; the others keep trickling until their own deadline."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from server_proc import Server, health_seconds, trickling

from dsv4stream import synth

CAP = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return synth.make_checkpoint(
        tmp_path_factory.mktemp("slowbody") / "tiny", preset="tiny", seed=3, vocab_size=synth.REAL_VOCAB, tokenizer=True
    )


def _open(sock: socket.socket) -> bool:
    """Whether the server still holds `sock` open (nothing to read, no end of stream)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def test_slow_body_senders_do_not_lock_out_a_new_client(ckpt) -> None:
    args = ("--ctx", "64", "--max-connections", str(CAP), "--header-timeout", "5", "--body-timeout", "30")
    opening = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n{"
    )
    with Server(ckpt, *args) as srv, trickling(srv.port, opening, CAP, 0.3, b" ") as slow:
        # one byte a connection every 0.3 s: ~3 B/s, far under the 500 B/s floor
        time.sleep(3.0)  # every slot holds a body past its grace (2 s), all trickling
        assert all(_open(s) for s in slow)
        assert health_seconds(srv) < 2
        assert "for a slow request body to admit a new one" in srv.log
        assert "refused a connection" not in srv.log
        assert not _open(slow[0])  # the oldest slow reader made room
        assert sum(_open(s) for s in slow[1:]) == CAP - 1  # the others go on until their deadline
