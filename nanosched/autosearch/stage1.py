r"""Stage I's solve driver: the relaxation R, the hinted solve and the proof solve.

The model is `stage1_model` (variables, constraints, symmetry), its bounds `stage1_bounds`.
Solving (`solve_stage1`): R; the model hinted with the heuristic structure, stopped when its
incumbent τ_inc has not improved for `STALL_S` s; then, if the gap is above `TARGET_GAP`, a
proof solve of the same model with τ ≤ U = ⌈0.95 τ_inc⌉ − 1 on CP-SAT workers without LP and
with full LP (they close it several times faster than the default portfolio). INFEASIBLE
proves τ ≥ U + 1 for every structure of these counts: the reported bound. A solution would
beat τ_inc, and that solve's bound holds for the whole problem (every solution with τ ≤ U is
one of its solutions, so the optimum is its optimum). The hinted solve often finds the
optimal τ early while the whole model's bound stays at R's until its search closes; refuting
τ ≤ U is a far smaller proof, and lifts the bound to U + 1 (a gap of at most `TARGET_GAP`).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

from nanosched.autosearch.cpsat import Limits, Progress, gap, solve
from nanosched.autosearch.durations import TICKS_PER_US
from nanosched.autosearch.opgraph import expand
from nanosched.autosearch.stage1_bounds import period_lower_bound
from nanosched.autosearch.stage1_model import (
    Stage1Problem,
    Stage1Vars,
    Structure,
    build_cp_model,
    make_structure,
)
from nanosched.constants import TOKEN_QUANTUM
from nanosched.models.ops import COMPUTE, MEMORY
from nanosched.schedules.format import StageReport

RELAX_SHARE = 0.1  # of a stage I solve's time for the relaxation R
PHASE1_SHARE = 0.5  # at most, of a stage I solve's time, for the hinted solve
STALL_S = 3.0  # the hinted solve stops when its incumbent has not improved for this long
TARGET_GAP = 0.05  # the proof solve tries to lift the bound to (1 - TARGET_GAP) τ_inc
PROOF_SUBSOLVERS = ("no_lp", "max_lp")


def solve_stage1(prob: Stage1Problem, limits: Limits, progress: Progress | None = None
                 ) -> tuple[Structure | None, StageReport]:
    """Solve stage I for fixed counts; (None, report) when no solution was found.

    Three solves share `limits`: the relaxation R (its bound is τ's lower bound), the
    model hinted with the heuristic structure until its incumbent stalls (`STALL_S`) or half
    the time is spent, and, when the gap is still above `TARGET_GAP`, a proof: the model with
    τ ≤ U = ⌈(1 − TARGET_GAP) τ_inc⌉ − 1 on a portfolio of workers without and with full LP.
    Infeasible: τ ≥ U + 1 for every structure, the reported bound. A solution: it beats the
    incumbent, and that solve's bound holds for the whole problem (all solutions with τ ≤ U
    are its solutions)."""
    start = time.perf_counter()
    hint = heuristic_structure(prob)
    if hint is not None and prob.max_period_ticks and hint.period > prob.max_period_ticks:
        hint = None
    upper = hint.period if hint is not None else None
    lower = relaxation_bound(prob, upper, replace(limits, time_limit_s=RELAX_SHARE
                                                  * limits.time_limit_s))
    cap = min(c for c in (upper, prob.max_period_ticks, 10**12) if c)
    if lower is None or lower > cap:  # R infeasible (below the cap): so is the whole problem
        return None, StageReport("stage I", "INFEASIBLE", math.nan, math.nan, math.nan,
                                 round(time.perf_counter() - start, 3), limits.time_limit_s,
                                 limits.num_workers, "the relaxation R is infeasible")
    m, v = build_cp_model(prob, upper, lower=lower)
    if hint is not None:
        add_hint(prob, m, v, hint)

    def left() -> float:
        return limits.time_limit_s - (time.perf_counter() - start)

    first = replace(limits, time_limit_s=max(0.01, min(left(), PHASE1_SHARE
                                                       * limits.time_limit_s)))
    if limits.deterministic:
        first = replace(limits, time_limit_s=PHASE1_SHARE * limits.time_limit_s)
    solver, report, found = solve(m, "stage I", first, progress, stall_s=STALL_S)
    if not found and hint is not None:  # out of time before CP-SAT took up the hint: keep it
        # R's bound still holds for every structure: the report stays finite (a schedule
        # refuses NaN) and says how far the heuristic may be from the best
        obj, bound = hint.period / TICKS_PER_US, lower / TICKS_PER_US
        return hint, replace(report, status="HINT", objective_us=obj, bound_us=bound,
                             gap=gap(obj, bound),
                             note="no solve finished in time: the heuristic structure")
    if not found:
        return None, report
    best = extract(prob, solver, v)
    if report.status == "OPTIMAL" or report.gap <= TARGET_GAP:
        return best, report
    target = math.ceil((1 - TARGET_GAP) * best.period) - 1
    rest = (1 - PHASE1_SHARE) * limits.time_limit_s if limits.deterministic else left()
    if target < lower or rest < 0.5:
        return best, report
    if progress:
        progress(f"stage I: proving no period <= {target / TICKS_PER_US:g} us")
    m2, v2 = build_cp_model(prob, target, lower=lower)
    solver2, rep2, found2 = solve(m2, "stage I (proof)", replace(limits, time_limit_s=rest),
                                  progress, subsolvers=PROOF_SUBSOLVERS)
    wall = round(report.wall_s + rep2.wall_s, 3)
    if found2:
        return extract(prob, solver2, v2), replace(rep2, stage="stage I", wall_s=wall,
                                                   time_limit_s=limits.time_limit_s)
    if rep2.status != "INFEASIBLE":
        return best, replace(report, wall_s=wall, time_limit_s=limits.time_limit_s)
    bound = (target + 1) / TICKS_PER_US
    return best, replace(report, bound_us=bound, gap=gap(report.objective_us, bound),
                         wall_s=wall, time_limit_s=limits.time_limit_s,
                         note=f"bound: no period <= {target / TICKS_PER_US:g} us (proof solve)")


def relaxation_bound(prob: Stage1Problem, upper: int | None, limits: Limits) -> int | None:
    """R's best bound (its optimum when solved): a lower bound of stage I's τ; None when R is
    infeasible (then so is stage I)."""
    m, v = build_cp_model(prob, upper, relaxed=True)
    solver, report, found = solve(m, "stage I relaxation", limits, None)
    if report.status == "INFEASIBLE":
        return None
    if not found:
        return period_lower_bound(prob)
    return math.ceil(solver.best_objective_bound - 1e-6)


def extract(prob: Stage1Problem, solver: Any, v: Stage1Vars) -> Structure:
    forms = {g: next(f for f, lit in lits.items() if solver.boolean_value(lit))
             for g, lits in v.forms.items()}
    split, placed = {}, {}
    for op, xs in v.by_op.items():
        cuts = [0] + [TOKEN_QUANTUM * solver.value(x.cut_end) for x in xs]
        split[op] = list(zip(cuts[:-1], cuts[1:], strict=True))
        for x in xs:
            if solver.boolean_value(x.present):
                stream = next(sn for sn, lit in x.on.items() if solver.boolean_value(lit))
                placed[(op, TOKEN_QUANTUM * solver.value(x.ws))] = (stream, solver.value(x.start))
    nanos = expand(prob.graph, split, prob.mix, forms)
    streams, starts = {}, {}
    for n in nanos:
        streams[n.id], starts[n.id] = placed[(n.op, n.work_start)]
    return make_structure(split, forms, streams, starts, solver.value(v.tau), prob.counts)


def heuristic_structure(prob: Stage1Problem) -> Structure | None:
    """Even splits, all-reduce forms, the best of a few simple orders: a hint and a fallback."""
    from nanosched.autosearch.opgraph import even_split, nano_deps, precedences
    from nanosched.autosearch.periodic import min_period

    forms = {g: fs[0] for g, fs in prob.graph.groups().items()}
    split = {o.name: fixed_split(prob.cuts_of(o.name), prob.mix.dense_batch)
             if prob.cuts_of(o.name) is not None
             else even_split(prob.mix.dense_batch, prob.counts[o.name]) for o in prob.graph.ops}
    nanos = expand(prob.graph, split, prob.mix, forms)
    pos = {o.name: i for i, o in enumerate(prob.graph.ops)}
    durations = {n.id: prob.tables[n.op][n.work_tokens // TOKEN_QUANTUM] for n in nanos}
    deps = precedences(nano_deps(prob.graph, nanos, prob.mix, forms))
    best: Structure | None = None
    for other in (MEMORY, COMPUTE):
        streams = {n.id: other if n.resource == "other" else n.resource for n in nanos}
        for key in ((lambda n: (pos[n.op], n.start)), (lambda n: (n.start, pos[n.op]))):
            orders: dict[str, list[str]] = {}
            for n in sorted(nanos, key=key):
                orders.setdefault(streams[n.id], []).append(n.id)
            found = min_period(durations, orders, deps)
            if found and (best is None or found[0] < best.period):
                best = make_structure(split, forms, streams, found[1], found[0], prob.counts)
    return best


def fixed_split(cuts: tuple[int, ...], dense_batch: int) -> list[tuple[int, int]]:
    """Token ranges of an op cut at `cuts` (quanta)."""
    edges = [0, *(c * TOKEN_QUANTUM for c in cuts), dense_batch]
    return list(zip(edges[:-1], edges[1:], strict=True))


def add_hint(prob: Stage1Problem, m: Any, v: Stage1Vars, hint: Structure) -> None:
    """Hint the solver with a known structure (cuts, forms, streams, starts, period)."""
    m.add_hint(v.tau, hint.period)
    for g, lits in v.forms.items():
        for f, lit in lits.items():
            m.add_hint(lit, hint.forms[g] == f)
    nanos = {(n.op, n.start): n for n in expand(prob.graph, hint.split, prob.mix, hint.forms)}
    first = min(hint.starts.values())
    for op, xs in v.by_op.items():
        for x, (s, e) in zip(xs, hint.split[op], strict=True):
            if prob.cuts_of(op) is None and e < prob.mix.dense_batch:
                m.add_hint(x.cut_end, e // TOKEN_QUANTUM)
            n = nanos.get((op, s))
            if n is None:
                continue
            m.add_hint(x.start, hint.starts[n.id] - first)
            for sn, lit in x.on.items():
                if len(x.on) > 1:
                    m.add_hint(lit, hint.streams[n.id] == sn)
