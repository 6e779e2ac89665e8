"""Which SIMD instructions numba compiles for: the gate of the fast-numerics kernel variants.

numba builds its LLVM target machine from `NUMBA_CPU_NAME` (else the host's name) and
`NUMBA_CPU_FEATURES` (else, for any name but `generic`, the host's full feature string; for
`generic`, none). LLVM starts from the CPU name's own features and applies the string's `+x` /
`-x` on top. `features()` reproduces that: the string's explicit entries win, the name's
defaults come from a small table, and a name the table does not know contributes nothing, so
an unknown target falls back to the exact kernels rather than risk an instruction it lacks (an
illegal instruction kills the process with SIGILL; it does not raise).

`variant(kind)` names the kernels `q8` / `bf16` may compile: "avx512" (VNNI for FP4 x int8;
BF16 + VBMI for the BF16 paths), "avx2" (AVX2 + FMA: `vpmaddubsw`/`vpmaddwd`, float32 FMA), or
None (the exact kernels).
"""

from __future__ import annotations

import functools

_AVX2 = frozenset({"avx", "avx2", "fma", "f16c", "bmi2", "sse4.1", "sse4.2", "ssse3"})
_SKX = _AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
_CLX = _SKX | {"avx512vnni"}
_CPX = _CLX | {"avx512bf16"}
_ICX = _CLX | {"avx512vbmi", "avx512vbmi2", "avx512bitalg", "avx512ifma", "avx512vpopcntdq"}
_SPR = _ICX | {"avx512bf16", "avx512fp16", "avxvnni"}
_ZN4 = _ICX | {"avx512bf16"}

# The defaults LLVM gives these names (what matters here only; see llvm/lib/Target/X86/X86.td).
_BY_NAME = {
    **dict.fromkeys(("generic", "x86-64", "x86-64-v2", "nehalem", "westmere", "sandybridge", "ivybridge"), frozenset()),
    **dict.fromkeys(
        ("x86-64-v3", "haswell", "broadwell", "skylake", "alderlake", "raptorlake", "znver1", "znver2", "znver3"), _AVX2
    ),
    **dict.fromkeys(("x86-64-v4", "skylake-avx512", "skx"), _SKX),
    "cascadelake": _CLX,
    "cooperlake": _CPX,
    **dict.fromkeys(("icelake-client", "icelake-server", "tigerlake", "rocketlake"), _ICX),
    **dict.fromkeys(("sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d"), _SPR),
    **dict.fromkeys(("znver4", "znver5"), _ZN4),
}

# What each variant needs, per product kind.
NEEDS = {
    ("avx512", "fp4"): ("avx512f", "avx512bw", "avx512vnni"),
    ("avx512", "fp8"): ("avx512f", "avx512bw", "avx512bf16", "avx512vbmi"),
    ("avx512", "bf16"): ("avx512f", "avx512bw", "avx512bf16"),
    ("avx2", "fp4"): ("avx", "avx2", "fma"),
    ("avx2", "fp8"): ("avx", "avx2", "fma"),
    ("avx2", "bf16"): ("avx", "avx2", "fma"),
}


def target() -> tuple[str, str]:
    """(CPU name, feature string) exactly as numba's JIT target machine gets them."""
    import llvmlite.binding as llvm
    from numba.core import config
    from numba.core.codegen import get_host_cpu_features

    name = config.CPU_NAME if config.CPU_NAME is not None else llvm.get_host_cpu_name()
    feats = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return name, feats


def effective(name: str, feats: str) -> frozenset[str]:
    """The features LLVM enables for (name, feature string), as far as this module can tell:
    the name's table defaults, then the string's explicit +x / -x in order."""
    on = set(_BY_NAME.get(name.lower(), frozenset()))
    for item in filter(None, (f.strip() for f in feats.split(","))):
        flag, feat = item[0], item[1:]
        if flag == "+":
            on.add(feat)
        elif flag == "-":
            on.discard(feat)
    return frozenset(on)


@functools.cache
def features() -> frozenset[str]:
    """The features numba compiles for in this process (read once: numba reads its config once)."""
    return effective(*target())


def variant_for(kind: str, feats: frozenset[str]) -> str | None:
    for v in ("avx512", "avx2"):
        if all(f in feats for f in NEEDS[(v, kind)]):
            return v
    return None


def variant(kind: str) -> str | None:
    """'avx512', 'avx2' or None (exact kernels) for kind 'fp4', 'fp8' or 'bf16'."""
    return variant_for(kind, features())


def describe() -> str:
    """One line: the target numba compiles for and the variant of each kind."""
    name, _ = target()
    simd = sorted(f for f in features() if f.startswith(("avx", "fma")))
    kinds = " ".join(f"{k}={variant(k) or 'exact'}" for k in ("fp4", "fp8", "bf16"))
    return f"cpu {name} [{' '.join(simd)}] -> {kinds}"
