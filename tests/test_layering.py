"""The layering of docs/design.md, read from the code: every `import` of every module (at any depth,
lazy imports inside functions included) against the rules below.

- the runtime never imports the search (a server loads a schedule without OR-Tools);
- the search never imports the runtime or the kernels (it reads profiles, never a GPU);
- schedules (the contract) import neither the runtime nor the search;
- models know nothing of the runtime or of schedules;
- kernels import only kernels, constants and errors;
- the profiler imports neither the search nor the runtime;
- the runtime, the profiler and the models never import the benchmark harnesses (a server or
  a profile run carries no benchmark code);
- the frontend (a traced model as the runtime's ops) builds on the models, kernels and the
  runtime's program contract, never on the search, schedules or benchmarks; nothing below it
  (runtime, models, search, schedules) imports it: the runtime takes a frontend model by what
  it offers (`program`), not by its class.
Within autosearch/ no module imports, even lazily, one that imports it back (`circles`).
Top-level pure modules (constants, errors, hardware, workloads, fileio) import no package of
nanosched, so no import circle crosses packages through them. The command line
(`nanosched.cli`) and the benchmark harnesses (`nanosched.benchmarks`, which may import both
sides) are not restricted. Relative imports are read as the absolute names they stand for.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

FORBIDDEN = {
    "runtime": {"autosearch", "benchmarks", "frontend"},
    "autosearch": {"runtime", "kernels", "frontend"},
    "schedules": {"runtime", "autosearch", "frontend"},
    "models": {"runtime", "schedules", "benchmarks", "frontend"},
    "profiler": {"autosearch", "runtime", "benchmarks"},
    "frontend": {"autosearch", "benchmarks", "schedules"},
}
KERNELS_MAY_IMPORT = {"kernels", "constants", "errors"}
ROOT = Path(__file__).resolve().parents[1] / "nanosched"


def _nodes(tree: ast.AST, run_time_only: bool):
    """Every node of `tree`; with `run_time_only`, none under `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if run_time_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
                node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imported(path: Path, module: str = "", run_time_only: bool = False) -> set[str]:
    """Every module name `path` imports, at any depth of its syntax tree; a relative import
    (`from .x import y`, `from .. import z`) as the absolute name it stands for in `module`,
    the dotted name of `path` (a package's `__init__` named after the package). With
    `run_time_only`, imports under `if TYPE_CHECKING:` (never run) are left out."""
    names = set()
    for node in _nodes(ast.parse(path.read_text(encoding="utf-8")), run_time_only):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                anchor = package[:len(package) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base:
                names.add(base)
                names |= {f"{base}.{a.name}" for a in node.names}
    return names


def violations(root: Path, package: str = "nanosched") -> list[str]:
    """`file: imports module` for every import that breaks the rules, under `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if len(parts) < 2:
            continue  # a top-level module: not restricted
        layer = parts[0]
        stem = [] if path.name == "__init__.py" else [path.stem]
        module = ".".join([package, *parts[:-1], *stem])
        for name in sorted(imported(path, module)):
            bits = name.split(".")
            if bits[0] != package or len(bits) < 2:
                continue
            target = bits[1]
            bad = (target not in KERNELS_MAY_IMPORT if layer == "kernels"
                   else target in FORBIDDEN.get(layer, set()))
            if bad:
                out.append(f"{path.relative_to(root)}: imports {name}")
    return sorted(set(out))


def circles(root: Path, layer: str, package: str = "nanosched") -> list[list[str]]:
    """The import circles among the modules of `layer` under `root`: each set of modules that
    reach one another through imports run at any time (lazy ones too; `TYPE_CHECKING` ones
    never run), found as the strongly connected components of the import graph."""
    modules = {}
    for path in sorted((root / layer).rglob("*.py")):
        parts = path.relative_to(root).parts
        stem = [] if path.name == "__init__.py" else [path.stem]
        modules[".".join([package, *parts[:-1], *stem])] = path
    graph = {}
    for name, path in modules.items():
        found = imported(path, name, run_time_only=True)
        graph[name] = {m for n in found for m in (n, n.rpartition(".")[0])
                       if m in modules and m != name}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_package_keeps_its_layers():
    assert violations(ROOT) == []


PURE_TOP_LEVEL = ("constants", "errors", "hardware", "workloads", "fileio")


