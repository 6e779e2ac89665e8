"""The docs cannot drift from the tool: links resolve, quoted commands print what the docs
quote, and every number in the README is computed here from the code.

- Links: every relative link and image in README.md, docs/*.md and bench/README.md names a
  file that exists, and a `#anchor` names a heading of that file (GitHub's slug rule).
- Quoted commands: a fenced block right after a `<!-- doc-test -->` line starts with
  `$ dsv4 ...`; the command is run in-process from the repository root and every quoted line
  must appear in its output, in order. `...` alone on a line skips output lines; `...` or `…`
  inside a line stands for any text (figures that change from run to run).
- README numbers: every number in the README's prose and tables (code is left out: its
  numbers are example arguments) is one this test computes: the release table from the
  release configs through the planner and the tensor list, the rest from pyproject.toml and
  the CLI itself.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

import dsv4stream
from dsv4stream.checkpoint.config import ModelConfig
from dsv4stream.checkpoint.spec import model_specs
from dsv4stream.checkpoint.tensors import released_nbytes
from dsv4stream.run.planner import gb_up, minimum_budget, needs_from_config, plan, smallest_budget
from dsv4stream.synth import release_config

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(dsv4stream.__file__).resolve().parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")


# ---- links ------------------------------------------------------------------------------
def prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links and numbers there are examples)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    out: set[str] = set()
    seen: dict[str, int] = {}
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of `path` whose file or anchor does not exist."""
    bad = []
    for m in LINK.finditer(prose(path.read_text(encoding="utf-8"))):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## The `--verify` flag\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#the---verify-flag) [ok](#page) [web](https://example.com/x)\n"
        "[gone](missing.md) [no anchor](other.md#nothing) ![img](pic.png)\n"
        "```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nothing: no heading #nothing in other.md",
        "pic.png: no such file",
    ]


# ---- quoted commands --------------------------------------------------------------------
def quoted_commands(path: Path, marker: str = "doc-test") -> list[tuple[str, list[str]]]:
    """(command, quoted output lines) of every block marked `<!-- MARKER -->` in `path`."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(rf"^<!-- {marker} -->\n```[^\n]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        lines = m.group(1).rstrip("\n").split("\n")
        assert lines[0].startswith("$ dsv4 "), f"{path.name}: a doc-test block starts with `$ dsv4 ...`"
        out.append((lines[0][2:], lines[1:]))
    return out


def line_pattern(quoted: str) -> re.Pattern:
    parts = re.split(r"\.\.\.|…", quoted)
    return re.compile(".*".join(re.escape(p) for p in parts) + r"\Z")


def missing_lines(quoted: list[str], output: list[str]) -> list[str]:
    """Quoted lines not found in `output` in order (`...` alone skips lines)."""
    i, missing = 0, []
    for q in quoted:
        if q.strip() in ("...", "…"):
            continue
        pat = line_pattern(q)
        j = next((k for k in range(i, len(output)) if pat.match(output[k])), None)
        if j is None:
            missing.append(q)
        else:
            i = j + 1
    return missing


def run_dsv4(command: str, capsys, monkeypatch) -> list[str]:
    from dsv4stream.cli import main

    monkeypatch.chdir(ROOT)
    argv = shlex.split(command)[1:]
    try:
        main(argv)
    except SystemExit as e:
        assert not e.code, f"`{command}` exited {e.code}: {capsys.readouterr().err}"
    got = capsys.readouterr()
    return (got.out + got.err).splitlines()


QUOTED = [(p, c, q) for p in DOCS for c, q in quoted_commands(p)]


@pytest.mark.parametrize("path,command,quoted", QUOTED, ids=[f"{p.name}: {c}" for p, c, _ in QUOTED])
def test_quoted_commands_print_the_lines_the_docs_quote(path, command, quoted, capsys, monkeypatch):
    assert missing_lines(quoted, run_dsv4(command, capsys, monkeypatch)) == []


# Blocks marked `<!-- doc-test: demo -->` quote a command on the `make demo` checkpoint
# (`.demo/checkpoint`); the test builds one of the same shapes with its routed experts as
# sparse-file holes (headers and plans are the same; the text would not be), packed as `make demo` packs it.
DEMO_QUOTED = [(p, c, q) for p in DOCS for c, q in quoted_commands(p, "doc-test: demo")]


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory) -> Path:
    from dsv4stream.synth import make_checkpoint
    from dsv4stream.trunkpack.writer import pack_trunk

    ckpt = make_checkpoint(tmp_path_factory.mktemp("demo") / "checkpoint", "demo", seed=0, sparse_experts=True)
    pack_trunk(ckpt, progress=False)  # as `make demo` does: its plans hold fast's int8 head copy
    return ckpt


@pytest.mark.slow
@pytest.mark.parametrize("path,command,quoted", DEMO_QUOTED, ids=[f"{p.name}: {c}" for p, c, _ in DEMO_QUOTED])
def test_quoted_demo_commands_print_the_lines_the_docs_quote(
    path, command, quoted, demo_checkpoint, capsys, monkeypatch
):
    command = command.replace(".demo/checkpoint", str(demo_checkpoint))
    assert missing_lines(quoted, run_dsv4(command, capsys, monkeypatch)) == []


def test_docs_quote_commands_for_the_test_to_run():
    assert len(QUOTED) >= 3 and len(DEMO_QUOTED) >= 1


def test_the_quote_check_catches_a_changed_line():
    out = ["model: x", "working set per pass: 258 experts = 3.21 GiB (3.45 GB)", "trunk: 6.27 GiB (6.73 GB); embed"]
    assert missing_lines(["working set per pass: 258 experts = …", "...", "trunk: 6.27 GiB ..."], out) == []
    assert missing_lines(["working set per pass: 114 experts = …"], out) == ["working set per pass: 114 experts = …"]
    assert missing_lines(["trunk: …", "working set per pass: …"], out) == ["working set per pass: …"]  # order


# ---- README numbers ---------------------------------------------------------------------
NUMBER = re.compile(r"(?<![\w.\-/:])\d+(?:,\d{3})*(?:\.\d+)?(?![\w-]|\.\d|,\d)")

# README row name -> the release's config.json as a dict
RELEASES = {
    "DeepSeek-V4-Flash-0731": lambda: release_config("flash-0731"),
    "DeepSeek-V4-Flash (the May preview)": lambda: json.loads((PKG / "v4_flash_config.json").read_text()),
    "DeepSeek-V4-Pro": lambda: json.loads((PKG / "v4_pro_config.json").read_text()),
    "DeepSeek-V4.1-Flash": lambda: json.loads((PKG / "v41_flash_config.json").read_text()),
}


def numbers(text: str) -> list[str]:
    """Numbers of the prose and tables (ordered-list markers are structure, not figures)."""
    return NUMBER.findall(re.sub(r"^\s*\d+\.\s", "", prose(text), flags=re.MULTILINE))


def release_row(cfg: ModelConfig) -> list[str]:
    """disk, smallest --budget, the budget whose cache holds one pass's working set."""
    disk = sum(released_nbytes(cfg, s) for s in model_specs(cfg))
    needs = needs_from_config(cfg, head_copy=True)  # fast's int8 head copy: a packed checkpoint, AVX2 or VNNI
    want = min(needs.working_set, needs.total_experts)
    useful = smallest_budget(needs, lambda p: p.expert_slots >= want)
    return [f"{disk / 1e9:.1f} GB", gb_up(minimum_budget(needs)), gb_up(useful)]


