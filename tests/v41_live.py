"""What the live V4.1 reference tests share: the local copy of DeepSeek's reference they need
(DSV4_V41_REFERENCE; docs/development.md says where to get it) and its Python packages, or a
skip of the importing module. Import it first: `from v41_live import REFERENCE`."""

from __future__ import annotations

import importlib.util
import os

import pytest

REFERENCE = os.environ.get("DSV4_V41_REFERENCE")
if not REFERENCE:
    pytest.skip("set DSV4_V41_REFERENCE to a local copy of DeepSeek's V4.1 reference", allow_module_level=True)
if any(importlib.util.find_spec(m) is None for m in ("torch", "sympy", "PIL")):
    pytest.skip("needs the oracle-v41 extra (torch, sympy, pillow)", allow_module_level=True)
