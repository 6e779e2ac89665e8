"""The package's layout rules that imports can show: each layer imports only the layers below
it, nothing but the CLI imports the CLI, the expert store is model-agnostic, and `model/` is math
over frozen weights.

Imports are read with `ast` from the source files (never by matching strings), relative ones
resolved against the module's package, so `from ..catalog import X` and
`import dsv4stream.checkpoint.catalog` count the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dsv4stream"

# What a model/ module may import from the project: the config, the errors, the kernels
# (arrays in, arrays out) and model/ itself. Anything else (catalog, store, streaming, trunk
# file, loading, providers, runtime, ...) is the checkpoint / I/O side.
MODEL_MAY_IMPORT = ("dsv4stream.checkpoint.config", "dsv4stream.errors", "dsv4stream.kernels", "dsv4stream.model")
# Standard-library and third-party modules that open files, start threads or processes.
IO_MODULES = {
    "os", "io", "pathlib", "shutil", "tempfile", "threading", "concurrent", "multiprocessing", "subprocess",
    "socket", "mmap", "fcntl", "resource", "queue", "asyncio", "json", "pickle", "safetensors", "psutil",
}  # fmt: skip


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module `source` (the text of `module`) imports, at any depth."""
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base)
                name = f"{prefix}.{node.module}" if node.module else prefix
            else:
                name = node.module or ""
            out.add(name)
            # `from . import x` imports the module x
            out.update(f"{name}.{a.name}" for a in node.names if not node.module)
    return out


def layering_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    bad = []
    for name in sorted(imported_modules(source, module, is_package)):
        top = name.split(".")[0]
        if top == "dsv4stream":
            if not any(name == a or name.startswith(a + ".") for a in MODEL_MAY_IMPORT):
                bad.append(name)
        elif top in IO_MODULES:
            bad.append(name)
    return bad


def model_modules() -> list[tuple[str, Path]]:
    out = []
    for p in sorted((PKG / "model").glob("*.py")):
        name = "dsv4stream.model" if p.name == "__init__.py" else f"dsv4stream.model.{p.stem}"
        out.append((name, p))
    return out


@pytest.mark.parametrize("module,path", model_modules(), ids=[m for m, _ in model_modules()])
def test_model_modules_import_no_io(module, path):
    bad = layering_violations(path.read_text(), module, path.name == "__init__.py")
    assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}: model/ is math over frozen weights"


@pytest.mark.parametrize(
    "line",
    [
        "from ..catalog import Catalog",
        "from ..store.directio import aligned_buffer",
        "from .. import streaming",
        "import dsv4stream.trunkpack.reader",
        "from ..loading import load_layer",
        "import os",
        "from concurrent.futures import ThreadPoolExecutor",
        "def f():\n    import threading",
    ],
)
def test_the_check_catches_an_io_import(line):
    # the same check on a model module with one such line added must fail
    src = (PKG / "model" / "moe.py").read_text() + "\n" + line + "\n"
    assert layering_violations(src, "dsv4stream.model.moe")


def test_relative_imports_resolve_against_the_package():
    got = imported_modules(
        "from ..kernels import QWeight\nfrom .ops import rms_norm\nfrom . import rope\n", "dsv4stream.model.moe"
    )
    assert got == {"dsv4stream.kernels", "dsv4stream.model.ops", "dsv4stream.model", "dsv4stream.model.rope"}
    assert imported_modules("from .moe import x\n", "dsv4stream.model", is_package=True) == {"dsv4stream.model.moe"}


# Leaf modules every layer may import: they import nothing of the project but each other.
LEAVES = ("errors", "files", "jsonio")
# Project packages each top-level package may import (besides itself and the leaves), in data-flow
# order. A dotted entry allows one module only. Adding a package means adding its line here.
MAY_IMPORT: dict[str, set[str]] = {
    "kernels": {"checkpoint.formats"},
    # synth writes the real tokenizer into generated checkpoints, and sizes a small one's Engram classes
    "checkpoint": {"kernels", "text.tokenizer", "engram.vocab"},
    "model": {"checkpoint.config", "kernels"},
    "store": set(),
    "trunkpack": {"checkpoint", "store"},
    "weights": {"checkpoint", "kernels", "model"},
    "streaming": {"checkpoint", "kernels", "model", "store", "trunkpack", "weights"},
    "engram": {"checkpoint.engram_layout"},  # token classes and hash row ids: integer math only
    "text": {"checkpoint"},
    "engine": {"checkpoint", "engram", "kernels", "model", "text", "weights"},
    "gpu": {"checkpoint", "kernels"},
    "run": {"checkpoint", "engine", "gpu", "kernels", "model", "store", "streaming", "text", "trunkpack", "weights"},
    "measure": {"checkpoint", "run", "store"},
    "server": {"checkpoint", "engine", "run", "text"},
    "cli": None,  # the top: may import anything
}


# Top-level modules every layer may use: they import nothing of the project but `errors`.
def package_modules() -> list[tuple[str, str, Path]]:
    """(top-level package, module name, path) of every module inside a subpackage."""
    out = []
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG).with_suffix("").parts)
        if len(parts) < 2:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((parts[0], ".".join(["dsv4stream", *parts]), p))
    return out


def cross_layer_imports(top: str, module: str, path: Path) -> list[str]:
    allowed = MAY_IMPORT[top]
    if allowed is None:
        return []
    bad = []
    for name in sorted(imported_modules(path.read_text(), module, path.name == "__init__.py")):
        parts = name.split(".")
        if parts[0] != "dsv4stream" or len(parts) < 2 or parts[1] in (top, *LEAVES):
            continue
        if name == "dsv4stream":
            continue
        rest = ".".join(parts[1:])
        if not any(rest == a or rest.startswith(a + ".") or a.startswith(rest + ".") for a in allowed):
            bad.append(name)
    return bad


def test_every_package_has_a_rule():
    tops = {top for top, _, _ in package_modules()}
    assert tops <= set(MAY_IMPORT), f"packages without an import rule: {sorted(tops - set(MAY_IMPORT))}"


@pytest.mark.parametrize("top,module,path", package_modules(), ids=[m for _, m, _ in package_modules()])
def test_layers_import_only_the_layers_below(top, module, path):
    bad = cross_layer_imports(top, module, path)
    assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}; {top}/ may import only {sorted(MAY_IMPORT[top])}"


@pytest.mark.parametrize(
    "top,line",
    [
        ("server", "from ..cli.run import make_pick"),
        ("store", "from ..checkpoint.spec import EXPERT_NAME"),
        ("text", "from ..engine import Engine"),
        ("weights", "from ..streaming.expert_layout import expert_layouts"),
    ],
)
def test_the_layer_check_catches_an_upward_import(top, line, tmp_path):
    module = next(m for t, m, p in package_modules() if t == top and not p.name.startswith("__"))
    path = tmp_path / "m.py"
    path.write_text(line + "\n")
    assert cross_layer_imports(top, module, path)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_only_leaves(leaf):
    path = PKG / f"{leaf}.py"
    project = {n for n in imported_modules(path.read_text(), f"dsv4stream.{leaf}") if n.startswith("dsv4stream")}
    assert project <= {f"dsv4stream.{x}" for x in LEAVES}, f"{leaf}.py imports {sorted(project)}: it must stay a leaf"


def test_the_leaf_check_catches_a_project_import():
    src = (PKG / "jsonio.py").read_text() + "\nfrom .checkpoint.config import ModelConfig\n"
    assert "dsv4stream.checkpoint.config" in imported_modules(src, "dsv4stream.jsonio")
