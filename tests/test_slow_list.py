"""tests/slow.txt may only name tests that exist: a renamed test must not leave `make test` silently
skipping nothing (or its new name silently slow)."""

import ast
from pathlib import Path

from conftest import pytest_collection_modifyitems, slow_ids

ROOT = Path(__file__).resolve().parent.parent


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_slow_entry_names_a_test_function():
    missing = []
    for entry in sorted(slow_ids()):
        file, _, name = entry.partition("::")
        path = ROOT / file
        if not path.is_file() or name.split("[")[0] not in _functions(path):
            missing.append(entry)
    assert not missing, missing


class _Item:
    def __init__(self, nodeid: str):
        self.nodeid, self.marks = nodeid, []

    def add_marker(self, mark):
        self.marks.append(mark.name)


def test_listed_functions_and_parameters_are_marked_and_others_not():
    function = next(e for e in sorted(slow_ids()) if "[" not in e)
    param = next(e for e in sorted(slow_ids()) if "[" in e)
    items = [_Item(function + "[any]"), _Item(function), _Item(param), _Item(param.split("[")[0] + "[not-listed]")]
    pytest_collection_modifyitems(None, items)
    assert [i.marks for i in items] == [["slow"], ["slow"], ["slow"], []]
