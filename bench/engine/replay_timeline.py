"""Why a replayed schedule is slower or faster than Sequential: CPU launch vs GPU time, graphs.

For one full batch shaped like the schedule's (decode tokens with the workload's context, then
prompt chunks), per strategy (Sequential, Replay(schedule), TwoBatchOverlap):
- eager: wall time of launch + synchronise, and the CPU time to launch alone (GPU idle at start),
- graph: the same forward captured into one CUDA graph (multi-stream capture: every stream is
  forked from and joined to the capture stream) and replayed: GPU time with no CPU launch cost,
- timeline: CUDA events before and after each launch on its own stream (an extra run), giving
  each stream's busy time,
- check: the final hidden states vs Sequential's (relative L2; bf16 rounding only).
Beside them: the schedule's predicted layer period and Sequential's, and the simulator's at the
run's layer count (nanosched/autosearch/simulate.py, with the schedule's profile).

tp = 1 runs in this process. tp > 1 spawns one process per GPU with torch.multiprocessing
(`nanosched.models.parallel.launch`; do not start it under torchrun): each rank binds cuda:rank,
joins an NCCL group, builds the tp-sharded CausalLM (seeded random bf16 weights, Megatron
shards) and does the same work in the same order, with barriers around every timed region; the
NCCL all-reduces (`ar_attn`, `ar_ffn`) are captured in the graphs (NCCL >= 2.9; the group is
warmed up by an all-reduce first). NVLink multicast is kept off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set before the ranks start).
Rank 0 writes the JSON ($OUT or bench/results/: replay_timeline.json, or
replay_timeline-tp<N>.json) with every rank's eager and graph times, and prints the table.
The per-rank work lives in nanosched/benchmarks/timeline.py (tested on the CPU with gloo).

    PYTHONPATH=. python bench/engine/replay_timeline.py --schedule FILE [--layers 32]

Llama-3-70B layer shapes at tp = 2 on two H200s, 8 layers, with the searched schedule:

    PYTHONPATH=. python bench/engine/replay_timeline.py --tp 2 --layers 8 \\
        --schedule bench/results/llama3-70b-tp2-h200-b896.schedule.json

The schedule must be for the model, tp and GPU being run (`--force` to replay it anyway); the
model is the schedule's (`--model` for an HF folder).
"""

from __future__ import annotations

import argparse
import json
import sys

from nanosched.benchmarks.timeline import (
    TimelineConfig,
    find_profile,
    load_checked,
    predict,
    result_path,
    run,
    with_layers,
)
from nanosched.errors import NanoschedError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", required=True)
    ap.add_argument("--layers", type=int, default=0, help="0: the model's")
    ap.add_argument("--tp", type=int, default=1, help="GPUs, one process each (NCCL)")
    ap.add_argument("--model", default=None, help="model name or HF folder; default: the "
                    "schedule's model")
    ap.add_argument("--profile", default=None, help="profile FILE or shipped NAME for the "
                    "simulator; default: the shipped profile the schedule was searched with")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: fp32, eager only, gloo (a smoke run)")
    ap.add_argument("--force", action="store_true", help="replay a schedule made for another "
                    "model, tp or GPU")
    ap.add_argument("--networks", default="nccl", help="comma-separated all-reduce "
                    "implementations, one Sequential run each at tp > 1 (nccl, copy_engine, "
                    "copy_engine_ctas16, ...)")
    args = ap.parse_args()
    cfg = TimelineConfig(args.schedule, args.layers, args.model, args.device, force=args.force,
                         networks=tuple(args.networks.split(",")))
    try:  # a wrong model or tp is refused before any rank starts
        sched, full = load_checked(cfg, args.tp, None)
        profile, profile_name = find_profile(sched, args.profile)
    except NanoschedError as exc:
        sys.exit(f"error: {exc}")
    spec = with_layers(full, args.layers)

    out = run(cfg, args.tp)
    out["schedule"] = args.schedule
    out["profile"] = profile_name
    out |= predict(sched, spec, profile)
    path = result_path(args.tp)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))

    layers = spec.num_layers
    print(f"{'strategy':>10} {'eager ms':>9} {'cpu ms':>8} {'graph ms':>9} {'us/layer graph':>15}"
          f" {'rel err':>8}  timeline span / busy per stream (ms)")
    for name, r in out["results"].items():
        g = r.get("graph_ms")
        busy = r["timeline"]["busy_ms_per_stream"]
        per = ", ".join(f"{k[-14:]} {v:.1f}" for k, v in busy.items())
        print(f"{name:>10} {r['eager_wall_ms']:9.2f} {r['eager_cpu_launch_ms']:8.2f} "
              f"{g if g is not None else float('nan'):9.2f} "
              f"{(g or float('nan')) * 1e3 / layers:15.0f} "
              f"{r['check']['rel_l2_vs_sequential']:8.1e}  "
              f"{r['timeline']['span_ms']:.1f} / {per}" + (f"  [{r['graph_error'][:80]}]"
                                                           if "graph_error" in r else ""))
    print(f"schedule predicted {out['predicted_period_us']:.0f} us per layer, Sequential "
          f"{out['predicted_sequential_period_us']:.0f} us "
          f"({out['predicted_speedup']:.2f}x over the full model)")
    if "simulated" in out:
        s = out["simulated"]
        print(f"simulator at {layers} layers ({profile_name}): replay {s['period_us']:.0f} us per "
              f"layer, Sequential {s['sequential_period_us']:.0f} us; forward without LM head "
              f"{s['forward_us'] / 1e3:.2f} ms vs {s['sequential_forward_us'] / 1e3:.2f} ms "
              f"({s['speedup']:.2f}x)")
    else:
        print(f"no simulator figures: {profile_name}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