def table_rows(text: str, header_start: str) -> list[list[str]]:
    """Cells of the markdown table whose header row starts with `header_start`."""
    lines = text.split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header_start))
    rows = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


@pytest.fixture(scope="module")
def computed_release_rows() -> dict[str, list[str]]:
    return {name: release_row(ModelConfig.from_dict(make())) for name, make in RELEASES.items()}


def test_the_readme_release_table_is_the_planners(computed_release_rows):
    rows = table_rows(README.read_text(encoding="utf-8"), "| release |")
    assert {r[0]: r[2:] for r in rows} == computed_release_rows


def test_every_number_in_the_readme_is_computed(computed_release_rows, capsys):
    from dsv4stream.cli import main

    checked = {n.split()[0] for row in computed_release_rows.values() for n in row}
    # "Python 3.11 or newer": the floor pyproject.toml declares
    py = re.search(r'requires-python = ">=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    checked.add(py)
    # "exit code 2": what a user mistake exits with
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(ROOT / "no-such-checkpoint")])
    assert capsys.readouterr().err.startswith("dsv4: ")
    checked.add(str(exit_.value.code))
    unchecked = sorted(set(numbers(README.read_text(encoding="utf-8"))) - checked)
    assert unchecked == [], f"numbers in README.md that no test computes: {unchecked}"


def test_the_number_check_sees_numbers_in_prose_and_tables_only():
    text = "1. Plan.\nRuns at 42 tokens/s on V4.1 and V4-Flash-0731, `--budget 16`.\n```\ndsv4 x --gen 7\n```\n"
    text += "| 1,024 | 3.5 GB |\n"
    assert numbers(text) == ["42", "1,024", "3.5"]


# ---- the budget table of real-models.md -------------------------------------------------
def test_the_v4_flash_budget_table_is_the_planners():
    text = (ROOT / "docs" / "real-models.md").read_text(encoding="utf-8")
    cfg = ModelConfig.from_dict(json.loads((PKG / "v4_flash_config.json").read_text()))
    needs = needs_from_config(cfg, head_copy=True)  # as the table says: fast, packed, AVX2 or VNNI
    rows = table_rows(text, "| `--budget` | trunk layers resident |")
    assert len(rows) >= 5
    for budget, pinned, slots, segment, _ in rows:
        p = plan(needs, round(float(budget.removesuffix(" GB")) * 1e9))
        assert (int(pinned.split()[0]), int(slots), int(segment)) == (
            p.pinned_layers,
            p.expert_slots,
            p.prefill_segment,
        ), budget


# ---- file names in architecture.md --------------------------------------------------------
def missing_paths(text: str) -> list[str]:
    """`dir/file.py` names in inline code that exist neither in the package nor the repository."""
    names = set(re.findall(r"`((?:\w+/)+\w+\.py)`", text))
    return sorted(n for n in names if not (PKG / n).exists() and not (ROOT / n).exists())


def test_the_files_architecture_md_names_exist():
    assert missing_paths((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")) == []


def test_the_path_check_catches_a_moved_file():
    assert missing_paths("open `checkpoint/spec.py`, `tools/demo.py` and `store/layout.py`") == ["store/layout.py"]


def test_the_layer_table_of_architecture_md_is_the_import_rule():
    from test_layout import MAY_IMPORT

    rows = table_rows((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"), "| package |")
    table = {}
    for package, _, may in rows:
        name = package.strip("`/")
        table[name] = None if may.startswith("anything") else set(re.findall(r"`([\w.]+)`", may))
    assert table == MAY_IMPORT
