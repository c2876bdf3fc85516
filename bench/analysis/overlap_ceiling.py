"""The pipeline ceiling of a profile's batch shapes, beside what the search found there (CPU).

    PYTHONPATH=. python bench/analysis/overlap_ceiling.py --profile llama3-8b-tp1-h100
        --dense-batch 1024
        [--input-len 1024 --output-len 512 | --workload sharegpt]
        [--set SET.json] [--bench BENCH.json] [--keys steady|all|D:T,...] [--max-groups 2]
        [--equal-only] [--what-if KC,KO] [--one-option]

For each key (D decode of T rows, at the context the set search gives it) the ceiling is the
largest Sequential / period that any pipeline of row groups could be predicted, over the
structures of up to `--max-groups` decode groups and as many prompt groups
(`bench.analysis.ceiling`: an LP that keeps the profile's pricing and drops the order of
the nano-ops). With `--set`, each key's row also holds the gain the set's search found there
(its pipeline's prediction, or the best pipeline its reason names). A gap between the two is
what a better search could still find; a ceiling under the set's `min_gain` means that no
pipeline of those structures pays on this GPU, whatever the search does. With `--bench` (a
`nanosched bench` record on this GPU), the forward time of its Sequential run is weighed by
shape: each shape's measured forwards over its key's ceiling bounds how much of that time any
such set of pipelines could save, the end-to-end ceiling (time outside the forwards is not cut).
`--one-option` holds each piece to one allocation (a MILP; seconds per structure, so with
`--keys steady` or a few keys). `--what-if KC,KO` multiplies every R->P point's P_compute by KC
and P_other by KO (each at most 1) first: how much better the pairs would have to be.
JSON to $OUT or bench/results/ (`overlap_ceiling-<profile>-<date>.json`); table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

from bench._common import results_dir
from bench.analysis.ceiling import pipeline_ceiling
from nanosched.autosearch.search import SearchConfig, search_batch
from nanosched.autosearch.sets import key_batch
from nanosched.profiler.catalog import load_named_profile
from nanosched.schedules.sets import load_schedule_set, set_key, set_keys
from nanosched.workloads import resolve_workload

FOUND = re.compile(r"best pipeline found predicts ([0-9.]+)x")


def found_gains(path: str) -> dict[tuple[int, int], float]:
    """(D, T) -> the gain the set's search found: a pipeline's prediction, or the best pipeline
    a `sequential` entry's reason names (keys decided by the bound or too small have none)."""
    out = {}
    for e in load_schedule_set(path).entries:
        if e.kind == "pipeline":
            out[(e.num_decode, e.num_tokens)] = e.sequential_us / e.forward_us
        elif (m := FOUND.search(e.reason)):
            out[(e.num_decode, e.num_tokens)] = float(m.group(1))
    return out


def bench_shapes(path: str, dense_batch: int) -> list[dict]:
    """The shapes of a bench record's first Sequential run: (key, iterations, forward ms)."""
    runs = json.loads(Path(path).read_text())["runs"]
    run = next(r for name, r in runs.items() if name.startswith("sequential"))
    out = []
    for sh in run["shapes"]:
        if sh.get("forward_ms") is None:
            continue
        key = set_key(sh["num_decode"], sh["num_tokens"], dense_batch)
        out.append({"shape": [sh["num_decode"], sh["num_tokens"]], "key": key,
                    "iterations": sh.get("forward_iterations", sh["iterations"]),
                    "forward_ms": sh["forward_ms"]})
    return out


