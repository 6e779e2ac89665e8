"""What a measurement ran on: the CPU model, the SIMD features the kernels can use, cores, load.

Every figure in bench/ and docs/performance.md carries this line: kernel speed depends on the
vector width (AVX2 or AVX-512) and a shared machine's load changes any wall-clock figure.
"""

from __future__ import annotations

import os
import platform

SIMD = ("sse4_2", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "asimd", "asimdhp", "sve")


def cpu_description() -> str:
    """`cpu='<model>' simd=<flags>`: x86 flags or the ARM equivalents from /proc/cpuinfo."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    model = info.get("model name") or info.get("Model") or platform.processor() or platform.machine()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    simd = [f for f in SIMD if f in flags]
    return f"cpu={model!r} simd={','.join(simd) or 'unknown'}"


def load_text() -> str:
    return ",".join(f"{x:.2f}" for x in os.getloadavg())


def machine_line() -> str:
    """One line: CPU, SIMD, cores, load averages (1, 5, 15 min)."""
    return f"{cpu_description()} cores={os.cpu_count()} load_avg={load_text()}"
