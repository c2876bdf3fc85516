"""The results in bench/results/ as one current table (README.md) and an index (INDEX.md).

    python bench/tools/results_table.py            rewrite the README's table and INDEX.md
    python bench/tools/results_table.py --check    exit 1 when either is stale, an old file is
                                                   left, or a README prose figure is not what
                                                   its record says
    python bench/tools/results_table.py --archive  `git mv` the superseded files into archive/

Only the latest file of each experiment (bench/tools/results_records.py says what an experiment is)
is current: INDEX.md has one line per experiment, and older files belong in
bench/results/archive/ (git keeps their history). The README's table is shorter: the latest
current `bench` record per GPU, model, tp, workload and KV dtype, its Sequential runs in one
row with each other strategy of the record beside them, and reference links to the records.
The README's prose figures are checked against the records they quote
(bench/tools/readme_figures.py). Pure Python, no torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent  # bench/tools/: its sibling modules
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
INDEX_NAME = "INDEX.md"
ARCHIVE = "archive"


def _sibling(name: str) -> ModuleType:
    """bench/<name>.py, loaded by path: this script is also loaded from outside bench/."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_records = _sibling("results_records")
Entry, bench_runs, gpu_label = _records.Entry, _records.bench_runs, _records.gpu_label
latest, scan, workload_label = _records.latest, _records.scan, _records.workload_label


def _run_graphs(run_name: str, run: dict[str, Any]) -> str:
    g = run.get("graphs")
    if isinstance(g, bool):
        return "on" if g else "off"
    return "on" if run_name.endswith("+graphs") else "off"


def _short_workload(label: str) -> str:
    """A generated workload's spec (`shared-prefix:groups=10,prefix=2000,...`) in a few words;
    any other label as it is."""
    name, _, spec = label.partition(":")
    keys = dict(kv.split("=", 1) for kv in spec.split(",") if "=" in kv)
    if name == "shared-prefix" and {"groups", "prefix", "unique", "output"} <= keys.keys():
        return f"shared {keys['prefix']} + {keys['unique']} / {keys['output']} ({keys['groups']})"
    if name == "multi-turn" and {"turns", "prompt", "user", "output"} <= keys.keys():
        return f"chat {keys['turns']} x ({keys['prompt']} + {keys['user']} / {keys['output']})"
    return label


def readme_key(e: Entry) -> tuple[str, ...]:
    """What the README keeps one record of: (GPU, model, tp with the all-reduce when it is
    not NCCL's, and the Sequential runs' when it differs, workload, KV dtype, weights)."""
    c = e.data["config"]
    kv = "fp8" if c.get("kv_dtype") == "fp8" else "bf16"
    weights = "fp8" if c.get("quantization") == "fp8" else "bf16"
    workload = _short_workload(workload_label(c).replace("in ", "").replace("out ", ""))
    if c.get("prefix_caching") is False:  # records from before the cache ran without one
        workload += ", cache off"
    tp, net = str(c.get("tp") or 1), _records.collective(e.data)
    base = _records.sequential_collective(e.data)
    if net != _records.DEFAULT_COLLECTIVE or base != net:
        vs = f"; Seq. {base.replace('_', ' ').replace('nccl', 'NCCL')}" if base != net else ""
        tp += f" ({net.replace('_', ' ')}{vs})"
    return (gpu_label(e.data.get("environment", {}).get("device")), str(c.get("model")), tp,
            workload, kv, weights)


def readme_records(entries: list[Entry]) -> list[Entry]:
    """The latest current bench record per `readme_key`, in key order."""
    best: dict[tuple[str, ...], Entry] = {}
    for e in entries:
        if e.kind == "bench" and (readme_key(e) not in best or
                                  (e.date, e.name) > (best[readme_key(e)].date,
                                                      best[readme_key(e)].name)):
            best[readme_key(e)] = e
    return [best[k] for k in sorted(best)]


