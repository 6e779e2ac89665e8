"""The C heap a run keeps (`memory.recycle_heap`) and gives back (`memory.trim_heap`).

Each case runs in a fresh interpreter: malloc's settings are the whole process's. Page faults
are counted with numpy's transparent-huge-page advice off, so that one fault is one 4 KiB page.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsv4stream import synth

PRELUDE = textwrap.dedent(
    """
    import json, resource, sys
    import numpy as np
    from dsv4stream.run import memory

    np._core.multiarray._set_madvise_hugepage(False)
    MB = 1 << 20

    def faults_of_a_fresh_array(nbytes):
        a0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        a = np.empty(nbytes // 4, np.float32)
        a.fill(1.0)
        del a
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - a0

    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
    """
)


def child(body: str, *args: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def needs_glibc() -> None:
    out = child("print(json.dumps({'ok': memory._libc('mallopt') is not None}))")
    if not out["ok"]:
        pytest.skip("the C library has no mallopt (not glibc): recycle_heap changes nothing there")


def test_a_recycled_heap_hands_freed_arrays_back_without_new_page_faults() -> None:
    """By default every 48 MiB array is mapped afresh (one fault a page); once recycled, the
    next ones reuse the freed pages."""
    needs_glibc()
    out = child(
        """
        size = 48 * MB
        before = [faults_of_a_fresh_array(size) for _ in range(3)]
        on = memory.recycle_heap()
        after = [faults_of_a_fresh_array(size) for _ in range(4)][1:]  # the first one grows the heap
        print(json.dumps({"before": before, "after": after, "on": on, "pages": size // 4096}))
        """
    )
    assert out["on"]
    assert min(out["before"]) >= 0.9 * out["pages"], out
    assert max(out["after"]) <= 0.02 * out["pages"], out


def test_trim_gives_the_recycled_heap_back_to_the_kernel() -> None:
    """A recycled heap keeps a freed 200 MiB resident (the next prefill's pages); trim_heap
    returns it, which is what lets expert slots take those bytes back within the budget."""
    needs_glibc()
    out = child(
        """
        memory.recycle_heap()
        base = rss()
        a = np.ones(200 * MB // 4, np.float32)
        held = rss()
        del a
        kept = rss()
        memory.trim_heap()
        print(json.dumps({"base": base, "held": held, "kept": kept, "trimmed": rss()}))
        """
    )
    mb = 1 << 20
    assert out["held"] - out["base"] >= 190 * mb, out
    assert out["kept"] - out["base"] >= 190 * mb, out  # recycled: still resident after free
    assert out["trimmed"] - out["base"] <= 20 * mb, out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return synth.make_checkpoint(tmp_path_factory.mktemp("heap") / "tiny", preset="tiny", seed=3)


def test_a_run_recycles_its_heap_and_returns_it_when_it_closes(ckpt) -> None:
    """Runtime.open turns recycling on (a run's passes reuse each other's activations) and
    close gives what the heap kept back."""
    needs_glibc()
    out = child(
        """
        from dsv4stream.run.runinfo import RunOptions
        from dsv4stream.run.runtime import Runtime

        size = 48 * MB
        with Runtime.open(sys.argv[1], RunOptions(budget=10**10)) as rt:
            rt.session().prefill([1, 2, 3, 4], last_only=True)
            reuse = [faults_of_a_fresh_array(size) for _ in range(3)][1:]
            kept = rss()  # the freed array's pages are still the heap's
        print(json.dumps({"reuse": reuse, "returned": kept - rss(), "pages": size // 4096}))
        """,
        str(ckpt),
    )
    assert max(out["reuse"]) <= 0.02 * out["pages"], out
    assert out["returned"] >= 44 << 20, out
