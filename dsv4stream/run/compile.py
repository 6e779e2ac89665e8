"""Compiling the numba kernels a checkpoint needs, outside the budgeted process.

Owns: the kernel forms a checkpoint's weights need (`checkpoint_forms`), splitting their
units among child processes (`split`: whole numba functions per child, longest first, one
child per core), running them with a `compiling kernels: N of M` line and an estimate
(`compile_kernels_apart`), and the one-line error when a child fails. The units, their costs
and the cache markers are the kernels' (`kernels.warm`).

Why children: LLVM takes hundreds of MB that the plan does not count; in children they never
enter the run's peak RSS, and the run then loads the kernels from the cache they wrote. Why
whole functions per child: numba keeps one index file per function and a process adding a
signature rewrites it whole (`numba/core/caching.py`, `IndexDataCacheFile.save_index`), so two
processes adding signatures to one function at once could each drop the other's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .. import kernels
from ..checkpoint.catalog import Catalog
from ..errors import Dsv4Error
from ..kernels import cpu, warm
from ..trunkpack.headcopy import COL_MULTIPLE
from . import ticker

Warn = Callable[[str], None]


def checkpoint_forms(cat: Catalog, numerics: str = "exact") -> tuple[str, ...]:
    """The kernel forms (`warm.FORMS`) that the products of `cat`'s weights reach under the
    kernels' `numerics` (what `kernels.set_numerics` gets), in FORMS order.

    Every model runs attention ("base") and mHC's float32 products ("f32"); the rest follows the
    stored dtypes of its 2-D tensors (a quantised weight's form also takes its scale's dtype and
    the config's FP8 block). Under "fast" a weight also reaches the fast kernel of its kind where
    that kernel takes its width (`warm.fast_form_of`): a checkpoint none of whose FP4 weights is
    a multiple of 256 wide never calls the FP4 x int8 driver, so it is not compiled. The exact
    forms stay: the products the fast kernels do not take run them."""
    need = {"base", "f32"}
    for name, e in cat.entries.items():
        if len(e.shape) != 2:
            continue
        if e.dtype in ("I8", "F8_E4M3") and name.endswith(".weight"):
            s = cat.entries.get(name[: -len("weight")] + "scale")
            if s is None:
                continue  # not a quantised linear (an I8 table, say)
            kind = "fp4" if e.dtype == "I8" else "fp8"
            size = 1 if s.dtype in ("F8_E8M0", "U8", "I8") else 4
            need.add(warm.form_of(kind, size, cat.config.fp8_block))
            cols = e.shape[1] * (2 if kind == "fp4" else 1)  # FP4: two values a byte
        elif e.dtype == "BF16":
            kind, size, cols = "bf16", None, e.shape[1]
            need.add("bf16")
        else:
            continue
        if numerics == "fast":
            need.add(warm.fast_form_of(kind, size, cols))
    head = cat.entries.get("head.weight")
    bf16_head = head is not None and head.dtype == "BF16" and head.shape[1] % COL_MULTIPLE == 0
    if numerics == "fast" and bf16_head and cpu.variant("fp4") is not None:  # `kernels.head.copy_runs`
        need.add("fast-head-q8")  # the int8 head copy's kernel, where the pack holds one (`trunkpack.headcopy`)
    need.discard(None)
    return tuple(f for f in warm.FORMS if f in need)


def prepare_kernels(cat: Catalog, numerics: str | None, say: Warn | None = None) -> float:
    """Everything `cat` reaches under `numerics` (an engine's mode; None: the family's default)
    compiled before the first token: in children where the cache lacks it (`compile_kernels_apart`,
    with its progress line), then loaded here (`kernels.warmup`). Returns the seconds the load
    took. `Runtime.open` does this inside its open; a command that opens an `Engine` itself
    (`dsv4 logits`) calls it first, so its first product does not compile in-process, silently."""
    from ..engine.numerics import DEFAULTS, canonical, kernel_mode

    mode = kernel_mode(cat.config.family, canonical(numerics) if numerics else DEFAULTS[cat.config.family])
    forms = checkpoint_forms(cat, mode)
    compile_kernels_apart(forms, say)
    return kernels.warmup(forms)


def split(units: list[str], children: int) -> list[list[str]]:
    """Units in at most `children` lists, each numba function's units in one list, the lists
    balanced by `warm.cost` (longest function first onto the least loaded list)."""
    groups: dict[str, list[str]] = {}
    for u in units:
        groups.setdefault(warm.function_of(u), []).append(u)
    order = sorted(groups.values(), key=lambda g: -sum(map(warm.cost, g)))
    bins: list[list[str]] = [[] for _ in range(max(1, min(children, len(order))))]
    for g in order:
        min(bins, key=lambda b: sum(map(warm.cost, b))).extend(g)
    return [b for b in bins if b]


def estimate_seconds(bins: list[list[str]]) -> float:
    """Wall seconds the children should take on an idle machine like the one `warm.COST` was
    measured on: the longest child's units plus its start."""
    return max((sum(map(warm.cost, b)) for b in bins), default=0.0) + warm.START_SECONDS


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def compile_kernels_apart(
    forms: tuple[str, ...] | None = None, say: Warn | None = None, children: int | None = None
) -> tuple[int, float] | None:
    """On a cold numba cache, compile the kernels of `forms` (None: every form) in child
    processes and wait for them; then mark those forms compiled.

    Returns (units compiled, wall seconds), or None when the cache already held them (or the
    kernels are not numba's)."""
    if kernels.backend_name() != "fast":
        return None
    missing = warm.missing_forms(forms)
    if not missing:
        return None
    units = warm.units(missing)
    bins = split(units, children or _cores())
    est = estimate_seconds(bins)
    if say is not None:
        say(
            f"compiling {len(units)} numba kernels for this checkpoint in {len(bins)} separate"
            f" process{'es' if len(bins) > 1 else ''} (once per installation: about {est:.0f} s on idle"
            " cores, longer on a busy machine; cached after), so that the compiler's memory stays outside --budget"
        )
    t0 = time.perf_counter()
    done = [0]
    with ticker.elapsed(f"compiling kernels: 0 of {len(units)}") as line:

        def count() -> None:
            done[0] += 1
            line.label = f"compiling kernels: {done[0]} of {len(units)}"

        failures = _run_children(bins, count)
    if failures:
        raise Dsv4Error(
            f"compiling the numba kernels failed in a child process ({failures[0]}); reinstall numba or set DSV4_DEBUG=1"
        )
    warm.mark_cache_complete(missing)
    took = time.perf_counter() - t0
    if say is not None:
        say(f"compiled {done[0]} kernels in {took:.1f} s (estimate {est:.0f} s)")
    return done[0], took


def _run_children(bins: list[list[str]], count: Callable[[], None]) -> list[str]:
    """Start one child per bin, count each unit it reports done; the last stderr line of each
    child that failed."""
    import dsv4stream

    env = dict(os.environ)
    src = str(Path(dsv4stream.__file__).resolve().parents[1])  # this checkout, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    lock = threading.Lock()
    # stderr to a file: a full pipe would stall a child while its stdout is being followed
    logs = [tempfile.TemporaryFile(mode="w+") for _ in bins]  # noqa: SIM115 (closed below)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dsv4stream.kernels.warm", *b],
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        for b, log in zip(bins, logs, strict=True)
    ]

    def follow(p: subprocess.Popen) -> None:
        for ln in p.stdout:
            if ln.startswith("done "):
                with lock:
                    count()

    threads = [threading.Thread(target=follow, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = []
    for p, log in zip(procs, logs, strict=True):
        if p.wait() != 0:
            log.seek(0)
            failed.append((log.read().strip().splitlines() or ["no message"])[-1])
        log.close()
    return failed