def _span(values: list[Any], fmt: str) -> str:
    """'21,219' for one run, '20,952-21,106' for several, '—' for none."""
    nums = sorted(v for v in values if isinstance(v, (int, float)))
    if not nums:
        return "—"
    lo, hi = fmt.format(nums[0]), fmt.format(nums[-1])
    return lo if lo == hi else f"{lo.rstrip('%')}-{hi}"


def _strategy(run_name: str, run: dict[str, Any]) -> str:
    strategy = str(run.get("strategy", run_name))
    if strategy == "replay" and isinstance(run.get("predicted_speedup"), (int, float)):
        return f"searched schedule (predicts {run['predicted_speedup']:.2f}×)"
    if strategy == "replay_set":
        return (f"set, {run.get('pipelined_iterations', 0):,} of "
                f"{run.get('iterations', 0):,} pipelined")
    return "searched schedule" if strategy == "replay" else strategy


def record_rows(e: Entry, ref: str) -> list[list[str]]:
    """A record's rows: its Sequential runs in one, each other strategy beside them. A record
    that ran with and without graphs shows its graph runs only."""
    runs = {n: r for n, r in bench_runs(e.data).items() if isinstance(r.get("results"), dict)}
    if any(_run_graphs(n, r) == "on" for n, r in runs.items()):
        runs = {n: r for n, r in runs.items() if _run_graphs(n, r) == "on"}
    seq = [r["results"] for r in runs.values() if r.get("strategy") == "sequential"]
    others = {n: r for n, r in runs.items() if r.get("strategy") != "sequential"}
    ratios = e.data.get("ratios") if isinstance(e.data.get("ratios"), dict) else {}
    base = seq[0].get("tokens_per_s") if seq else None
    gpu, model, tp, workload, kv, weights = readme_key(e)
    c = e.data["config"]
    head = [gpu, model, tp, workload, kv, weights, f"{c.get('dense_batch'):,}",
            f"{c.get('num_prompts'):,}",
            _span([r.get("tokens_per_s") for r in seq], "{:,.0f}"),
            _span([r.get("percent_of_optimal") for r in seq], "{:.1f}%")]
    date = f"[{e.date[:10]}][{ref}]"
    if not others:
        return [head + ["—", "—", date]]
    rows = []
    for name, run in others.items():
        tps = run["results"].get("tokens_per_s")
        vs = (f"{ratios[name]['tokens_per_s']:.3f}×" if name in ratios else
              f"{tps / base:.3f}×" if isinstance(tps, (int, float)) and base else "—")
        rows.append(head + [_strategy(name, run), vs, date])
    return rows


HEADER = ["GPU", "model", "tp", "workload", "KV", "weights", "batch", "prompts",
          "Sequential tokens/s",
          "% of optimal", "strategy", "vs Sequential", "record"]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


MAX_ROWS = 10  # the README's table stays a glance; INDEX.md lists every experiment


def newest_that_fit(records: list[Entry], max_rows: int = MAX_ROWS) -> list[Entry]:
    """The most recent records whose rows fit in `max_rows`, kept in key order (a record with
    a strategy beside Sequential takes a row per strategy)."""
    kept, rows = set(), 0
    for e in sorted(records, key=lambda e: (e.date, e.name), reverse=True):
        n = len(record_rows(e, ""))
        if rows + n <= max_rows:
            kept.add(e.name)
            rows += n
    return [e for e in records if e.name in kept]


def results_block(entries: list[Entry]) -> str:
    """The README's block between the markers (markers included): the table (at most
    MAX_ROWS rows: the newest records), then the reference links its record column points at."""
    records = newest_that_fit(readme_records(entries))
    rows = [row for i, e in enumerate(records, 1) for row in record_rows(e, f"r{i}")]
    links = [f"[r{i}]: bench/results/{e.name}" for i, e in enumerate(records, 1)]
    return "\n".join([
        BEGIN,
        "<!-- generated by `python bench/tools/results_table.py` from bench/results/: "
        "do not edit -->",
        markdown_table(HEADER, rows), "", *links,
        END])


