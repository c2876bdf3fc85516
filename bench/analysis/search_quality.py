"""Search quality on CPU: wall time, status, objective, bound, gap, predicted speedup.

Cases: llama3-70b tp=8 and llama3-8b tp=1 on H100, and llama2-70b tp=8 on A100 (NanoFlow's
Figure 6 setting), from synthetic profiles (unless `--profile FILE` gives a measured one for a
case's model and tp); then the measured profiles shipped in the package for llama3-8b tp=1
(H100, H200) and llama3-70b tp=8 (H200, quick grid), each at its largest measured batch
(`--no-shipped` skips them). Target: <= 60 s and stage gaps <= 5%. Writes bench/results/*.json.

    PYTHONPATH=. python bench/analysis/search_quality.py [--time-limit 60] [--workers 2]
        [--profile F]
        [--only CASE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from nanosched.autosearch.search import SearchConfig, batch_info, run_search
from nanosched.autosearch.synthetic import context_grid, synthetic_profile
from nanosched.hardware import get_gpu
from nanosched.models.spec import load_spec
from nanosched.profiler.format import Profile, load_profile
from nanosched.schedules.format import Schedule, save_schedule
from nanosched.workloads import fixed

CASES = [("llama3-70b", 8, "h100", 2048), ("llama3-8b", 1, "h100", 1024),
         ("llama2-70b", 8, "a100", 2048)]
SHIPPED = ["llama3-8b-tp1-h100", "llama3-8b-tp1-h200", "llama3-70b-tp8-h200-quick"]


def _profile(model: str, tp: int, gpu: str, batch: int, given: list[Profile]) -> Profile:
    for prof in given:
        if prof.model.name == model and prof.tp == tp:
            return prof
    b = batch_info(fixed(1024, 512), batch)
    return synthetic_profile(load_spec(model), get_gpu(gpu), tp, batch,
                             context_grid(b.decode_context, b.prefill_context))


def summarize(s: Schedule, wall: float) -> dict:
    counts = Counter(n.op for n in s.nano_ops)
    attn = [n.alloc.share for n in s.nano_ops if n.op == "attn_decode"]
    return {
        "wall_s": round(wall, 2),
        "stages": [{"stage": r.stage, "status": r.status, "objective_us": r.objective_us,
                    "bound_us": r.bound_us, "gap": round(r.gap, 4), "wall_s": r.wall_s}
                   for r in s.stages],
        "period_us": round(s.prediction.period_us, 1),
        "sequential_period_us": round(s.prediction.sequential_period_us, 1),
        "predicted_speedup": round(s.prediction.speedup, 3),
        "percent_of_optimal": round(100 * s.prediction.tokens_per_s /
                                    s.prediction.optimal_tokens_per_s, 1),
        "nano_ops_per_op": dict(counts), "forms": s.forms,
        "attn_decode_shares": attn, "num_decode": s.batch.num_decode,
        "profile": s.gpu_name,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--profile", action="append", default=[], help="measured profile file")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--no-shipped", action="store_true", help="skip the shipped profiles")
    ap.add_argument("--only", action="append", default=[], metavar="CASE",
                    help="run only this case (repeatable), e.g. "
                         "shipped-llama3-70b-tp8-h200-quick-b2048")
    args = ap.parse_args()
    given = [load_profile(p) for p in args.profile]
    import ortools

    results = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "python": platform.python_version(), "ortools": ortools.__version__,
                           "note": "shared 2-core CPU machine: other jobs ran at the same "
                                   "time, so wall times and reached gaps are noisy"},
               "time_limit_s": args.time_limit, "workers": args.workers, "cases": {}}
    cases = [(f"{m}-tp{tp}-{gpu}-b{b}", _profile(m, tp, gpu, b, given), b)
             for m, tp, gpu, b in CASES]
    if not args.no_shipped:
        from nanosched.profiler.catalog import shipped_profiles

        files = shipped_profiles()
        for name in SHIPPED:
            prof = load_profile(files[name])
            cases.append((f"shipped-{name}-b{prof.dense_batch}", prof, prof.dense_batch))
    if args.only:
        unknown = set(args.only) - {key for key, _, _ in cases}
        if unknown:
            ap.error(f"unknown case(s) {sorted(unknown)}; cases: {[k for k, _, _ in cases]}")
        cases = [c for c in cases if c[0] in args.only]
    for key, prof, batch in cases:
        cfg = SearchConfig(load_spec(prof.model.name), prof.tp, prof, fixed(1024, 512), batch,
                           args.time_limit, args.workers)
        start = time.perf_counter()
        sched = run_search(cfg)
        results["cases"][key] = summarize(sched, time.perf_counter() - start)
        save_schedule(sched, Path(args.out) / f"{key}.schedule.json")
        print(key, json.dumps(results["cases"][key]), flush=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M")
    path = Path(args.out) / f"search_quality_{stamp}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"written {path}")


if __name__ == "__main__":
    main()
