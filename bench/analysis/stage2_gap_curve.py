"""How stage II's gap and bound move with its seconds at a profile's steady-state key (CPU).

    PYTHONPATH=. python bench/analysis/stage2_gap_curve.py --profile llama3-70b-tp4-h100x4
        [--seconds 10,20,40,80] [--stage1-s 30] [--workers 2] [--min-gain 1.05]
        [--subsolvers objective_lb_search,default_lp]

Builds the two structures `run_search` allocates at the steady state's key, as the set search
poses it (`sets.key_config`: the workload's mix at the profile's dense batch, the decode context
fitted to the KV cache): the decode/prompt split (stage I for the 3 s a 60 s search gives
it) and stage I's own search (--stage1-s), then solves stage II of each afresh for every
--seconds (CP-SAT keeps no bound between solves, so each row is what one solve of that length
reaches). Prints, per solve, the period found, the bound, the gap and both as a gain over
Sequential's layer, and whether the `gap` proof of a NO GAIN (`autosearch/proof.py`) would hold:
stage I within 5% of its bound and stage II's bound, as a gain, below --min-gain.
--subsolvers sets CP-SAT's worker portfolio (default: CP-SAT's own).
"""

from __future__ import annotations

import argparse
import functools
import time

from nanosched.autosearch import cpsat, stage2
from nanosched.autosearch.cpsat import Limits
from nanosched.autosearch.durations import alloc_options, op_context
from nanosched.autosearch.opgraph import TokenMix, expand, layer_graph, nano_deps, precedences
from nanosched.autosearch.proof import structure_proves
from nanosched.autosearch.search import (
    BOUNDARY_STAGE1,
    SearchConfig,
    _tables,
    boundary_cuts,
    search_batch,
    search_structure,
)
from nanosched.autosearch.sets import key_config
from nanosched.autosearch.simulate import sequential_op_times
from nanosched.autosearch.stage1 import solve_stage1
from nanosched.autosearch.stage1_model import Stage1Problem, Structure
from nanosched.autosearch.stage2 import Stage2Problem, solve_stage2
from nanosched.profiler.catalog import load_named_profile
from nanosched.profiler.format import Profile
from nanosched.schedules.format import BatchInfo, StageReport
from nanosched.workloads import resolve_workload


def structures(cfg: SearchConfig, batch: BatchInfo, stage1_s: float
               ) -> dict[str, tuple[Structure, StageReport]]:
    """The decode/prompt split and stage I's search, as `run_search` makes them."""
    mix = TokenMix(batch.dense_batch, batch.num_decode, batch.prompt_len)
    graph = layer_graph(cfg.spec, cfg.tp)
    tables = _tables(cfg, graph, batch)
    out = {}
    cuts = boundary_cuts(graph, mix)
    if cuts is not None:
        prob = Stage1Problem(graph, mix, tables, {o.name: 2 for o in graph.ops}, None, cuts)
        st, rep = solve_stage1(prob, Limits(BOUNDARY_STAGE1 * 60, cfg.num_workers))
        if st is not None:
            out["decode/prompt split"] = (st, rep)
    prob = Stage1Problem(graph, mix, tables, {o.name: 2 for o in graph.ops}, None)
    st, rep = search_structure(prob, stage1_s, cfg.num_workers, cfg.max_nano_ops, None)
    if st is not None:
        out["stage I's search"] = (st, rep)
    return out


def stage2_problem(cfg: SearchConfig, batch: BatchInfo, st: Structure) -> Stage2Problem:
    """Stage II of structure `st`, as `run_search` poses it."""
    mix = TokenMix(batch.dense_batch, batch.num_decode, batch.prompt_len)
    graph = layer_graph(cfg.spec, cfg.tp)
    nanos = expand(graph, st.split, mix, st.forms)
    ctx = {n.id: op_context(n.op, batch.decode_context, batch.prompt_len) for n in nanos}
    return Stage2Problem(
        {n.id: cfg.profile.kernel_time_us(n.op, n.work_tokens, None, ctx[n.id]) for n in nanos},
        {n.id: alloc_options(cfg.profile, n.resource, n.op, n.work_tokens, batch.dense_batch,
                             ctx[n.id]) for n in nanos},
        st.orders, st.offsets, precedences(nano_deps(graph, nanos, mix, st.forms)), None)


def steady_key(profile: str, workers: int) -> tuple[Profile, SearchConfig, BatchInfo]:
    """The profile (a FILE or shipped NAME), the search's config at its steady-state key
    (1024 / 512, the profile's dense batch) and that key's batch."""
    prof = load_named_profile(profile)
    cfg = SearchConfig(prof.model, prof.tp, prof, resolve_workload(None, 1024, 512),
                       prof.dense_batch, num_workers=workers)
    steady = search_batch(cfg)
    cfg = key_config(cfg, steady.num_decode, steady.dense_batch)
    return prof, cfg, search_batch(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="profile FILE or shipped NAME")
    ap.add_argument("--seconds", default="10,20,40,80", help="stage II limits, comma separated")
    ap.add_argument("--stage1-s", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--min-gain", type=float, default=1.05)
    ap.add_argument("--subsolvers", default="", help="CP-SAT subsolvers, comma separated")
    args = ap.parse_args()
    if args.subsolvers:
        stage2.solve = functools.partial(cpsat.solve,  # type: ignore[attr-defined]
                                         subsolvers=tuple(args.subsolvers.split(",")))
    prof, cfg, batch = steady_key(args.profile, args.workers)
    seq = sum(sequential_op_times(cfg.spec, cfg.tp, prof, batch).values())
    print(f"{prof.identity.gpu_name} tp={prof.tp}: steady key D={batch.num_decode} "
          f"(context {batch.decode_context:.0f}) "
          f"T={batch.dense_batch}, Sequential layer {seq:.1f} us, {args.workers} workers")
    for name, (st, rep1) in structures(cfg, batch, args.stage1_s).items():
        prob = stage2_problem(cfg, batch, st)
        print(f"{name}: {len(prob.alone)} nano-ops, stage I gap {100 * rep1.gap:.1f}%")
        for s in (float(x) for x in args.seconds.split(",")):
            t0 = time.perf_counter()
            _, rep = solve_stage2(prob, Limits(s, args.workers))
            holds = structure_proves(rep1.gap, seq / rep.bound_us, args.min_gain)
            print(f"  stage II {s:5.0f} s ({time.perf_counter() - t0:5.1f} s wall) {rep.status}:"
                  f" period {rep.objective_us:.0f} us ({seq / rep.objective_us:.3f}x), bound "
                  f"{rep.bound_us:.0f} us ({seq / rep.bound_us:.3f}x), gap "
                  f"{100 * rep.gap:.1f}%: gap proof {'holds' if holds else 'fails'}", flush=True)


if __name__ == "__main__":
    main()
