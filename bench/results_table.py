"""The results in bench/results/ as one current table (README.md) and an index (INDEX.md).

    python bench/results_table.py            rewrite the README's table and bench/results/INDEX.md
    python bench/results_table.py --check    exit 1 when either is stale or an old file is left
    python bench/results_table.py --archive  `git mv` the superseded files into archive/

An experiment is what was asked, not when: for a `nanosched bench` record (`bench-*.json`) the
model, tp, GPU, workload (input/output lengths or a dataset, arrival rate), number of prompts,
dense batch, weights, `--graphs`, `--admission`, `--kv-cache-dtype` and the kind of
`--schedule` (sequential, two_batch, auto or a searched file); for another script's record the
script, its arguments and the device. Only the latest file of each experiment is current: the
README's table has one row per run of each current `bench` record, INDEX.md one line per
experiment, and older files belong in bench/results/archive/ (git keeps their history).
Schedules and schedule sets (`*.schedule.json`, `*.set.json`) and profiles (`profile-*.json`)
are inputs that records name, so they stay. Pure Python, no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent  # the bench scripts a record may be named after
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
INDEX_NAME = "INDEX.md"
ARCHIVE = "archive"


@dataclass(frozen=True)
class Entry:
    """One result file: its experiment `key`, when it was measured, and what the index says."""

    name: str
    kind: str  # "bench" | "result" | "schedule" | "profile"
    key: tuple[tuple[str, str], ...]
    date: str
    summary: str
    data: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def gpu_label(device: str | None, tp: int = 1) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100'; tp > 1 -> '2×H200'."""
    m = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", device or "")
    short = m.group(1) if m else (device or "?")
    return f"{tp}×{short}" if tp > 1 else short


def date_of(data: dict[str, Any], name: str) -> str:
    """ISO date-time of a record: its own field, else the one in its file name, else ''."""
    for env in (data.get("environment"), data.get("env"), data):
        if isinstance(env, dict) and isinstance(env.get("date"), str):
            return env["date"]
    m = re.search(r"(20\d\d)-?(\d\d)-?(\d\d)(?:[T-](\d\d)(\d\d)(\d\d)?)?", name)
    if not m:
        return ""
    y, mo, d, h, mi, s = m.groups()
    return f"{y}-{mo}-{d}" + (f"T{h}:{mi}:{s or '00'}" if h else "")


def workload_label(config: dict[str, Any]) -> str:
    w = config.get("workload") or f"in {config.get('input_len')} / out {config.get('output_len')}"
    rate = config.get("request_rate")
    if isinstance(rate, (int, float)) and rate != float("inf"):
        w += f", Poisson {rate:g}/s"
    return w


def schedule_kind(schedule: str | None) -> str:
    return schedule if schedule in ("sequential", "two_batch", "auto", None) else "searched"


