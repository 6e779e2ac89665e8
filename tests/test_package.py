"""The package is a regular package and every module comes from this checkout."""

from pathlib import Path

import dsv4stream
import dsv4stream.engine.session
import dsv4stream.model.moe

ROOT = Path(__file__).resolve().parent.parent


def test_regular_package_with_version():
    assert dsv4stream.__file__ is not None, "dsv4stream is a namespace package: add dsv4stream/__init__.py"
    assert len(list(dsv4stream.__path__)) == 1
    assert isinstance(dsv4stream.__version__, str) and dsv4stream.__version__[0].isdigit()


def test_modules_load_from_this_tree():
    for mod in (dsv4stream, dsv4stream.engine.session, dsv4stream.model.moe):
        assert Path(mod.__file__).resolve().is_relative_to(ROOT / "dsv4stream"), mod.__file__
