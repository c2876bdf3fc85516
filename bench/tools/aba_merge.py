"""Three one-run `nanosched bench` records (Sequential, a strategy, Sequential) as one A-B-A
comparison record, the ratio computed as `bench --compare` computes it.

    python bench/tools/aba_merge.py SEQ1.json STRATEGY.json SEQ2.json --json OUT.json

For an A-B-A that does not fit one process: 1,000 prompts of Llama-3-70B at tp = 4 take over
the 10 minutes a device call may run (bench/engine/tp_run.sh `aba`), and a comparison against
Sequential on another all-reduce (the strategy on the copy engines, Sequential on NCCL) needs a
model loaded for each. The three must have asked for the same model, tp, GPU, workload, prompts,
dense batch, graphs, weights, seed and KV dtype; each run keeps the all-reduce it ran
(`collective`), and the record's config is the strategy's with `baseline_collective`, the
Sequential runs' all-reduce. Run between processes on one machine, the A-B-A keeps the GPU's
drift on both sides of the strategy; each process also loads its own model and its KV pages.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from nanosched.benchmarks.report import AFTER, run_ratio
from nanosched.fileio import write_json_atomic

SAME = ("model", "tp", "workload", "input_len", "output_len", "num_prompts", "dense_batch",
        "graphs", "weights", "seed", "kv_dtype", "request_rate")


class MergeError(ValueError):
    """Records that do not form one A-B-A."""


def one_run(record: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """(name, run) of a record that holds a single run."""
    runs = record.get("runs")
    if not isinstance(runs, dict) or len(runs) != 1:
        raise MergeError(f"{where}: expected a record of one run (bench without --compare), "
                         f"got runs {sorted(runs) if isinstance(runs, dict) else runs!r}")
    return next(iter(runs.items()))


def merge(seq1: dict[str, Any], strategy: dict[str, Any], seq2: dict[str, Any],
          names: tuple[str, str, str] = ("SEQ1", "STRATEGY", "SEQ2")) -> dict[str, Any]:
    """The A-B-A record of three one-run records; MergeError when they do not form one."""
    records = (seq1, strategy, seq2)
    runs = [one_run(r, n) for r, n in zip(records, names, strict=True)]
    for (name, run), where, want in zip(runs, names, (True, False, True), strict=True):
        if (run.get("strategy") == "sequential") != want:
            raise MergeError(f"{where}: its run {name!r} is {run.get('strategy')!r}; the first "
                             f"and last must be Sequential, the middle one not")
    device = {r.get("environment", {}).get("device") for r in records}
    if len(device) != 1:
        raise MergeError(f"the records ran on different GPUs: {sorted(map(str, device))}")
    for key in SAME:
        seen = [r["config"].get(key) for r in records]
        if seen.count(seen[0]) != 3:
            raise MergeError(f"the records differ in {key}: {seen}")
    net = [r["config"].get("collective", "nccl") for r in records]
    if net[0] != net[2]:
        raise MergeError(f"the two Sequential runs used different all-reduces: {net[0]}, "
                         f"{net[2]}")
    graphs = "+graphs" if runs[1][0].endswith("+graphs") else ""
    base, mid = "sequential" + graphs, runs[1][0]
    merged = {base: runs[0][1], mid: runs[1][1], AFTER + graphs: runs[2][1]}
    merged = {n: run | {"collective": c} for (n, run), c in zip(merged.items(), net, strict=True)}
    out = {k: v for k, v in strategy.items() if k not in ("runs", "ratios", "ratio")}
    out["config"] = strategy["config"] | {"compare": True, "baseline_collective": net[0]}
    out["environment"] = strategy["environment"] | {
        "command": shlex.join(sys.argv), "commands": [r["environment"].get("command")
                                                      for r in records],
        "dates": [r["environment"].get("date") for r in records]}
    out["runs"] = merged
    out["ratios"] = {mid: run_ratio(merged, mid, base)}
    out["ratio"] = out["ratios"][mid]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seq1", type=Path, help="the first Sequential record")
    ap.add_argument("strategy", type=Path, help="the strategy's record")
    ap.add_argument("seq2", type=Path, help="the second Sequential record")
    ap.add_argument("--json", type=Path, required=True, help="write the A-B-A record here")
    args = ap.parse_args(argv)
    paths = (args.seq1, args.strategy, args.seq2)
    try:
        records = [json.loads(p.read_text()) for p in paths]
        out = merge(*records, names=tuple(str(p) for p in paths))  # type: ignore[arg-type]
    except (OSError, json.JSONDecodeError, MergeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(f"error: a record lacks {exc}: not a `nanosched bench --json` record",
              file=sys.stderr)
        return 2
    write_json_atomic(args.json, out)
    r = out["ratio"]
    print(f"{r['of']}: {r['tokens_per_s']:.3f}x (Sequential drift "
          f"{r['sequential_drift']:.3f}){''.join('; ' + w for w in r['warnings'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
