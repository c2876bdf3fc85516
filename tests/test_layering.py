"""The layering of the design, read from the source: every import of every module under
nanosched/ (at any depth, inside functions too) is checked against the rules below.

A package may import another unless a rule forbids it:
- the runtime reads schedules, never the search that makes them (nor the benchmark harnesses);
- the search reads profiles, never the runtime or the kernels;
- schedules are a contract: no runtime, no search;
- models know nothing of the runtime or of schedules;
- kernels and the GPU primitives (green contexts) import only their own package and the shared
  constants and errors;
- the profiler measures the model's kernels; it never imports the search or the runtime.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "nanosched"

FORBIDDEN = {
    "runtime": {"autosearch", "benchmarks"},
    "autosearch": {"runtime", "kernels"},
    "schedules": {"runtime", "autosearch"},
    "models": {"runtime", "schedules"},
    "profiler": {"autosearch", "runtime"},
}
ONLY = {
    "kernels": {"kernels", "constants", "errors"},
    "gpu": {"gpu", "constants", "errors"},
}


def _module_name(path: Path, root: Path) -> list[str]:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every module `path` imports, relative imports resolved;
    `from P import x` names P, or P.x when P is the root package (x is then a package)."""
    here = _module_name(path, root)
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module == root.name:
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, module))
    return found


def layer_of(dotted: str, root_name: str) -> str | None:
    """The first component below the root package ('runtime', 'constants', ...), or None for
    a module outside it (or the root package itself)."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == root_name else None


def violations(root: Path) -> list[str]:
    """Every import under `root` that breaks a rule, as 'path:line: a -> b (name)'."""
    out = []
    for path in sorted(root.rglob("*.py")):
        source = layer_of(".".join(_module_name(path, root)), root.name)
        if source is None:
            continue
        for line, name in imported_modules(path, root):
            target = layer_of(name, root.name)
            if target is None or target == source:
                continue
            bad = target in FORBIDDEN.get(source, ()) or \
                (source in ONLY and target not in ONLY[source])
            if bad:
                out.append(f"{path.relative_to(root.parent)}:{line}: {source} -> {target} "
                           f"({name})")
    return sorted(set(out))


def test_nanosched_keeps_its_layers():
    assert violations(ROOT) == []


def test_every_rule_names_a_real_package():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} | \
        {p.stem for p in ROOT.glob("*.py")}
    assert {"runtime", "benchmarks", "gpu"} <= packages  # find_packages needs __init__.py
    named = set(FORBIDDEN) | set(ONLY) | {t for ts in (*FORBIDDEN.values(), *ONLY.values())
                                          for t in ts}
    assert named <= packages, named - packages


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "nanosched"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


def test_checker_flags_planted_violations(tmp_path):
    root = _tree(tmp_path, {
        "runtime/engine.py": "import torch\n\ndef f():\n"
                             "    from nanosched.autosearch import simulate\n",
        "runtime/ok.py": "from nanosched.schedules.format import load_schedule\n",
        "models/model.py": "from ..runtime import engine\n",
        "models/ok.py": "from . import spec\nfrom nanosched.kernels import dispatch\n",
        "kernels/gemm.py": "import nanosched.models.spec\nfrom nanosched import constants\n",
        "kernels/ok.py": "from nanosched.errors import ConfigError\nfrom .gemm import x\n",
        "profiler/plan.py": "if True:\n    from nanosched import autosearch\n",
        "autosearch/stage1.py": "class A:\n    def m(self):\n        import nanosched.runtime\n",
        "schedules/format.py": "from nanosched.autosearch.search import run_search\n",
        "gpu/greenctx.py": "from nanosched.profiler import timing\n",
        "constants.py": "TOKEN_QUANTUM = 128\n",
        "errors.py": "",
    })
    assert violations(root) == [
        "nanosched/autosearch/stage1.py:3: autosearch -> runtime (nanosched.runtime)",
        "nanosched/gpu/greenctx.py:1: gpu -> profiler (nanosched.profiler)",
        "nanosched/kernels/gemm.py:1: kernels -> models (nanosched.models.spec)",
        "nanosched/models/model.py:1: models -> runtime (nanosched.runtime)",
        "nanosched/profiler/plan.py:2: profiler -> autosearch (nanosched.autosearch)",
        "nanosched/runtime/engine.py:4: runtime -> autosearch (nanosched.autosearch)",
        "nanosched/schedules/format.py:1: schedules -> autosearch (nanosched.autosearch.search)",
    ]


@pytest.mark.parametrize("source, target", [("runtime", "autosearch"), ("kernels", "runtime"),
                                            ("models", "schedules"), ("profiler", "runtime")])
def test_each_rule_alone(tmp_path, source, target):
    root = _tree(tmp_path, {f"{source}/a.py": f"import nanosched.{target}.b\n",
                            f"{target}/b.py": ""})
    assert [v.split(": ", 1)[1] for v in violations(root)] == \
        [f"{source} -> {target} (nanosched.{target}.b)"]
