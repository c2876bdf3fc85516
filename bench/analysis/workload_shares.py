"""Compute, memory and other time of a Sequential layer at each workload's steady state (CPU).

    PYTHONPATH=. python bench/analysis/workload_shares.py

Overlap pays most where compute and memory time are balanced. For each GPU and workload of
issue 16's benchmarks, the steady-state batch the search prices (`search.batch_info`: decode
rows on the 128 grid at the dense batch, their mean context, the prompt length) and each op of
one Llama-3-8B layer over its rows, alone on the whole GPU, from the profile that workload's
sets were searched on (`simulate.sequential_op_times`). Classes as the search has them
(`models.ops`): compute = the four GEMMs and prefill attention, memory = decode attention,
other = the elementwise ops. The balance is min(compute, memory) / max(compute, memory): 1
when a perfect overlap could hide one class entirely behind the other. No GPU; JSON to
bench/results/ (or $OUT); table last.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from bench._common import ROOT, results_dir
from nanosched.autosearch.search import batch_info
from nanosched.autosearch.simulate import sequential_op_times
from nanosched.models.ops import layer_ops
from nanosched.models.spec import load_spec
from nanosched.profiler.catalog import load_named_profile
from nanosched.profiler.format import load_profile
from nanosched.workloads import DATASETS, fixed

RESULTS = ROOT / "bench" / "results"
# (GPU, workload, dense batch, profile: a shipped name or a file in bench/results)
CASES = [
    ("H100", fixed(1024, 512), 1024, "llama3-8b-tp1-h100"),
    ("H100", DATASETS["sharegpt"], 1024, "profile-llama3-8b-tp1-h100-quick-sharegpt-20261124.json"),
    ("H100", fixed(4096, 1024), 1024,
     "profile-llama3-8b-tp1-h100-quick-in4096-out1024-20261124.json"),
    ("H200", fixed(1024, 512), 2048, "llama3-8b-tp1-h200"),
    ("H200", DATASETS["sharegpt"], 2048, "profile-llama3-8b-tp1-h200-quick-sharegpt-20261124.json"),
    ("H200", fixed(4096, 1024), 2048,
     "profile-llama3-8b-tp1-h200-quick-in4096-out1024-20261124.json"),
]


def shares(gpu: str, workload, dense: int, profile_name: str) -> dict:
    spec = load_spec("llama3-8b")
    prof = (load_profile(RESULTS / profile_name) if profile_name.endswith(".json")
            else load_named_profile(profile_name))
    batch = batch_info(workload, dense)
    times = sequential_op_times(spec, 1, prof, batch)
    kind = {op.name: op.resource for op in layer_ops(spec)}
    by_class = {c: sum(t for op, t in times.items() if kind[op] == c)
                for c in ("compute", "memory", "other")}
    layer = sum(by_class.values())
    return {"gpu": gpu, "workload": workload.name, "dense_batch": dense,
            "profile": profile_name, "num_decode": batch.num_decode,
            "decode_context": round(batch.decode_context), "prompt_len": batch.prompt_len,
            "layer_us": round(layer, 1), **{f"{c}_us": round(t, 1) for c, t in by_class.items()},
            **{f"{c}_share": round(t / layer, 3) for c, t in by_class.items()},
            "balance": round(min(by_class["compute"], by_class["memory"])
                             / max(by_class["compute"], by_class["memory"]), 3),
            "ops_us": {op: round(t, 1) for op, t in times.items()}}


def main() -> None:
    rows = [shares(*case) for case in CASES]
    date = datetime.now(timezone.utc)
    path = results_dir() / f"workload_shares-{date:%Y%m%d}.json"
    path.write_text(json.dumps({"date": date.isoformat(timespec="seconds"),
                                "command": "PYTHONPATH=. python bench/analysis/workload_shares.py",
                                "model": "llama3-8b", "tp": 1, "rows": rows}, indent=2))
    print(path)
    head = ("GPU", "workload", "batch", "decode rows", "context", "layer us", "compute",
            "memory", "other", "balance")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(str(x) for x in (
            r["gpu"], r["workload"], r["dense_batch"], r["num_decode"], r["decode_context"],
            r["layer_us"], f"{100 * r['compute_share']:.0f}%", f"{100 * r['memory_share']:.0f}%",
            f"{100 * r['other_share']:.0f}%", r["balance"])))


if __name__ == "__main__":
    main()