def test_the_top_level_pure_modules_import_no_package():
    """The cost model lives in models/ (it reads the op table and the specs, and a spec asks
    it for a tp), so no top-level module closes a circle with a package."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    bad = {name: sorted(n for n in imported(ROOT / f"{name}.py", f"nanosched.{name}")
                        if n.split(".")[0] == "nanosched" and len(n.split(".")) > 1
                        and n.split(".")[1] in packages)
           for name in PURE_TOP_LEVEL}
    assert {k: v for k, v in bad.items() if v} == {}
    assert not (ROOT / "costmodel.py").exists()


def test_the_search_has_no_import_circle():
    """cli -> the search's command -> sets -> search and proof, never back: each module of
    autosearch/ builds on the ones below it."""
    assert circles(ROOT, "autosearch") == []


def test_a_planted_circle_is_found_even_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "nanosched" / "autosearch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from nanosched.autosearch.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from nanosched.autosearch import c\n")
    (pkg / "c.py").write_text("from .a import f\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from nanosched.autosearch.e import g\n")
    (pkg / "e.py").write_text("from nanosched.autosearch.d import h\n")
    assert circles(tmp_path / "nanosched", "autosearch") == [
        ["nanosched.autosearch.a", "nanosched.autosearch.b", "nanosched.autosearch.c"]]


@pytest.mark.parametrize("layer, line", [
    ("runtime", "from nanosched.autosearch.simulate import simulate"),
    ("autosearch", "import nanosched.runtime.engine"),
    ("kernels", "from nanosched.models.spec import ModelSpec"),
    ("profiler", "from nanosched.runtime import graphs"),
    ("models", "from nanosched.schedules.format import load_schedule"),
    ("schedules", "from nanosched.autosearch import search"),
    ("runtime", "from nanosched.benchmarks.common import synthetic_batch"),
    ("profiler", "import nanosched.benchmarks.throughput"),
    ("models", "from nanosched.benchmarks import verify"),
    ("runtime", "from ..autosearch.simulate import simulate"),
    ("models", "from .. import benchmarks"),
    ("kernels", "from ..models.spec import ModelSpec"),
])
def test_a_planted_violation_is_found_even_inside_a_function(tmp_path, layer, line):
    pkg = tmp_path / "nanosched"
    (pkg / layer).mkdir(parents=True)
    (pkg / layer / "ok.py").write_text("from nanosched.errors import ConfigError\n")
    (pkg / layer / "bad.py").write_text(f"def lazy():\n    {line}\n")
    found = violations(pkg)
    assert len(found) >= 1 and all(f.startswith(f"{layer}/bad.py: imports ") for f in found)


def test_relative_imports_are_read_as_absolute_names(tmp_path):
    mod = tmp_path / "nanosched" / "runtime" / "server" / "app.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("from . import text\nfrom .protocol import Job\nfrom ..engine import Engine\n"
                   "from ...kernels import dispatch\n")
    assert imported(mod, "nanosched.runtime.server.app") == {
        "nanosched.runtime.server", "nanosched.runtime.server.text",
        "nanosched.runtime.server.protocol", "nanosched.runtime.server.protocol.Job",
        "nanosched.runtime.engine", "nanosched.runtime.engine.Engine",
        "nanosched.kernels", "nanosched.kernels.dispatch"}
    init = mod.with_name("__init__.py")
    init.write_text("from .app import run\n")
    assert imported(init, "nanosched.runtime.server") >= {"nanosched.runtime.server.app"}


def test_allowed_imports_pass(tmp_path):
    pkg = tmp_path / "nanosched"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "kernels" / "k.py").write_text(
        "from nanosched.constants import PAGE_SIZE\nfrom nanosched.kernels import impls\n"
        "from .common import num_sms\nfrom . import reference\n")
    (pkg / "benchmarks").mkdir()
    (pkg / "benchmarks" / "b.py").write_text(
        "import nanosched.runtime.engine\nimport nanosched.autosearch.simulate\n")
    assert violations(pkg) == []


def test_every_folder_of_modules_is_a_package_that_setup_installs():
    """find_packages skips a folder without __init__.py, and everything below it: an installed
    (not editable) nanosched would then lack it."""
    from setuptools import find_packages

    folders = {p.parent for p in ROOT.rglob("*.py")}
    assert [str(f) for f in folders if not (f / "__init__.py").exists()] == []
    found = set(find_packages(str(ROOT.parent), include=["nanosched", "nanosched.*"]))
    want = {".".join(f.relative_to(ROOT.parent).parts) for f in folders}
    assert want <= found
