"""Pipelines of a few nano-batches at a profile's steady-state key, every op cut at the same
rows, priced as the search prices them: what the resource ceiling's mode mix becomes once it is
a pipeline (CPU).

    PYTHONPATH=. python bench/analysis/cut_pipelines.py --profile llama3-70b-tp8-h200-quick
        [--cuts 640,768,1024,640/1344] [--stage1-s 5] [--stage2-s 20] [--workers 2]
        [--timeline 768]

For each structure of --cuts (rows, several cuts of one structure joined by `/`; default one
cut at every multiple of 128 from the decode/prompt boundary D to T - D, or from T - D to D):
stage I with every op cut there (two nano-batches per cut, TokenWeave-style, or more; its
issue order and layer offsets, as the search's decode/prompt split gets them), stage II's
allocation of that structure for --stage2-s (the options the resource LP prices), the schedule
built and checked as `run_search` builds it, and `simulate`'s replay: per layer (steady state)
and per forward (fill and drain too) against Sequential. The key is posed as the set search
poses it (`sets.key_config`). With --timeline CUTS, one steady period of that structure's
replay: which nano-ops ran when, under which option. Writes nothing.
"""

from __future__ import annotations

import argparse
import time

from bench.analysis.stage2_gap_curve import stage2_problem, steady_key
from nanosched.autosearch.build import build_schedule
from nanosched.autosearch.check import check_schedule
from nanosched.autosearch.cpsat import Limits
from nanosched.autosearch.opgraph import TokenMix, layer_graph
from nanosched.autosearch.search import SearchConfig, _tables
from nanosched.autosearch.simulate import (
    nano_time_us,
    replay,
    sequential_baseline,
    simulate,
)
from nanosched.autosearch.stage1 import solve_stage1
from nanosched.autosearch.stage1_model import Stage1Problem
from nanosched.autosearch.stage2 import solve_stage2
from nanosched.constants import TOKEN_QUANTUM
from nanosched.schedules.format import BatchInfo, Schedule

TIMELINE_LAYERS = 12  # replayed for --timeline; the period shown is layer 6's


def cut_schedule(cfg: SearchConfig, batch: BatchInfo, cuts: tuple[int, ...], stage1_s: float,
                 stage2_s: float) -> tuple[Schedule, str]:
    """The checked schedule of every op cut at rows `cuts`, and its stages' line."""
    mix = TokenMix(batch.dense_batch, batch.num_decode, batch.prompt_len)
    graph = layer_graph(cfg.spec, cfg.tp)
    prob = Stage1Problem(graph, mix, _tables(cfg, graph, batch),
                         {o.name: len(cuts) + 1 for o in graph.ops}, None,
                         {o.name: tuple(c // TOKEN_QUANTUM for c in cuts) for o in graph.ops})
    st, rep1 = solve_stage1(prob, Limits(stage1_s, cfg.num_workers))
    if st is None:
        raise SystemExit(f"cut {cuts}: stage I found no structure in {stage1_s} s ({rep1.status})")
    alloc, rep2 = solve_stage2(stage2_problem(cfg, batch, st), Limits(stage2_s, cfg.num_workers))
    if alloc is None:
        raise SystemExit(f"cut {cuts}: stage II found no allocation in {stage2_s} s")
    sched = build_schedule(cfg.spec, cfg.tp, cfg.profile, graph, mix, batch, st, alloc,
                           (rep1, rep2))
    check_schedule(sched, cfg.profile)
    line = (f"stage I {rep1.objective_us:.0f} us ({rep1.status}), stage II {rep2.objective_us:.0f}"
            f" us, bound {rep2.bound_us:.0f} us, gap {100 * rep2.gap:.1f}% ({rep2.status}), "
            f"forms {dict(st.forms) or 'tp 1'}")
    return sched, line


def print_timeline(cfg: SearchConfig, sched: Schedule) -> None:
    """One steady period of the replay (from a layer's first nano-op to the next layer's)."""
    durs = {n.id: nano_time_us(cfg.profile, n, sched.batch) for n in sched.nano_ops}
    spans = replay(sched, durs, TIMELINE_LAYERS)
    by_id = {n.id: n for n in sched.nano_ops}
    mid = TIMELINE_LAYERS // 2
    t0 = min(a for (x, layer), (a, _) in spans.items() if layer == mid)
    t1 = min(a for (x, layer), (a, _) in spans.items() if layer == mid + 1)
    print(f"  one period of the replay ({t1 - t0:.0f} us; layer L = {mid}):")
    for (x, layer), (a, b) in sorted(spans.items(), key=lambda kv: kv[1]):
        if b <= t0 or a >= t1:
            continue
        n = by_id[x]
        where = f"{n.alloc.mechanism}{' ' + n.alloc.point if n.alloc.point else ''}"
        print(f"  {a - t0:6.0f} {b - t0:6.0f}  {n.stream:8} {x:16} L{layer - mid:+d} "
              f"rows {n.start}-{n.end} {where} P {n.alloc.p:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="profile FILE or shipped NAME")
    ap.add_argument("--cuts", default=None, help="structures, comma separated, each its cuts "
                    "in rows joined by / (default: above)")
    ap.add_argument("--stage1-s", type=float, default=5.0)
    ap.add_argument("--stage2-s", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeline", default=None, help="a structure whose period to print")
    args = ap.parse_args()
    prof, cfg, batch = steady_key(args.profile, args.workers)
    seq_layer, seq_forward = sequential_baseline(cfg.spec, cfg.tp, prof, batch)
    lo = max(TOKEN_QUANTUM, min(batch.num_decode, batch.dense_batch - batch.num_decode))
    specs = args.cuts.split(",") if args.cuts else [
        str(c) for c in range(lo, batch.dense_batch - lo + 1, TOKEN_QUANTUM)]
    print(f"{prof.identity.gpu_name} tp={prof.tp}: key D={batch.num_decode} T="
          f"{batch.dense_batch} (context {batch.decode_context:.0f}), Sequential layer "
          f"{seq_layer:.1f} us; stage I {args.stage1_s:g} s, stage II {args.stage2_s:g} s, "
          f"{args.workers} workers")
    for spec in specs:
        cuts = tuple(int(c) for c in spec.split("/"))
        t0 = time.perf_counter()
        sched, line = cut_schedule(cfg, batch, cuts, args.stage1_s, args.stage2_s)
        sim = simulate(sched, prof)
        print(f"cuts {spec}: replayed layer {sim.period_us:.0f} us = "
              f"{seq_layer / sim.period_us:.3f}x, forward {seq_forward / sim.iteration_us:.3f}x;"
              f" {line} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if spec == args.timeline:
            print_timeline(cfg, sched)


if __name__ == "__main__":
    main()