def index_text(current: list[Entry]) -> str:
    """bench/results/INDEX.md: one line per experiment with its latest file."""
    out = ["# bench/results index", "",
           "Generated by `python bench/tools/results_table.py` (do not edit): the latest file of",
           "each experiment. Older files of an experiment are in `archive/`; git has their "
           "history.",
           "", "## `nanosched bench` records", "",
           "| experiment | date | latest file |", "|---|---|---|"]
    for e in sorted((e for e in current if e.kind == "bench"), key=lambda e: e.key):
        what = ", ".join(f"{k} {v}" for k, v in e.key if v not in ("None", ""))
        out.append(f"| {what} | {e.date[:10]} | [`{e.name}`]({e.name}) |")
    out += ["", "## other benchmark records", "", "| script | arguments | device | date | "
            "latest file |", "|---|---|---|---|---|"]
    for e in sorted((e for e in current if e.kind == "result"), key=lambda e: e.key):
        k = dict(e.key)
        args = f"`{k['arguments']}`" if k["arguments"] else "—"
        out.append(f"| `{k['script']}` | {args.replace('|', chr(92) + '|')} | {k['device']} | "
                   f"{e.date[:10]} | [`{e.name}`]({e.name}) |")
    for kind, title in (("schedule", "schedules the records name"),
                        ("profile", "profiles the records name")):
        files = [e.name for e in current if e.kind == kind]
        if files:
            out += ["", f"## {title}", ""] + [f"- [`{n}`]({n})" for n in files]
    return "\n".join(out) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same folder and os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def with_block(readme: str, block: str) -> str:
    """The README with its results block replaced; the markers must be there, once each."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or \
            readme.index(BEGIN) > readme.index(END):
        raise ValueError(f"README needs one {BEGIN} line and one {END} line after it")
    head, rest = readme.split(BEGIN, 1)
    return head + block + rest.split(END, 1)[1]


def main(argv: list[str] | None = None, root: Path = ROOT, figures: Any = None) -> int:
    """Write (or --check) the README's table and INDEX.md; check the README's prose figures
    (`figures`: bench/tools/readme_figures.py's FIGURES unless given)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="change nothing; exit 1 if README.md or INDEX.md is stale or a "
                           "superseded file is outside archive/")
    mode.add_argument("--archive", action="store_true",
                      help="git mv the superseded files into bench/results/archive/ first")
    args = ap.parse_args(argv)
    results, readme_path = root / "bench" / "results", root / "README.md"
    current, old = latest(scan(results))
    if args.archive and old:
        (results / ARCHIVE).mkdir(exist_ok=True)
        for e in old:
            for src in [results / e.name, *results.glob(Path(e.name).stem + ".*.csv")]:
                subprocess.run(["git", "mv", str(src), str(results / ARCHIVE / src.name)],
                               cwd=root, check=True)
        current, old = latest(scan(results))
    readme = readme_path.read_text()
    new_readme = with_block(readme, results_block(current))
    new_index = index_text(current)
    index_path = results / INDEX_NAME
    rf = _sibling("readme_figures")
    bad_figures = rf.figure_errors(new_readme, root, BEGIN, END,
                                   rf.FIGURES if figures is None else figures)
    if args.check:
        stale = [str(p.relative_to(root)) for p, new in ((readme_path, new_readme),
                                                         (index_path, new_index))
                 if not p.exists() or p.read_text() != new]
        for p in stale:
            print(f"{p} is stale: run python bench/tools/results_table.py", file=sys.stderr)
        for e in old:
            print(f"bench/results/{e.name} is superseded by a later file of its experiment: "
                  "run python bench/tools/results_table.py --archive", file=sys.stderr)
        for err in bad_figures:
            print(err, file=sys.stderr)
        return 1 if stale or old or bad_figures else 0
    if new_readme != readme:
        write_atomic(readme_path, new_readme)
    if not index_path.exists() or index_path.read_text() != new_index:
        write_atomic(index_path, new_index)
    print(f"{len(current)} current files, {len(old)} superseded"
          + (" (run with --archive to move them)" if old else ""))
    for err in bad_figures:
        print(err, file=sys.stderr)
    return 1 if bad_figures else 0


if __name__ == "__main__":
    sys.exit(main())
