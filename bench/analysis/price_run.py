"""CPU: a `nanosched bench` run's batches priced by a profile's rows, against its measured time.

    PYTHONPATH=. python bench/analysis/price_run.py BENCH_JSON --profile NAME_OR_FILE [--run NAME]
        [--clamp]

Replays the run's workload (its input/output lengths, prompts, dense batch, admission policy and
the KV pages it had) through the engine's request scheduler and paged cache over a fake model
(`kvsim.KVSim`, as bench/analysis/admission_sim.py does), and prices each iteration's batch
with the profile's kernel rows: every op of a layer over its rows (decode rows, prompt rows or all),
linear between the profile's 128-row grid points, decode attention at the batch's mean decode
context, prefill attention at its prompt's length; times the layers. The sum is the GPU time the
rows give the run's forwards (the LM head and sampling left out; inside the engine's forwards the
kernels run at their rows, with about 1 ms a forward between and around them:
bench/engine/engine_ops.py, docs/findings.md). Measured time well above it is time the GPU
was not running forwards: the CPU between iterations, captures, eager first runs. Dense models
at tp = 1. JSON to $OUT or bench/results/; summary last.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench._common import BatchMix, batch_mix, context_clamp, results_dir, row_us
from bench.analysis.kvsim import KVSim, sim_cost
from nanosched.autosearch.simulate import sequential_op_times
from nanosched.models.spec import load_spec
from nanosched.profiler.catalog import load_named_profile
from nanosched.runtime.kv_pool import AdmissionConfig
from nanosched.runtime.requests import Request, SamplingParams
from nanosched.schedules.format import BatchInfo


def batches(cfg: dict, pages: int) -> list[BatchMix]:
    """Each iteration's batch: decode rows, their mean context, prompt rows, the longest
    prompt end."""
    n, inp, out = cfg["num_prompts"], cfg["input_len"], cfg["output_len"]
    sim = KVSim(num_pages=pages, page_size=cfg["page_size"], dense_batch=cfg["dense_batch"],
                admission=AdmissionConfig(policy=cfg.get("admission") or "use",
                                          headroom=cfg.get("kv_headroom") or 0.0),
                decode_align=cfg.get("graph_align") or 32, check=False, cost=sim_cost(True),
                stop_at=dict.fromkeys(range(n), out))
    for i in range(n):
        sim.add(Request(i, [1] * inp, SamplingParams(max_tokens=out)))
    shapes = []
    run = sim._run

    def spy(batch):
        shapes.append(batch_mix(batch))
        return run(batch)

    sim._run = spy
    sim.run(10**7)
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("--profile", required=True, help="a shipped profile's name or a file")
    ap.add_argument("--run", default=None, help="which run of the file (default: the first)")
    ap.add_argument("--clamp", action="store_true", help="price attention contexts outside "
                    "the profile's at the nearest measured one (a quick profile's prefill)")
    args = ap.parse_args()
    data = json.loads(Path(args.bench_json).read_text())
    cfg = data["config"]
    name = args.run or next(iter(data["runs"]))
    run = data["runs"][name]
    prof = load_named_profile(args.profile)
    spec = load_spec(cfg["model"])
    shapes = batches(cfg, run["kv_pages"])
    kinds: dict[str, list[float]] = {"full": [], "decode only": [], "other": []}

    if args.clamp:
        within = context_clamp(prof)

        def price(op: str, rows: int, context: float | None) -> float:
            return row_us(prof, op, rows, within(op, context))
    else:
        price = functools.partial(row_us, prof)
    for d, ctx, p, plen in shapes:
        batch = BatchInfo(d + p, d, max(1, plen or cfg["input_len"]), ctx or 1.0, 0.0)
        layer = sum(sequential_op_times(spec, 1, prof, batch, price).values())
        kind = ("full" if d + p >= cfg["dense_batch"] else "decode only" if p == 0 else "other")
        kinds[kind].append(layer * spec.num_layers)
    priced_s = sum(sum(v) for v in kinds.values()) / 1e6
    measured_s = run["results"]["elapsed_s"]
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python", *sys.argv]), "bench": args.bench_json, "run": name,
           "profile": args.profile, "clamp": args.clamp, "measured_iterations": run["iterations"],
           "simulated_iterations": len(shapes), "measured_s": measured_s,
           "priced_forwards_s": round(priced_s, 2),
           "kinds": {k: {"iterations": len(v), "priced_s": round(sum(v) / 1e6, 2),
                         "ms_each": round(statistics.fmean(v) / 1e3, 2) if v else None}
                     for k, v in kinds.items()}}
    path = results_dir() / f"price_run-{Path(args.bench_json).stem}.json"
    path.write_text(json.dumps(out, indent=2))
    print(path)
    print(f"{name}: {run['iterations']} iterations measured, {len(shapes)} simulated; "
          f"measured {measured_s:.1f} s, forwards priced by the rows {priced_s:.1f} s "
          f"({100 * (1 - priced_s / measured_s):.0f}% of the run outside them)")
    for k, v in out["kinds"].items():
        print(f"  {k}: {v['iterations']} iterations, {v['priced_s']} s, {v['ms_each']} ms each")


if __name__ == "__main__":
    main()
