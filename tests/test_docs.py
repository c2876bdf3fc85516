"""The docs hold together: every relative link in README.md and docs/ resolves (files, folders
and heading anchors), every record docs/findings.md names is in bench/results/, no doc keeps a
'Next' list, findings stay one page, the figure tables give one figure per cell,
docs/structure.md maps every module in rows of at most 160 characters, and module docstrings
are notes of at most 15 lines (the rest lives in docs/)."""

import ast
import re
from pathlib import Path

import pytest
from repo import ROOT

DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_LINK = re.compile(r"\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S) if path.suffix == ".md" else ""
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [a or b for a, b in _LINK.findall(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    bad = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.is_file() and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor")
    assert not bad, f"{doc.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_records_findings_names_are_committed():
    text = (ROOT / "docs" / "findings.md").read_text()
    names = set(re.findall(r"`((?:archive/)?[\w.+-]+\.(?:json|txt))`", text))
    results = ROOT / "bench" / "results"
    missing = [n for n in sorted(names) if not (results / n).exists()
               and not (ROOT / "nanosched" / "profiler" / "profiles" / n).exists()
               and not (ROOT / "nanosched" / "schedules" / "shipped" / n).exists()]
    assert len(names) > 40 and not missing, f"docs/findings.md names missing records: {missing}"


def test_no_next_lists_in_docs():
    heads = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in DOCS
             for m in re.finditer(r"^#+ *Next.*$", p.read_text(), re.M)]
    assert not heads, f"'Next' lists belong in issues, not docs: {heads}"


def test_findings_is_one_page():
    lines = (ROOT / "docs" / "findings.md").read_text().splitlines()
    assert len(lines) <= 300, f"docs/findings.md has {len(lines)} lines: at most 300"


@pytest.mark.parametrize("name", ["measurements.md", "usage.md"])
def test_table_cells_hold_one_figure(name):
    text = (ROOT / "docs" / name).read_text()
    cells = [c.strip() for line in text.splitlines() if line.startswith("|")
             for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
    long = [c[:60] for c in cells if len(c) > 160]
    pairs = [c for c in cells if re.search(r"\d[^\s|]* / [^\s|]*\d", c)]
    assert not long and not pairs, f"docs/{name}: cells over 160 characters {long}, " \
        f"cells with two figures {pairs}"


@pytest.mark.parametrize("name", ["README.md", "docs/findings.md", "docs/measurements.md",
                                  "docs/usage.md"])
def test_the_code_paths_current_docs_name_exist(name):
    """Files move (bench/ and tests/ get subfolders): a current doc names them where they are.
    The notebook's records keep the paths of their day."""
    text = (ROOT / name).read_text()
    paths = set(re.findall(r"\b((?:bench|tests|nanosched)/[\w/.-]*\w\.(?:py|cu|sh|md))\b", text))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert paths and not missing, f"{name} names files that are not there: {missing}"


def test_bench_readme_maps_every_script():
    """bench/README.md names every script and module under bench/ (its path below bench/)."""
    text = (ROOT / "bench" / "README.md").read_text()
    scripts = sorted(p.relative_to(ROOT / "bench").as_posix()
                     for p in (ROOT / "bench").rglob("*")
                     if p.suffix in (".py", ".sh") and p.name != "__init__.py"
                     and "results" not in p.parts)
    missing = [s for s in scripts if f"`{s}`" not in text and f"`{Path(s).name}`" not in text]
    assert scripts and not missing, f"bench/README.md does not name {missing}"


def _structure_rows() -> list[str]:
    text = (ROOT / "docs" / "structure.md").read_text()
    return [line for line in text.splitlines() if line.startswith("| `")]


def _expand(name: str) -> list[str]:
    """`a/{b,c}.py` → `a/b.py`, `a/c.py`."""
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [e for alt in m.group(1).split(",")
            for e in _expand(name[:m.start()] + alt + name[m.end():])]


def test_structure_rows_fit_one_line():
    """docs/structure.md is a map: a row is a file's role and its main names, at most 160
    characters; the longer explanations live in the docs' module notes."""
    long = [f"{line[:60]}… ({len(line)})" for line in _structure_rows() if len(line) > 160]
    assert not long, f"docs/structure.md rows over 160 characters: {long}"


def test_structure_maps_every_module():
    """Every module under nanosched/ (a package's __init__.py aside) has a row: its own path
    (`a/{b,c}.py` and names relative to the cell's first path count) or a folder row above it."""
    named = set()
    for line in _structure_rows():
        folder = None
        for name in re.findall(r"`([^`]+)`", line[2:].split(" | ")[0]):
            for path in _expand(name):
                if "/" in path:
                    folder = path.rsplit("/", 1)[0]
                elif folder:
                    path = f"{folder}/{path}"
                named.add(path)
    modules = [p.relative_to(ROOT).as_posix() for p in (ROOT / "nanosched").rglob("*.py")
               if p.name != "__init__.py"]
    missing = sorted(m for m in modules if m not in named
                     and not any(n.endswith("/") and m.startswith(n) for n in named))
    assert modules and not missing, f"docs/structure.md has no row for {missing}"


MAX_DOCSTRING_LINES = 15


def docstring_lines(path: Path) -> int:
    """The lines of text in a module's docstring (0 without one), blank ones inside it too."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    return len(doc.strip("\n").splitlines()) if doc else 0


def test_module_docstrings_are_notes():
    """Issue 47 item 7: a module's docstring says its contract and why, in at most 15 lines;
    the longer explanation goes to the docs' module notes (docs/runtime.md, docs/profiler.md…)."""
    lines = {p.relative_to(ROOT).as_posix(): docstring_lines(p)
             for p in sorted((ROOT / "nanosched").rglob("*.py"))}
    long = {p: n for p, n in lines.items() if n > MAX_DOCSTRING_LINES}
    assert max(lines.values()) > 1 and long == {}, f"module docstrings over 15 lines: {long}"


def test_the_docstring_counter_counts_every_line(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""One.\n\nThree.\n"""\n\nX = 1\n')
    assert docstring_lines(module) == 3
    module.write_text("X = 1\n")
    assert docstring_lines(module) == 0


def test_structure_has_one_row_per_module():
    """docs/structure.md: a module's facts in one row, not spread over two."""
    firsts = [re.findall(r"`([^`]+)`", line[2:].split(" | ")[0])[0] for line in _structure_rows()]
    assert len(firsts) > 100
    assert sorted({f for f in firsts if firsts.count(f) > 1}) == []
