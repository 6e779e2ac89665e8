"""Suite-wide setup: compile the numba kernels once, before any test (or pytest-xdist worker) starts.

On a fresh clone numba's cache is cold and the first `dsv4` subprocess would spend a minute or
two compiling (in a child, outside its budget) inside whichever test came first, past that
test's subprocess timeout on a loaded machine. Compiling here (one child per core), without a
timeout, leaves every later process a warm cache; the tests of the cold-cache path point
NUMBA_CACHE_DIR elsewhere.

Also marks the tests listed in tests/slow.txt `slow` (`make test` deselects them), and holds
the generated checkpoints several files share: `family` runs a test once per model family
(tests/test_engine_invariants.py), on the same V4 and V4.1 checkpoints the family-only files use.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dsv4stream import kernels
from dsv4stream.run.compile import compile_kernels_apart

SLOW_LIST = Path(__file__).with_name("slow.txt")

# What runs keep between them (`files.state_dir`: `--speculate auto`'s memory) goes to a folder of
# this process's, never the user's cache, and is off unless a test turns it on: a test's policy
# decisions (watches, pass counts) must not depend on which tests ran before it in this worker.
# Set at import, before any test or child process (children inherit it).
_STATE_DIR = os.environ["DSV4_STATE_DIR"] = tempfile.mkdtemp(prefix="dsv4-test-state-")
os.environ["DSV4_SPECULATE_MEMORY"] = "off"


def slow_ids() -> set[str]:
    """The test ids in tests/slow.txt (whole functions or single parameters)."""
    lines = (line.strip() for line in SLOW_LIST.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    slow = slow_ids()
    for item in items:
        if item.nodeid in slow or item.nodeid.split("[")[0] in slow:
            item.add_marker(pytest.mark.slow)


def pytest_sessionstart(session):
    # a cold cache (a fresh clone, as in CI): one compiling child per core, as `dsv4 run` does,
    # not every unit in this process. Measured 2026-12-06 (Emerald Rapids, empty cache): 107
    # CPU-s in one process; two children 128 CPU-s split about evenly, so ~65 s instead of
    # ~107 s of wall time on 2 idle cores. A warm cache returns at once. Here, before pytest-xdist
    # starts its workers (`make test`'s -n): they find the cache warm instead of compiling twice.
    if not hasattr(session.config, "workerinput"):
        compile_kernels_apart()


@pytest.fixture(scope="session", autouse=True)
def _warm_kernel_cache():
    if kernels.backend_name() == "fast":
        compile_kernels_apart()  # warm by now (pytest_sessionstart): returns at once
        kernels.warmup()  # loads them from the cache into this process (the in-process tests)


@pytest.fixture(scope="module", autouse=True)
def _kernel_numerics_default_per_file():
    """Each test file starts and ends with the kernels' default numerics (exact), as in a process
    of its own: a module-scoped fixture that runs an engine pass (which sets the numerics it
    runs) would otherwise leave them to the next file of the same pytest-xdist worker."""
    kernels.set_numerics("exact")
    yield
    kernels.set_numerics("exact")


@pytest.fixture(autouse=True)
def _kernel_numerics_put_back():
    """Each test leaves the kernels' numerics (`kernels.set_numerics`, a process global) as it found
    them: a test that calls the kernels directly expects the default, whichever files its process
    ran before (a pytest-xdist worker runs them in another order). Engines set theirs each pass."""
    mode = kernels.get_numerics()
    yield
    if kernels.get_numerics() != mode:
        kernels.set_numerics(mode)


@pytest.fixture(scope="session")
def real_vocab_ckpt(tmp_path_factory):
    """A generated tiny V4 checkpoint carrying the real V4 tokenizer's vocabulary (129,280 rows)
    and its tokenizer, packed (the default --tok): every prompt goes through the real BPE."""
    from dsv4stream import synth
    from dsv4stream.text.tokenizer import pack_tokenizer

    path = synth.make_checkpoint(
        tmp_path_factory.mktemp("cli") / "tiny", preset="tiny", seed=3, vocab_size=synth.REAL_VOCAB, tokenizer=True
    )
    pack_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def real_vocab_tok(real_vocab_ckpt):
    from dsv4stream.text.tokenizer import Tokenizer

    return Tokenizer.load(real_vocab_ckpt)


@pytest.fixture(scope="session")
def tiny_v41(tmp_path_factory):
    """A generated DeepSeek-V4.1 checkpoint (synth preset tiny-v41, seed 1), read-only for tests."""
    from dsv4stream.synth import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("v41") / "tiny-v41", "tiny-v41", seed=1)


@pytest.fixture(scope="session")
def tiny_v4(tmp_path_factory):
    """A generated V4 checkpoint (preset tiny, seed 4) whose 6 routed experts are picked unevenly
    (route_skew 0.3): a 48-token prompt touches more experts than a small cache holds."""
    from dsv4stream import synth

    path = tmp_path_factory.mktemp("v4") / "tiny"
    return synth.make_checkpoint(path, preset="tiny", seed=4, route_skew=0.3, n_routed_experts=6)


@pytest.fixture(scope="session")
def tiny_v41_long(tmp_path_factory):
    """A generated V4.1 checkpoint (preset tiny-v41-long, seed 3): window 4, index_topk 3 and a
    candidate pool of 3 blocks of 2, so a 48-token prompt goes past all of them."""
    from dsv4stream.synth import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("v41") / "tiny-v41-long", "tiny-v41-long", seed=3)


@dataclass
class Family:
    """One model family's generated checkpoint and its engines, for the invariants every family
    keeps. `rtol`: the largest error of a logits row, relative to the row's largest logit, that
    another chunking or segmenting may cause (float rounding only, in `exact()`'s numerics)."""

    name: str
    path: Path
    rtol: float
    _engines: dict = field(default_factory=dict, repr=False)

    def engine(self, numerics: str = "official"):
        """The engine as `dsv4` opens it (V4.1: official numerics, owner index keys), cached."""
        from dsv4stream.engine.session import Engine
        from dsv4stream.engine.stack_v41 import V41Options

        if numerics not in self._engines:
            v41 = V41Options(numerics) if self.name == "v41" else None
            self._engines[numerics] = Engine.open(self.path, v41=v41)
        return self._engines[numerics]

    def exact(self):
        """The engine whose chunkings differ by float rounding only (V4.1: fp32 numerics; the
        official numerics' FP8 grids are checked in tests/test_v41_engine.py)."""
        return self.engine("fp32" if self.name == "v41" else "official")

    def ids(self, n: int, seed: int = 7):
        """`n` random token ids of the vocabulary, past the special ids 0 and 1."""
        import numpy as np

        return np.random.default_rng(seed).integers(2, self.engine().cfg.vocab_size, n)


@pytest.fixture(scope="session", params=["v4", "v41"])
def family(request) -> Family:
    """Each model family in turn: V4 on `tiny_v4`, V4.1 on `tiny_v41_long`."""
    if request.param == "v4":
        return Family("v4", request.getfixturevalue("tiny_v4"), rtol=1e-5)
    return Family("v41", request.getfixturevalue("tiny_v41_long"), rtol=1e-4)


def pytest_unconfigure(config):
    shutil.rmtree(_STATE_DIR, ignore_errors=True)  # this process's (a test may point the variable elsewhere)
