"""Which batch shapes of a profile the set search rules out without a solve, and how tight its
two bounds are (CPU).

    PYTHONPATH=. python bench/analysis/no_gain_bounds.py --profile llama3-70b-tp4-h100x4-quick
        [--dense-batch auto] [--input-len 1024 --output-len 512 | --workload sharegpt]
        [--min-gain 1.05]

For every key (D decode of T rows, T >= 256, at the context the set search gives it):
`overlap_bound` (cheapest splits, the profile's largest P sum) and the resource ceiling
(`nanosched.autosearch.proof.resource_ceiling`: an LP over modes, every pipeline the search can
return), both as the most any pipeline there can be predicted to gain over Sequential, the forms
the ceiling took, and the seconds it took. Counts the keys each rules out below --min-gain.
JSON to $OUT or bench/results/ (`no_gain_bounds-<profile>-<date>.json`); table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

from bench._common import results_dir
from bench.analysis.search_args import add_search_args, search_config
from nanosched.autosearch.proof import resource_ceiling
from nanosched.autosearch.search import search_batch
from nanosched.autosearch.sets import key_batch, overlap_bound
from nanosched.schedules.sets import set_keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_search_args(ap)
    ap.add_argument("--min-gain", type=float, default=1.05)
    args = ap.parse_args()
    cfg = search_config(args)
    prof, b, workload = cfg.profile, cfg.dense_batch, cfg.workload
    steady = search_batch(cfg)
    rows = []
    start = time.perf_counter()
    for d, t in [k for k in set_keys(b) if k[1] >= 256]:
        batch = key_batch(cfg, d, t)
        t0 = time.perf_counter()
        top = resource_ceiling(cfg, batch)
        rows.append({"num_decode": d, "num_tokens": t,
                     "decode_context": round(batch.decode_context, 1),
                     "overlap_bound": round(overlap_bound(cfg, batch), 4),
                     "ceiling": round(top.gain, 4), "forms": top.forms,
                     "ceiling_s": round(time.perf_counter() - t0, 3)})
    wall = time.perf_counter() - start
    by_bound = sum(r["overlap_bound"] < args.min_gain for r in rows)
    by_ceiling = sum(r["ceiling"] < args.min_gain for r in rows)
    env = {"device": f"CPU, {os.cpu_count()} cores", "date": datetime.now(timezone.utc)
           .isoformat(timespec="seconds"), "python": platform.python_version(),
           "ortools": version("ortools"),
           "command": "python " + " ".join(shlex.quote(a) for a in sys.argv)}
    data = {"env": env, "profile": str(args.profile), "profile_gpu": prof.identity.gpu_name,
            "profile_digest": prof.digest(), "tp": prof.tp, "workload": workload.name,
            "dense_batch": b, "steady_key": [steady.num_decode, steady.dense_batch],
            "min_gain": args.min_gain, "keys": len(rows), "ruled_out_by_bound": by_bound,
            "ruled_out_by_ceiling": by_ceiling, "wall_s": round(wall, 1), "rows": rows}
    stem = Path(str(args.profile)).stem
    path = results_dir() / f"no_gain_bounds-{stem}-{env['date'][:10].replace('-', '')}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    st = next(r for r in rows if [r["num_decode"], r["num_tokens"]] == data["steady_key"])
    print(f"{prof.identity.gpu_name} tp={prof.tp}, {workload.name}, dense {b}: {path}")
    slowest = max(r["ceiling_s"] for r in rows)
    print(f"  {len(rows)} keys of >= 256 rows; below {args.min_gain:.2f}x: {by_bound} by the "
          f"bound, {by_ceiling} by the ceiling; {wall:.1f} s ({slowest:.2f} s the slowest "
          f"ceiling)")
    print(f"  steady state ({st['num_decode']}, {st['num_tokens']}): bound "
          f"{st['overlap_bound']:.3f}x, ceiling {st['ceiling']:.3f}x ({st['forms'] or 'tp 1'})")


if __name__ == "__main__":
    main()
