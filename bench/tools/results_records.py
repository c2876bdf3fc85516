"""The records in bench/results/: what experiment each file is, and which are the latest.

An experiment is what was asked, not when: for a `nanosched bench` record (`bench-*.json`) the
model, tp, GPU, workload (input/output lengths or a dataset, arrival rate), number of prompts,
dense batch, weights, `--graphs`, `--admission`, `--kv-cache-dtype`, `--gpu-memory-utilization`
and `--collective` (each when not the default; an A-B-A merged across processes also the
Sequential runs' all-reduce where it differs) and the kind of
`--schedule` (sequential, two_batch, auto or a searched file); for another script's record the
script, its arguments and the device. Schedules and schedule sets (`*.schedule.json`,
`*.set.json`) and profiles (`profile-*.json`) are inputs that records name, so they are always
current. bench/tools/results_table.py writes the README's table and INDEX.md from these. Pure
Python.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parents[1]  # bench/: the scripts (in its folders) a record names


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


DEFAULT_MEM_UTIL = 0.85  # EngineConfig.mem_util (this module reads JSON only, no nanosched)
DEFAULT_COLLECTIVE = "nccl"  # bench --collective


def collective(data: dict[str, Any]) -> str:
    """The all-reduce a bench record's layers ran (`--collective`): its config's, else its
    command line's (records written before the config named it), else NCCL."""
    named = data.get("config", {}).get("collective")
    if named:
        return str(named)
    words = shlex.split(str(data.get("environment", {}).get("command") or ""))
    if "--collective" in words[:-1]:
        return words[words.index("--collective") + 1]
    return DEFAULT_COLLECTIVE


def sequential_collective(data: dict[str, Any]) -> str:
    """The all-reduce a bench record's Sequential runs ran: `baseline_collective` where
    bench/tools/aba_merge.py joined runs of two, else the record's own."""
    return str(data.get("config", {}).get("baseline_collective") or collective(data))


def _bench_entry(name: str, data: dict[str, Any]) -> Entry:
    c, env = data["config"], data.get("environment", {})
    tp = int(c.get("tp") or 1)
    key = (("model", str(c.get("model"))), ("gpu", gpu_label(env.get("device"), tp)),
           ("workload", workload_label(c)), ("prompts", str(c.get("num_prompts"))),
           ("dense batch", str(c.get("dense_batch"))), ("weights", str(c.get("weights"))),
           ("graphs", str(c.get("graphs") or "off")), ("admission", str(c.get("admission"))),
           ("KV", str(c.get("kv_dtype") or "auto")),
           ("schedule", schedule_kind(c.get("schedule"))))
    if c.get("quantization") == "fp8":  # FP8 weights (older records: the model's dtype)
        key += (("weights", "fp8"),)
    if c.get("prefix_caching") is False:  # records from before the cache ran without one
        key += (("prefix cache", "off"),)
    if c.get("mem_util") not in (None, DEFAULT_MEM_UTIL):  # --gpu-memory-utilization given
        key += (("GPU memory", str(c["mem_util"])),)
    if (net := collective(data)) != DEFAULT_COLLECTIVE:
        key += (("collective", net),)
    if (base := sequential_collective(data)) != net:
        key += (("Sequential's collective", base),)
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
        scripts = sorted((p.stem for p in SCRIPTS.rglob("*.py") if flat.startswith(p.stem)),
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
