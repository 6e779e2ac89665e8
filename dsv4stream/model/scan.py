"""Which weights of a layer hold NaN or infinity: the diagnosis after non-finite numbers.

Runs only on the error path (a NumericsError was raised), so it may read every byte. It
walks the named weight dataclasses and reports attribute paths (`attn.wq_a.scale`), looking
at each array in its stored encoding: E8M0 scale byte 0xFF, E4M3FN 0x7F/0xFF, BF16 with an
all-ones exponent, non-finite float32. FP4 (E2M1) has no NaN encoding.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..kernels import QWeight


def _bad(a: np.ndarray, kind: str) -> bool:
    if a.dtype == np.uint8:
        return bool(np.any(a == 0xFF)) if kind == "e8m0" else bool(np.any((a & 0x7F) == 0x7F))
    if a.dtype == np.uint16:  # BF16: exponent bits all ones
        return bool(np.any((a & 0x7F80) == 0x7F80))
    if a.dtype.kind == "f":
        return not bool(np.isfinite(a).all())
    return False


def nonfinite_fields(obj: object, prefix: str = "") -> list[str]:
    """Attribute paths of the arrays under `obj` (a weights dataclass) holding NaN/inf."""
    out: list[str] = []
    if isinstance(obj, QWeight):
        if obj.on_device:
            return out
        if obj.kind == "fp8" and _bad(obj.data, "e4m3"):
            out.append(prefix.rstrip("."))
        if obj.kind in ("bf16", "f32") and _bad(obj.data, obj.kind):
            out.append(prefix.rstrip("."))
        if obj.scale is not None and _bad(obj.scale, "e8m0"):
            out.append(prefix + "scale")
        return out
    if isinstance(obj, np.ndarray):
        return [prefix.rstrip(".")] if obj.dtype.kind in "fu" and _bad(obj, "plain") else []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out += nonfinite_fields(getattr(obj, f.name), f"{prefix}{f.name}.")
    return out
