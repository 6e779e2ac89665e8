"""measure/readrate.py: the memory read rate issue 44's bound divides by.

The rate is only a floor if the loop really reads every byte: the sum it returns is checked
against a buffer of known words, and a wrong sum must raise rather than report a rate."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4stream.measure import readrate


@pytest.mark.parametrize("streams", readrate.STREAMS)
@pytest.mark.parametrize("parts", [1, 2])
def test_every_word_is_read_once(streams, parts):
    # distinct words: a loop that skipped, repeated or overlapped a line gets another sum
    a = np.arange(parts * streams * 8 * 37, dtype=np.uint64) * np.uint64(7919) + np.uint64(3)
    assert readrate._READERS[streams](a, parts) == int(a.sum())


def test_a_rate_from_a_small_buffer_names_its_threads_and_streams():
    r = readrate.read_rate(2, readrate.buffer(1 << 22), repeat=2, streams=(1, 4))
    assert r.threads == 2 and r.streams in (1, 4) and r.nbytes == 1 << 22
    assert r.wall_gbps > 0 and r.cpu_gbps > 0 and "2 threads" in r.line()


def test_a_buffer_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="do not split"):
        readrate.read_rate(2, np.ones(8 * 3, np.uint64), repeat=1, streams=(1,))


def test_a_wrong_sum_raises(monkeypatch):
    a = readrate.buffer(1 << 16)
    a[5] = 2  # the rate checks the sum against a buffer of ones
    with pytest.raises(RuntimeError, match="sum is wrong"):
        readrate.read_rate(1, a, repeat=1, streams=(1,))


def test_the_buffer_is_several_times_the_llc(tmp_path):
    for i, (level, size) in enumerate([(1, "48K"), (2, "2048K"), (3, "307200K")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    assert readrate.llc_bytes(tmp_path) == 300 << 20
    assert readrate.buffer_bytes(300 << 20) == 1216 << 20  # 4 x 300 MiB, a multiple of 64 MiB
    assert readrate.buffer_bytes(0) == 1 << 30 and readrate.llc_bytes(tmp_path / "none") == 0
