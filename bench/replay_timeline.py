"""Why a replayed schedule is slower or faster than Sequential: CPU launch vs GPU time, graphs.

For one full batch shaped like the schedule's (decode tokens with the workload's context, then
prompt chunks), per strategy (Sequential, Replay(schedule), TwoBatchOverlap):
- eager: wall time of launch + synchronise, and the CPU time to launch alone (GPU idle at start),
- graph: the same forward captured into one CUDA graph (multi-stream capture: every stream is
  forked from and joined to the capture stream) and replayed: GPU time with no CPU launch cost,
- timeline: CUDA events before and after each launch on its own stream (an extra run), giving
  each op class's busy time and the overlap actually achieved.

    PYTHONPATH=. python bench/replay_timeline.py --schedule FILE [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanosched.models.model import CausalLM  # noqa: E402
from nanosched.models.spec import load_spec  # noqa: E402
from nanosched.models.weights import init_random  # noqa: E402
from nanosched.runtime.backend import Backend  # noqa: E402
from nanosched.runtime.bench import environment, synthetic_batch  # noqa: E402
from nanosched.runtime.device import CudaDevice  # noqa: E402
from nanosched.runtime.modelprogram import model_program  # noqa: E402
from nanosched.runtime.scheduler import run_program  # noqa: E402
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap  # noqa: E402
from nanosched.runtime.strategies.replay import Replay  # noqa: E402
from nanosched.runtime.streams import ReplayStreams  # noqa: E402
from nanosched.schedules.format import load_schedule  # noqa: E402


class TimedDevice(CudaDevice):
    """Records an event pair around every launch: (stream, op label, start, end)."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.spans: list[tuple[str, object, object]] = []

    def launch(self, stream, fn) -> None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        super().launch(stream, fn)
        b.record(stream)
        self.spans.append((str(stream), a, b))


def eager(model, ws, meta, segments, strategy, device, reps=5):
    wall, cpu = [], []
    for _ in range(reps):
        program = model_program(model, ws, meta, segments)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_program(program, strategy, Backend(device))
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        cpu.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def graphed(model, ws, meta, segments, strategy, device, reps=10):
    program = model_program(model, ws, meta, segments)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        run_program(program, strategy, Backend(device))  # forks from and joins to `side`
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def timeline(model, ws, meta, segments, strategy, device):
    program = model_program(model, ws, meta, segments)
    torch.cuda.synchronize()
    run_program(program, strategy, Backend(device))
    torch.cuda.synchronize()
    t0 = device.spans[0][1]
    per_stream: dict[str, float] = {}
    intervals = []
    for s, a, b in device.spans:
        lo, hi = t0.elapsed_time(a), t0.elapsed_time(b)
        per_stream[s] = per_stream.get(s, 0.0) + hi - lo
        intervals.append((lo, hi))
    total = max(hi for _, hi in intervals) - min(lo for lo, _ in intervals)
    return {"span_ms": total, "busy_ms_per_stream": per_stream,
            "sum_busy_ms": sum(per_stream.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", required=True)
    ap.add_argument("--layers", type=int, default=0, help="0: the model's")
    args = ap.parse_args()
    sched = load_schedule(args.schedule)
    spec = load_spec(sched.model["name"])
    if args.layers:
        spec = spec.__class__(**{**spec.to_json(), "num_layers": args.layers})
    model = CausalLM(spec, dtype=torch.bfloat16, device="cuda")
    init_random(model)
    b = sched.batch
    ws = model.new_workspace(b.dense_batch, num_pages=b.num_decode * (int(b.decode_context) //
                                                                      16 + 2) + 512)
    meta, segments, _ = synthetic_batch(ws, b.dense_batch, b.num_decode, int(b.decode_context),
                                        b.prompt_len, 0)
    replay = Replay(sched, spec.num_layers)
    streams = ReplayStreams(replay.streams)
    out = {"environment": environment(torch.device("cuda")), "schedule": args.schedule,
           "layers": spec.num_layers, "predicted_period_us": sched.prediction.period_us,
           "results": {}}
    with torch.inference_mode():
        for name, strategy, dev in [("sequential", Sequential(), CudaDevice()),
                                    ("replay", replay, streams.device),
                                    ("two_batch", TwoBatchOverlap(), CudaDevice())]:
            row: dict = {}
            row["eager_wall_ms"], row["eager_cpu_launch_ms"] = eager(model, ws, meta, segments,
                                                                     strategy, dev)
            try:
                row["graph_ms"] = graphed(model, ws, meta, segments, strategy, dev)
            except Exception as exc:  # report why a capture failed, keep measuring the rest
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize()
            timed = TimedDevice(dict(dev._streams), dict(dev._priorities))
            row["timeline"] = timeline(model, ws, meta, segments, strategy, timed)
            out["results"][name] = row
    streams.close()
    path = Path(os.environ.get("OUT", "bench/results")) / "replay_timeline.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"{'strategy':>10} {'eager ms':>9} {'cpu ms':>8} {'graph ms':>9} {'us/layer graph':>15}"
          f"  timeline span / busy per stream (ms)")
    for name, r in out["results"].items():
        g = r.get("graph_ms")
        busy = r["timeline"]["busy_ms_per_stream"]
        per = ", ".join(f"{k[-12:]} {v:.1f}" for k, v in busy.items())
        print(f"{name:>10} {r['eager_wall_ms']:9.2f} {r['eager_cpu_launch_ms']:8.2f} "
              f"{g if g is not None else float('nan'):9.2f} "
              f"{(g or float('nan')) * 1e3 / spec.num_layers:15.0f}  "
              f"{r['timeline']['span_ms']:.1f} / {per}" + (f"  [{r['graph_error'][:80]}]"
                                                           if "graph_error" in r else ""))
    print(f"schedule predicted {sched.prediction.period_us:.0f} us per layer")


if __name__ == "__main__":
    main()