def scaled(prof, kc: float, ko: float):
    """`prof` with every R->P point's P_compute x kc and P_other x ko, each at most 1."""
    def points(pts):
        return tuple(replace(p, p_compute=min(1.0, p.p_compute * kc),
                             p_other=min(1.0, p.p_other * ko)) for p in pts)
    return replace(prof, rp={k: points(v) for k, v in prof.rp.items()},
                   rp_shapes={k: points(v) for k, v in prof.rp_shapes.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="profile FILE or shipped NAME")
    ap.add_argument("--dense-batch", type=int, required=True)
    ap.add_argument("--input-len", type=float, default=1024)
    ap.add_argument("--output-len", type=float, default=512)
    ap.add_argument("--workload", default=None, help="a dataset name instead of the lengths")
    ap.add_argument("--set", default=None, help="a set searched on this profile, to compare")
    ap.add_argument("--bench", default=None, help="a bench record to weigh by its shapes")
    ap.add_argument("--keys", default="all",
                    help="all, or a list of steady and D:T keys, e.g. steady,896:896")
    ap.add_argument("--max-groups", type=int, default=2)
    ap.add_argument("--equal-only", action="store_true", help="equal groups only (faster)")
    ap.add_argument("--what-if", default=None, help="KC,KO: scale every point's P first")
    ap.add_argument("--one-option", action="store_true",
                    help="each piece keeps one allocation, as a nano-op does (a MILP)")
    args = ap.parse_args()
    prof = load_named_profile(args.profile)
    digest = prof.digest()
    what_if = [float(x) for x in args.what_if.split(",")] if args.what_if else None
    if what_if:
        prof = scaled(prof, *what_if)
    workload = resolve_workload(args.workload, None if args.workload else args.input_len,
                                None if args.workload else args.output_len)
    cfg = SearchConfig(prof.model, prof.tp, prof, workload, args.dense_batch)
    steady = search_batch(cfg)
    if args.keys == "all":
        keys = [(d, t) for d, t in set_keys(args.dense_batch) if t >= 256]
    else:  # "steady" and D:T keys, any mix
        keys = []
        for k in args.keys.split(","):
            d, _, t = k.partition(":")
            if k == "steady":
                keys.append((steady.num_decode, steady.dense_batch))
            elif d.isdigit() and t.isdigit():
                keys.append((int(d), int(t)))
            else:
                ap.error(f"--keys: {k!r} is neither 'steady' nor D:T (decode rows:rows, "
                         f"e.g. 384:1024)")
    found = found_gains(args.set) if args.set else {}
    shapes = bench_shapes(args.bench, args.dense_batch) if args.bench else []
    keys += [tuple(sh["key"]) for sh in shapes
             if sh["key"] and sh["key"][1] >= 256 and tuple(sh["key"]) not in keys]
    rows = []
    start = time.perf_counter()
    for i, (d, t) in enumerate(keys):
        batch = key_batch(cfg, d, t)
        c = pipeline_ceiling(cfg, batch, args.max_groups, args.equal_only, args.one_option)
        rows.append({
            "num_decode": d, "num_tokens": t, "decode_context": round(batch.decode_context, 1),
            "sequential_layer_us": round(c.sequential_us, 1),
            "ceiling": round(c.gain, 4), "period_us": round(c.best.period_us, 1),
            "decode_groups": list(c.best.decode_groups),
            "prompt_groups": list(c.best.prompt_groups),
            "found": found.get((d, t)), "structures": len(c.structures),
            "modes": [[m, round(us, 1)] for m, us in c.best.modes[:8]],
        })
        print(f"\r{i + 1}/{len(keys)} keys", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    ceiling = {(r["num_decode"], r["num_tokens"]): r["ceiling"] for r in rows}
    weighed = None
    if shapes:
        total = sum(sh["iterations"] * sh["forward_ms"] for sh in shapes)
        least = sum(sh["iterations"] * sh["forward_ms"]  # a set runs Sequential where no
                    / max(1.0, ceiling.get(tuple(sh["key"] or ()), 1.0))  # pipeline pays
                    for sh in shapes)
        weighed = {"bench": args.bench, "forward_s": round(total / 1e3, 2),
                   "forward_s_at_ceiling": round(least / 1e3, 2),
                   "ceiling": round(total / least, 4), "shapes": shapes}
    env = {"device": f"CPU, {os.cpu_count()} cores", "date": datetime.now(timezone.utc)
           .isoformat(timespec="seconds"), "python": platform.python_version(),
           "ortools": version("ortools"),
           "command": "python " + " ".join(shlex.quote(a) for a in sys.argv)}
    data = {"env": env, "profile": str(args.profile), "profile_gpu": prof.identity.gpu_name,
            "profile_digest": digest, "kv_dtype": prof.kv_dtype,
            "workload": workload.name, "dense_batch": args.dense_batch,
            "steady_key": [steady.num_decode, steady.dense_batch],
            "max_groups": args.max_groups, "equal_only": args.equal_only,
            "what_if": what_if, "one_option": args.one_option,
            "set": args.set, "wall_s": round(time.perf_counter() - start, 1),
            "bench_ceiling": weighed, "rows": rows}
    out = results_dir()
    stem = Path(str(args.profile)).stem
    tag = f"-whatif{what_if[0]:g}x{what_if[1]:g}" if what_if else ""
    tag += "-oneoption" if args.one_option else ""
    tag += "" if args.keys == "all" else "-steady" if args.keys == "steady" else "-keys"
    path = out / f"overlap_ceiling-{stem}{tag}-{env['date'][:10].replace('-', '')}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    best = max(rows, key=lambda r: r["ceiling"])
    print(f"{prof.identity.gpu_name}, {workload.name}, dense {args.dense_batch}: {path}")
    for r in sorted(rows, key=lambda r: -r["ceiling"])[:12]:
        steady_mark = " (steady)" if [r["num_decode"], r["num_tokens"]] == data["steady_key"] \
            else ""
        found_s = f"{r['found']:.3f}x" if r["found"] is not None else "-"
        print(f"  ({r['num_decode']:>4}, {r['num_tokens']:>4}){steady_mark:9s} ceiling "
              f"{r['ceiling']:.3f}x  found {found_s:>7}  groups {r['decode_groups']} | "
              f"{r['prompt_groups']}")
    steady_row = next((r for r in rows if [r["num_decode"], r["num_tokens"]]
                       == data["steady_key"]), None)
    if steady_row:
        print(f"steady state {tuple(data['steady_key'])}: ceiling {steady_row['ceiling']:.3f}x; "
              f"best key ({best['num_decode']}, {best['num_tokens']}): {best['ceiling']:.3f}x")
    if weighed:
        print(f"the bench run's Sequential forwards, {weighed['forward_s']} s: at each key's "
              f"ceiling {weighed['forward_s_at_ceiling']} s, {weighed['ceiling']:.3f}x")


if __name__ == "__main__":
    main()
