"""Every input the CLI reads is bounded and checked for its kind first (issue 40, items 13-14):
a device, a FIFO or an endless stdin is one `dsv4:` line, never a hang or an unbounded read;
a .npy of pickled objects is refused unread; a message quotes a few bytes of a file, never
its contents. The children run under a 4 GiB address-space limit, so a regression fails
here (a MemoryError traceback) instead of filling the machine."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dsv4stream.cli.logits import logits as logits_cmd
from dsv4stream.errors import UsageError


@pytest.fixture(scope="module")
def ckpt(real_vocab_ckpt) -> Path:
    return real_vocab_ckpt  # tiny, seed 3, the real vocabulary and its packed tokenizer (conftest.py)


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def dsv4(*args: str, stdin=None) -> str:
    """The one line a refused command printed (exit 2, no traceback), within 60 s."""
    cmd = [sys.executable, "-c", "from dsv4stream.cli import main; main()", *args]
    r = subprocess.run(cmd, stdin=stdin, capture_output=True, text=True, timeout=60, check=False, preexec_fn=_limited)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("dsv4: "), r.stderr[-2000:]
    return r.stderr


def test_prompt_files_that_are_not_regular_or_too_long_are_one_line(ckpt, tmp_path) -> None:
    run = ("run", str(ckpt), "--budget", "1", "--ctx", "64")
    assert "a character device" in dsv4(*run, "--prompt-file", "/dev/zero")
    fifo = tmp_path / "p.fifo"
    os.mkfifo(fifo)  # no writer: opening it to read would wait forever
    assert "a FIFO" in dsv4(*run, "--prompt-file", str(fifo))
    assert "a directory" in dsv4(*run, "--prompt-file", str(tmp_path))
    big = tmp_path / "big.txt"  # a 2 GB sparse file: refused by its size, not read
    with open(big, "wb") as f:
        f.truncate(2 << 30)
    err = dsv4(*run, "--prompt-file", str(big))
    assert "2,147,483,648 bytes, more than the 4,096" in err and "--ctx 64" in err
    with open("/dev/zero", "rb") as zero:  # stdin without end: read up to the bound, then refused
        assert "stdin gives more than 4,096 bytes" in dsv4(*run, "--prompt-file", "-", stdin=zero)
    with open("/dev/zero", "rb") as zero:
        assert "stdin gives more than" in dsv4("tokenize", "--tok", str(ckpt), "-", stdin=zero)


def test_tokens_files_that_are_not_regular_are_one_line(ckpt, tmp_path) -> None:
    out = str(tmp_path / "o.npy")
    fifo = tmp_path / "ids.fifo"
    os.mkfifo(fifo)
    assert "a FIFO" in dsv4("logits", str(ckpt), "--tokens-file", str(fifo), "--out", out)
    assert "a character device" in dsv4("logits", str(ckpt), "--tokens-file", "/dev/zero", "--out", out)


def _refusal(ckpt: Path, tmp_path: Path, f: Path) -> str:
    r = CliRunner().invoke(logits_cmd, [str(ckpt), "--tokens-file", str(f), "--out", str(tmp_path / "o.npy")])
    assert isinstance(r.exception, UsageError), r.exception
    return str(r.exception)


def test_npy_tokens_files_of_objects_or_floats_are_refused_unread(ckpt, tmp_path) -> None:
    for name, arr in (
        ("obj.npy", np.array([1, "2", None, os.system], dtype=object)),
        ("ragged.npy", np.array([[1, 2], [3]], dtype=object)),
        ("floats.npy", np.arange(4, dtype=np.float32)),
        ("text.npy", np.array(["1", "2"])),
        ("complex.npy", np.ones(3, dtype=np.complex64)),
    ):
        f = tmp_path / name
        np.save(f, arr, allow_pickle=True)
        msg = _refusal(ckpt, tmp_path, f)
        assert "--tokens-file" in msg and "integer" in msg, msg
    f = tmp_path / "cut.npy"
    np.save(f, np.arange(100))
    f.write_bytes(f.read_bytes()[:90])  # a header, then too few bytes
    assert "not a .npy array of integer ids" in _refusal(ckpt, tmp_path, f)


def test_a_text_tokens_file_that_is_not_ids_is_quoted_by_a_few_bytes(ckpt, tmp_path) -> None:
    secret = "sk-live-" + "0123456789abcdef" * 80 + "-END-OF-SECRET"
    for body in (secret, f"1,2,{secret},4", f"1,2,,{secret}", "9" * 2000, f"1 2\n{secret}\n"):
        f = tmp_path / "ids.txt"
        f.write_text(body)
        msg = _refusal(ckpt, tmp_path, f)
        assert len(msg) < 200 + len(str(f)) and "END-OF-SECRET" not in msg and "89abcdef01" not in msg, msg
    f.write_bytes(b"1,2,\xff" + secret.encode())
    msg = _refusal(ckpt, tmp_path, f)
    assert "UTF-8" in msg and "END-OF-SECRET" not in msg


def test_a_chat_reading_an_endless_stdin_stops_at_the_bound(ckpt) -> None:
    cmd = [sys.executable, "-c", "from dsv4stream.cli import main; main()", "run", str(ckpt), "--chat"]
    with open("/dev/zero", "rb") as zero:
        r = subprocess.run(
            [*cmd, "--budget", "1", "--ctx", "64"], stdin=zero, capture_output=True, text=True, timeout=120,
            check=False, preexec_fn=_limited,
        )  # fmt: skip
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert last.startswith("dsv4: a chat turn of more than 4,096 characters on stdin"), last
