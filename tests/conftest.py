"""Suite-wide setup: compile the numba kernels once, before any test starts a `dsv4` process.

On a fresh clone numba's cache is cold and the first `dsv4` subprocess would spend a minute or
two compiling (in a child, outside its budget) inside whichever test came first, past that
test's subprocess timeout on a loaded machine. Compiling here, without a timeout, leaves every
later process a warm cache; the tests of the cold-cache path point NUMBA_CACHE_DIR elsewhere.

Also marks the tests listed in tests/slow.txt `slow` (`make test` deselects them).
"""

from pathlib import Path

import pytest

from dsv4stream import kernels

SLOW_LIST = Path(__file__).with_name("slow.txt")


def slow_ids() -> set[str]:
    """The test ids in tests/slow.txt (whole functions or single parameters)."""
    lines = (line.strip() for line in SLOW_LIST.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    slow = slow_ids()
    for item in items:
        if item.nodeid in slow or item.nodeid.split("[")[0] in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _warm_kernel_cache():
    if kernels.backend_name() == "fast":
        kernels.warmup()


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
