"""A run's numerics, both families: "exact", "official" or "fast" (`--numerics`).

Owns: the names (and the alias `fp32` = exact), each family's default, what a mode means for
a family (the process-wide kernel mode `kernels.set_numerics` takes, and whether V4.1's own
activation / KV grids run) and the one line the report shows. `Engine` applies it when it is
built and each session pass puts its engine's back (`ensure`) if another engine changed it
since; nothing else sets the kernels' numerics. (Two engines of different numerics must not
run passes at the same time in two threads: the setting is the process's.)

- exact: float32 activations everywhere (the transformers / DeepSeek fp32 checks' mode).
- official: DeepSeek's shipped rounding. V4: E4M3 per 128 (UE8M0 scales) before the FP8 / FP4
  linears its reference quantizes (`kernels.numerics`); V4.1: its own grids in the model
  (`model.v41.quant`: activations per 32, FP8 window KV, FP4 compressed KV and index keys),
  the kernels exact.
- fast: the fast kernels (int8 per 32 for FP4, BF16 for FP8 / BF16 weights). For V4.1 without
  its activation and KV grids: the fast kernels' own activation rounding is finer than the
  E4M3 grid it would replace, and the KV grids would only add rounding the fast path does not
  need (the cache is float32 either way), so fast stays at least as close to exact as official
  (tests/test_numerics_wiring.py measures it on the oracle fixtures).
"""

from __future__ import annotations

from ..checkpoint.config import V4, V41
from ..errors import UsageError

MODES = ("exact", "official", "fast")
ALIASES = {"fp32": "exact"}
CHOICES = (*MODES, *ALIASES)  # what --numerics accepts
DEFAULTS = {V4: "exact", V41: "official"}  # an engine opened without a mode (and `dsv4 logits`)
RUN_DEFAULT = "fast"  # run, serve, bench, the chat


def canonical(name: str) -> str:
    """The mode a --numerics value names (fp32 -> exact); UsageError for anything else."""
    mode = ALIASES.get(name, name)
    if mode not in MODES:
        raise UsageError(f"--numerics {name!r}: use {', '.join(CHOICES)}")
    return mode


def kernel_mode(family: str, mode: str) -> str:
    """What `kernels.set_numerics` gets: V4.1's official grid is the model's, its kernels exact."""
    return "exact" if family == V41 and mode == "official" else mode


def v41_grids(mode: str) -> bool:
    """Whether V4.1's activation and KV grids (`model.v41.quant`) run under `mode`."""
    return mode == "official"


def apply(family: str, mode: str) -> None:
    """Set this process's kernel numerics for an engine of `family` running `mode`."""
    from .. import kernels

    kernels.set_numerics(kernel_mode(family, mode))


def ensure(family: str, mode: str) -> None:
    """`apply` unless the kernels already run what `mode` needs (a session calls it each pass, so
    an engine keeps its numerics when another engine, built later, set the process's)."""
    from .. import kernels

    want = kernel_mode(family, mode)
    if kernels.get_numerics() != want:
        kernels.set_numerics(want)


def label(mode: str) -> str:
    """The numerics as the report and --stats-json show them: 'exact', 'official' or, for fast,
    the variant the CPU runs, e.g. 'fast (avx512: vnni, bf16, vbmi)'."""
    if mode != "fast":
        return mode
    from .. import kernels
    from ..kernels import cpu

    if kernels.backend_name() != "fast":
        return "fast (numpy reference backend: exact products)"
    variants = {k: cpu.variant(k) for k in ("fp4", "fp8", "bf16")}
    if set(variants.values()) == {None}:
        return "fast (no AVX2 on this target: exact products)"
    if len(set(variants.values())) > 1:
        return "fast (" + ", ".join(f"{k}: {v or 'exact'}" for k, v in variants.items()) + ")"
    v = variants["fp4"]
    feats = cpu.features()
    extra = [n for n, f in (("vnni", "avx512vnni"), ("bf16", "avx512bf16"), ("vbmi", "avx512vbmi")) if f in feats]
    return f"fast ({v}: {', '.join(extra)})" if v == "avx512" else f"fast ({v}: fma)"