def bench_runs(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The runs of a bench record; an early record held its one run at the top level."""
    if isinstance(data.get("runs"), dict):
        return data["runs"]
    if "results" in data:
        return {data.get("strategy", "run"): {k: data[k] for k in
                                              ("strategy", "results", "iterations",
                                               "fallbacks") if k in data}}
    return {}


def _bench_entry(name: str, data: dict[str, Any]) -> Entry:
    c, env = data["config"], data.get("environment", {})
    tp = int(c.get("tp") or 1)
    key = (("model", str(c.get("model"))), ("gpu", gpu_label(env.get("device"), tp)),
           ("workload", workload_label(c)), ("prompts", str(c.get("num_prompts"))),
           ("dense batch", str(c.get("dense_batch"))), ("weights", str(c.get("weights"))),
           ("graphs", str(c.get("graphs") or "off")), ("admission", str(c.get("admission"))),
           ("KV", str(c.get("kv_dtype") or "auto")),
           ("schedule", schedule_kind(c.get("schedule"))))
    summary = ", ".join(f"{run}: {_num(r.get('results', {}).get('tokens_per_s'))} tokens/s"
                        for run, r in bench_runs(data).items())
    return Entry(name, "bench", key, date_of(data, name), summary, data)


def _command_key(command: str) -> tuple[str, str]:
    """(script, arguments) of a recorded command line, without the interpreter and paths."""
    words = shlex.split(command)
    for i, w in enumerate(words):
        if w.endswith(".py"):
            args = [a for a in words[i + 1:]]
            if "--json" in args:  # where it was written is not what was asked
                j = args.index("--json")
                del args[j:j + 2]
            return Path(w).name, " ".join(args)
    return command, ""


def _result_entry(name: str, data: dict[str, Any]) -> Entry:
    env = next((e for e in (data.get("environment"), data.get("env")) if isinstance(e, dict)),
               data)
    device = env.get("device") or data.get("device")
    if isinstance(env.get("command"), str):
        script, args = _command_key(env["command"])
    elif isinstance(data.get("command"), str):
        script, args = _command_key(data["command"])
    elif "cases" in data and "time_limit_s" in data:
        machine = data.get("machine") or {}
        cpus = machine.get("cpus") if isinstance(machine, dict) else machine
        script, args = "search_quality.py", (f"--time-limit {data['time_limit_s']} --workers "
                                             f"{data.get('workers')}: {', '.join(data['cases'])}")
        device = f"CPU, {cpus} cores"
    else:  # no command recorded: the script the file is named after, and its arguments
        stem = re.sub(r"[-_]?20\d\d-?\d\d-?\d\d(T?\d{4,6})?(-\d{4})?", "", Path(name).stem)
        flat = stem.replace("-", "_")
        scripts = sorted((p.stem for p in SCRIPTS.glob("*.py") if flat.startswith(p.stem)),
                         key=len)
        script = f"{scripts[-1]}.py" if scripts else stem
        args = json.dumps(data["args"], sort_keys=True) if isinstance(data.get("args"), dict) \
            else (stem if not scripts else "")
    if not device and isinstance(data.get("machine"), str):
        device = data["machine"]
    key = (("script", script), ("arguments", args), ("device", gpu_label(device) if device
                                                     and "NVIDIA" in device else
                                                     str(device or "CPU")))
    return Entry(name, "result", key, date_of(data, name), "", data)


def describe(path: Path) -> Entry | None:
    """The Entry of one file in bench/results/, None for files that are not results."""
    name = path.name
    if name.endswith((".schedule.json", ".set.json")):
        return Entry(name, "schedule", (("file", name),), date_of({}, name), "")
    if path.suffix != ".json":
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if data.get("format") == "nanosched.profile/1":
        return Entry(name, "profile", (("file", name),), date_of({}, name), "")
    if name.startswith("bench-") and isinstance(data.get("config"), dict):
        return _bench_entry(name, data)
    return _result_entry(name, data)


def scan(results: Path) -> list[Entry]:
    """Every result in `results` (not in archive/), sorted by name."""
    entries = (describe(p) for p in sorted(results.iterdir()) if p.is_file())
    return [e for e in entries if e is not None]


def latest(entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """(the latest entry per experiment, the superseded ones); inputs are always current."""
    best: dict[tuple[str, tuple[tuple[str, str], ...]], Entry] = {}
    for e in entries:
        k = (e.kind, e.key)
        if k not in best or (e.date, e.name) > (best[k].date, best[k].name):
            best[k] = e
    current = sorted(best.values(), key=lambda e: e.name)
    old = sorted((e for e in entries if best[(e.kind, e.key)] is not e), key=lambda e: e.name)
    return current, old


def _num(x: Any) -> str:
    return f"{x:,.0f}" if isinstance(x, (int, float)) else "—"


def _run_graphs(run_name: str, run: dict[str, Any]) -> str:
    g = run.get("graphs")
    if isinstance(g, bool):
        return "on" if g else "off"
    return "on" if run_name.endswith("+graphs") else "off"


def table_rows(entries: list[Entry]) -> list[list[str]]:
    """One row per run of each current bench record."""
    rows = []
    for e in sorted((e for e in entries if e.kind == "bench"),
                    key=lambda e: (dict(e.key)["gpu"], dict(e.key)["model"],
                                   dict(e.key)["workload"], int(dict(e.key)["prompts"]),
                                   e.name)):
        k, runs = dict(e.key), bench_runs(e.data)
        seq = {_run_graphs(n, r): r["results"].get("tokens_per_s")
               for n, r in runs.items() if r.get("strategy") == "sequential" and "results" in r
               and not n.startswith("sequential-after")}
        ratios = e.data.get("ratios") if isinstance(e.data.get("ratios"), dict) else {}
        for run_name, run in runs.items():
            res = run.get("results", {})
            strategy = str(run.get("strategy", run_name))
            if strategy == "replay":
                strategy = f"searched schedule (predicts {run['predicted_speedup']:.2f}×)" \
                    if isinstance(run.get("predicted_speedup"), (int, float)) else "searched"
            elif strategy == "replay_set":
                strategy = f"schedule set ({run.get('pipelined_iterations', 0)} of " \
                           f"{run.get('iterations', 0)} iterations pipelined)"
            elif run_name.startswith("sequential-after"):
                strategy = "sequential (again, after)"
            graphs = _run_graphs(run_name, run)
            tps, base = res.get("tokens_per_s"), seq.get(graphs)
            # A-B-A records: the ratio to the mean of both Sequential runs, as bench reports it
            vs = (f"{ratios[run_name]['tokens_per_s']:.2f}×" if run_name in ratios else
                  f"{tps / base:.2f}×" if run.get("strategy") != "sequential" and
                  isinstance(tps, (int, float)) and base else "—")
            pct = res.get("percent_of_optimal")
            rows.append([k["gpu"], k["model"], k["workload"], k["prompts"], k["dense batch"],
                         graphs, k["admission"] if k["admission"] != "None" else "—",
                         "bf16" if k["KV"] == "auto" else k["KV"], strategy,
                         _num(tps), f"{pct:.1f}%" if isinstance(pct, (int, float)) else "—", vs,
                         e.date[:10], f"[`{e.name}`](bench/results/{e.name})"])
    return rows


HEADER = ["GPU", "model", "workload", "prompts", "batch", "graphs", "admission", "KV", "strategy",
          "tokens/s", "% of optimal", "vs Sequential", "date", "file"]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def results_block(entries: list[Entry]) -> str:
    """The README's block between the markers (markers included)."""
    return "\n".join([
        BEGIN,
        "<!-- generated by `python bench/results_table.py` from bench/results/: do not edit -->",
        markdown_table(HEADER, table_rows(entries)),
        END])


def index_text(current: list[Entry]) -> str:
    """bench/results/INDEX.md: one line per experiment with its latest file."""
    out = ["# bench/results index", "",
           "Generated by `python bench/results_table.py` (do not edit): the latest file of each",
           "experiment. Older files of an experiment are in `archive/`; git has their history.",
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


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
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
    if args.check:
        stale = [str(p.relative_to(root)) for p, new in ((readme_path, new_readme),
                                                         (index_path, new_index))
                 if not p.exists() or p.read_text() != new]
        for p in stale:
            print(f"{p} is stale: run python bench/results_table.py", file=sys.stderr)
        for e in old:
            print(f"bench/results/{e.name} is superseded by a later file of its experiment: "
                  "run python bench/results_table.py --archive", file=sys.stderr)
        return 1 if stale or old else 0
    if new_readme != readme:
        write_atomic(readme_path, new_readme)
    if not index_path.exists() or index_path.read_text() != new_index:
        write_atomic(index_path, new_index)
    print(f"{len(current)} current files, {len(old)} superseded"
          + (" (run with --archive to move them)" if old else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
