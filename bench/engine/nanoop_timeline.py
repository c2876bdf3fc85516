"""Per-nano-op timeline of a replayed schedule against its prediction: the P each kernel got.

For one full batch shaped like the schedule's (as bench/engine/replay_timeline.py builds it),
Sequential and Replay(schedule) each run one forward with every launch bracketed by CUDA events
(`TimedCudaDevice`). The GPU is first held by a sleep kernel on the stream every other stream
forks from, so the CPU has queued the whole forward before any of it runs: kernels then overlap
as they would in a CUDA graph, with no launch gaps (the run says so, or warns when the CPU was
slower than the sleep). Set against the schedule and its profile:

- per nano-op (median over the layers): the measured time, the predicted time t_alone / P of its
  allocation, and the P it actually got, t_alone / measured (t_alone: the profile's time of that
  op on that token range alone on the whole GPU);
- per stream: busy time per layer, measured and predicted (the simulator's replay);
- the steady-state period per layer (finish of layer L-1 minus finish of layer L/2-1, over
  L - L/2 layers), measured and predicted, for both strategies.

    PYTHONPATH=. python bench/engine/nanoop_timeline.py --schedule FILE [--key D,T] [--layers 8]
        [--profile FILE]

FILE is a single schedule or a set; of a set, the pipeline of the entry `--key` names (default:
the steady state's).

`--profile` defaults to the shipped profile whose digest the schedule names. GPU only. JSON to
$OUT or bench/results/; tables last.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict

import torch

from bench._common import environment, print_table, write_result
from nanosched.autosearch.simulate import (
    nano_time_us,
    replay,
    sequential_op_times,
    simulate,
)
from nanosched.benchmarks.common import synthetic_batch
from nanosched.benchmarks.timeline import find_profile, with_layers
from nanosched.constants import PAGE_SIZE
from nanosched.models.spec import load_spec
from nanosched.runtime.backend import Backend
from nanosched.runtime.device import Span, TimedCudaDevice
from nanosched.runtime.loader import load_model, open_streams, replay_choice
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.opsched import run_program
from nanosched.runtime.strategies import Sequential
from nanosched.schedules.sets import entry_schedule, load_schedule_set

LABEL = re.compile(r"L(\d+)\.(\w+)\[(\d+):(\d+)\]")


def sleep_cycles_per_ms() -> float:
    """Calibrate torch.cuda._sleep: GPU cycles per millisecond."""
    cycles = 50_000_000
    torch.cuda._sleep(cycles // 10)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return cycles / a.elapsed_time(b)


def timed_forward(model, ws, meta, segments, strategy, device: TimedCudaDevice,
                  sleep_ms: float, cycles_per_ms: float) -> tuple[list[Span], float]:
    """One forward queued behind a sleep: its spans and the CPU time the launch took (ms)."""
    program = model_program(model, ws, meta, segments)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
    t0 = time.perf_counter()
    run_program(program, strategy, Backend(device))
    cpu_ms = (time.perf_counter() - t0) * 1e3
    return device.spans(), cpu_ms


def parse(label: str) -> list[tuple[int, str, int, int]]:
    return [(int(a), op, int(s), int(e)) for a, op, s, e in LABEL.findall(label)]


def period_ms(spans: list[Span], layers: int) -> float:
    finish = defaultdict(float)
    for sp in spans:
        for layer, *_ in parse(sp.label):
            finish[layer] = max(finish[layer], sp.end_ms)
    half = layers // 2
    return (finish[layers - 1] - finish[half - 1]) / (layers - half)


def sequential_rows(spans: list[Span], alone_us: dict[str, float]) -> list[dict]:
    measured = defaultdict(list)
    for sp in spans:
        for _, op, _, _ in parse(sp.label):
            measured[op].append((sp.end_ms - sp.start_ms) * 1e3)
    rows = []
    for op, t_alone in alone_us.items():
        if measured.get(op):
            m = statistics.median(measured[op])
            rows.append({"op": op, "range": "all", "stream": "main", "alloc": "full",
                         "p_pred": 1.0, "p_meas": t_alone / m, "pred_us": t_alone,
                         "meas_us": m})
    return rows


def replay_rows(spans: list[Span], sched, profile) -> tuple[list[dict], dict]:
    by_range = {(n.op, n.start, n.end): n for n in sched.nano_ops}
    measured = defaultdict(list)
    merged = 0
    for sp in spans:
        parts = parse(sp.label)
        if len(parts) != 1:  # merged launches have no single prediction
            merged += len(parts) > 1
            continue
        _, op, s, e = parts[0]
        if (op, s, e) in by_range:
            measured[(op, s, e)].append((sp.end_ms - sp.start_ms) * 1e3)
    rows = []
    for key, n in by_range.items():
        if not measured.get(key):
            continue
        pred = nano_time_us(profile, n, sched.batch)
        alone = pred * n.alloc.p
        m = statistics.median(measured[key])
        rows.append({"op": n.op, "range": f"{n.start}-{n.end}", "stream": n.stream,
                     "alloc": f"{n.alloc.mechanism}:{n.alloc.units}", "p_pred": n.alloc.p,
                     "p_meas": alone / m, "pred_us": pred, "meas_us": m})
    return rows, {"merged_launches": merged}


def stream_busy(spans: list[Span], layers: int) -> dict[str, float]:
    """Busy time per layer of each schedule stream (a schedule stream whose nano-ops use
    different SM mechanisms runs on several CUDA streams, `memory@gc64`, `memory`: summed, as
    the prediction counts it)."""
    busy = defaultdict(float)
    for sp in spans:
        if parse(sp.label):
            busy[sp.stream.partition("@")[0]] += (sp.end_ms - sp.start_ms) * 1e3 / layers
    return dict(busy)


def predicted_busy(sched, profile, layers: int) -> dict[str, float]:
    durations = {n.id: nano_time_us(profile, n, sched.batch) for n in sched.nano_ops}
    stream = {n.id: n.stream for n in sched.nano_ops}
    busy = defaultdict(float)
    for (x, _), (a, b) in replay(sched, durations, layers).items():
        busy[stream[x]] += (b - a) / layers
    return dict(busy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", required=True)
    ap.add_argument("--key", default=None, help="D,T: the entry of a set (default: the steady "
                    "state's)")
    ap.add_argument("--layers", type=int, default=8, help="layers of the model to run (>= 2)")
    ap.add_argument("--profile", default=None, help="default: the shipped one the schedule names")
    ap.add_argument("--sleep-ms", type=float, default=400.0,
                    help="GPU sleep queued before each forward (must outlast the CPU launch)")
    args = ap.parse_args()
    if args.layers < 2:
        ap.error("--layers must be at least 2 (the period needs two layers)")
    sched = entry_schedule(load_schedule_set(args.schedule), args.key)
    profile, why = find_profile(sched, args.profile)
    if profile is None:
        ap.error(why)
    spec = with_layers(load_spec(sched.model["name"]), args.layers)
    model = load_model(spec, "random", torch.device("cuda"))
    b = sched.batch
    ws = model.new_workspace(b.dense_batch, num_pages=b.num_decode * (int(b.decode_context) //
                                                                      PAGE_SIZE + 2) + 512)
    meta, segments, _ = synthetic_batch(ws, b.dense_batch, b.num_decode, int(b.decode_context),
                                        b.prompt_len, 0)
    choice = replay_choice(sched, args.schedule, spec)
    strat, streams = choice.strategy, open_streams(choice, model.device)
    cycles = sleep_cycles_per_ms()
    seq_alone = sequential_op_times(spec, sched.tp, profile, b)  # per layer: layers unused
    out = {"env": environment(), "schedule": args.schedule,
           "profile_digest": profile.digest(), "layers": args.layers, "results": {}}
    tables = {}
    with torch.inference_mode():
        for name, strategy, base in [("sequential", Sequential(), None),
                                     ("replay", strat, streams.device)]:
            dev = TimedCudaDevice(dict(base._streams) if base else None,
                                  dict(base._priorities) if base else None)
            timed_forward(model, ws, meta, segments, strategy, dev, 1.0, cycles)  # warm-up
            spans, cpu_ms = timed_forward(model, ws, meta, segments, strategy, dev,
                                          args.sleep_ms, cycles)
            if name == "sequential":
                rows, extra = sequential_rows(spans, seq_alone), {}
                pred_period, busy_pred = sum(seq_alone.values()), {"main": sum(
                    seq_alone.values())}
            else:
                rows, extra = replay_rows(spans, sched, profile)
                pred_period = simulate(sched, profile, args.layers).period_us
                busy_pred = predicted_busy(sched, profile, args.layers)
            res = {"cpu_launch_ms": cpu_ms, "sleep_ms": args.sleep_ms,
                   "launch_bound": cpu_ms > args.sleep_ms,
                   "period_us": period_ms(spans, args.layers) * 1e3,
                   "predicted_period_us": pred_period, "busy_us_per_layer": stream_busy(
                       spans, args.layers), "predicted_busy_us_per_layer": busy_pred,
                   "nano_ops": rows, **extra,
                   "spans": [sp.__dict__ for sp in spans]}
            out["results"][name] = res
            tables[name] = rows
    streams.close()
    path = write_result("nanoop_timeline", out)
    for name, rows in tables.items():
        r = out["results"][name]
        print(f"\n{name}: period {r['period_us']:.0f} us per layer measured, "
              f"{r['predicted_period_us']:.0f} predicted; CPU launch {r['cpu_launch_ms']:.0f} ms"
              f" behind a {args.sleep_ms:.0f} ms sleep"
              + ("  [LAUNCH-BOUND: raise --sleep-ms]" if r["launch_bound"] else ""))
        busy = ", ".join(f"{s}: {v:.0f} (pred {r['predicted_busy_us_per_layer'].get(s, 0):.0f})"
                         for s, v in r["busy_us_per_layer"].items())
        print(f"busy us per layer by stream: {busy}")
        print_table(rows, [("op", "op", ""), ("range", "tokens", ""), ("stream", "stream", ""),
                           ("alloc", "alloc", ""), ("p_pred", "P pred", ".2f"),
                           ("p_meas", "P meas", ".2f"), ("pred_us", "pred us", ".0f"),
                           ("meas_us", "meas us", ".0f")])
    print(f"\nresults in {path}")


if __name__ == "__main__":
    main()
