"""The search of one batch: stage I (growing nano-op counts near compute bubbles), stage II,
the schedule, and the independent check. `run_search(SearchConfig)` returns a checked Schedule.

Nano-op counts start at 2 per op. After each stage I solve, the largest gap on the compute
stream (within one period, wrapping around) marks a bubble; the ops next to it — the compute
nano-ops before and after it and whatever other streams run during it — are candidates, and
each in turn is tried with one more nano-op (at most `max_nano_ops`). A try that shortens the
period by at least 0.5% is kept; the search stops when none does or the time is spent.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from nanosched.autosearch.cpsat import Limits, Progress
from nanosched.autosearch.durations import (
    TICKS_PER_US,
    alloc_options,
    op_context,
    tick_table,
)
from nanosched.autosearch.opgraph import (
    OpGraph,
    TokenMix,
    expand,
    layer_graph,
    nano_deps,
    precedences,
)
from nanosched.autosearch.stage1 import solve_stage1
from nanosched.autosearch.stage1_model import Stage1Problem, Structure
from nanosched.autosearch.stage2 import Stage2Problem, solve_stage2
from nanosched.constants import TOKEN_QUANTUM
from nanosched.errors import ConfigError, ScheduleError
from nanosched.models.ops import COMPUTE
from nanosched.models.spec import ModelSpec
from nanosched.profiler.format import Profile, check_profile_for
from nanosched.schedules.format import REPLAYED_FORMS, BatchInfo, Schedule, StageReport
from nanosched.schedules.validate import FORMS
from nanosched.workloads import Workload

STAGE1_SHARE = 0.65
FIRST_SHARE = 0.7  # of stage I's time for its first solve (two nano-ops per op)
MARGIN_S = 1.0  # at most (2% of the limit): kept for stage II's model building and the checks
GROW_MIN_GAIN = 0.995  # a grown count is kept when it shortens the period by at least 0.5%
# of the time limit, for the decode/prompt split's stage I and stage II (each usually ends in
# a few seconds, optimal; what it leaves goes to stage I's search and its allocation)
BOUNDARY_STAGE1 = 0.05
BOUNDARY_STAGE2 = 0.15


@dataclass(frozen=True)
class SearchConfig:
    spec: ModelSpec
    tp: int
    profile: Profile
    workload: Workload
    dense_batch: int
    time_limit_s: float = 60.0
    num_workers: int = 2
    max_nano_ops: int = 4
    max_period_us: float | None = None
    command: str = ""
    deterministic: bool = False  # time limit in CP-SAT deterministic units: reproducible (CLI)
    num_decode: int | None = None  # decode tokens of the batch (default: the workload's mix)
    decode_context: float | None = None  # their mean context (default: the workload's)
    counts: dict[str, int] | None = None  # nano-ops per op to start from (default: 2 each)
    # collective forms stage I may choose at tp > 1: what the runtime replays unless asked
    # (`--allow-rs-ag` adds reduce-scatter + all-gather, which a run refuses)
    forms: tuple[str, ...] = REPLAYED_FORMS


def batch_info(workload: Workload, dense_batch: int) -> BatchInfo:
    """The steady-state mix, the decode/prefill boundary placed on the 128-token grid."""
    from nanosched.models.costmodel import batch_mix

    mix = batch_mix(workload, dense_batch)
    num_decode = min(dense_batch, round(mix.num_decode / TOKEN_QUANTUM) * TOKEN_QUANTUM)
    return BatchInfo(dense_batch, num_decode, max(1, round(workload.input_len)),
                     mix.decode_context, mix.prefill_context, workload.name)


def search_batch(cfg: SearchConfig) -> BatchInfo:
    """The batch searched: the workload's steady mix at the dense batch, or `num_decode`
    decode tokens at `decode_context` when given (else the workload's contexts)."""
    batch = batch_info(cfg.workload, cfg.dense_batch)
    if cfg.num_decode is not None:
        batch = replace(batch, num_decode=cfg.num_decode)
    if cfg.decode_context is not None:
        batch = replace(batch, decode_context=cfg.decode_context)
    return batch


def _check_config(cfg: SearchConfig) -> None:
    b = cfg.dense_batch
    if b < 2 * TOKEN_QUANTUM or b % TOKEN_QUANTUM:
        raise ConfigError(f"--dense-batch must be a multiple of {TOKEN_QUANTUM} of at least "
                          f"{2 * TOKEN_QUANTUM} (two nano-batches), got {b}")
    if b > cfg.profile.dense_batch:
        raise ConfigError(f"--dense-batch {b} exceeds the profile's largest measured batch "
                          f"{cfg.profile.dense_batch}")
    if not cfg.time_limit_s > 0 or cfg.num_workers < 1 or cfg.max_nano_ops < 2:
        raise ConfigError("--time-limit must be > 0, --workers >= 1 and --max-nano-ops >= 2; "
                          f"got {cfg.time_limit_s}, {cfg.num_workers}, {cfg.max_nano_ops}")
    check_profile_for(cfg.profile, cfg.spec, cfg.tp)
    if not cfg.forms or any(f not in FORMS for f in cfg.forms) or "ar" not in cfg.forms:
        raise ConfigError(f"collective forms must include 'ar' and be among {FORMS}, got "
                          f"{cfg.forms}")


def _tables(cfg: SearchConfig, graph: OpGraph, batch: BatchInfo, settled: bool = True
            ) -> dict[str, list[int]]:
    """Each op's ticks alone on the whole GPU per 128 rows, in a forward of the batch's rows
    (`tick_table`)."""
    return {o.name: tick_table(cfg.profile, o.name, batch.dense_batch,
                               op_context(o.name, batch.decode_context, batch.prompt_len),
                               settled=settled)
            for o in graph.ops}


def bubble_candidates(st: Structure, prob: Stage1Problem) -> list[str]:
    """Ops next to the largest gap on the compute stream, nearest first."""
    tau, durs = st.period, {}
    for n in expand(prob.graph, st.split, prob.mix, st.forms):
        durs[n.id] = prob.tables[n.op][n.work_tokens // TOKEN_QUANTUM]
    chain = st.orders.get(COMPUTE, [])
    if not chain:
        return []
    phase = {x: st.starts[x] % tau for x in st.starts}
    gaps = [((phase[b] - phase[a] - durs[a]) % tau if b != a else tau - durs[a], a, b)
            for a, b in zip(chain, chain[1:] + chain[:1], strict=True)]
    size, before, after = max(gaps)
    if size <= 0.01 * tau:
        return []
    lo, hi = phase[before] + durs[before], phase[before] + durs[before] + size
    during = [x for x in st.starts if st.streams[x] != COMPUTE
              and phase[x] < hi and phase[x] + durs[x] > lo]
    out: list[str] = []
    for x in [after, before, *during]:
        op = x.rsplit(".", 1)[0]
        if op not in out:
            out.append(op)
    return out


def search_structure(prob: Stage1Problem, budget_s: float, workers: int, max_nano: int,
                     progress: Progress | None, deterministic: bool = False
                     ) -> tuple[Structure | None, StageReport]:
    """Stage I from two nano-ops per op, growing counts near compute bubbles."""
    deadline = time.perf_counter() + budget_s
    best, report = solve_stage1(prob, Limits(FIRST_SHARE * budget_s, workers, deterministic),
                                progress)
    if best is None:
        return None, report
    q = prob.mix.dense_batch // TOKEN_QUANTUM
    tries = 0
    while (tries < 2 if deterministic else time.perf_counter() < deadline - 0.5):
        tries += 1
        improved = False
        for op in bubble_candidates(best, prob):
            left = deadline - time.perf_counter()
            if prob.counts[op] >= min(max_nano, q) or (left < 0.5 and not deterministic):
                continue
            counts = {**prob.counts, op: prob.counts[op] + 1}
            if progress:
                progress(f"stage I: trying {counts[op]} nano-ops for {op}")
            cap = math.ceil(GROW_MIN_GAIN * best.period) - 1  # a trial is kept only below it
            trial = replace(prob, counts=counts, max_period_ticks=cap)
            step = 0.25 * budget_s if deterministic else min(left, 0.25 * budget_s)
            st, rep = solve_stage1(trial, Limits(step, workers, deterministic), progress)
            if st is not None and st.period <= cap:
                best, report, prob, improved = st, rep, trial, True
                break
        if not improved:
            break
    return best, report


def boundary_cuts(graph: OpGraph, mix: TokenMix) -> dict[str, tuple[int, ...]] | None:
    """Every op cut once, at the decode/prompt boundary: two nano-batches, the decode rows and
    the prompt rows (None when the batch is not mixed or the boundary is off the 128 grid)."""
    nd, q = divmod(mix.num_decode, TOKEN_QUANTUM), mix.dense_batch // TOKEN_QUANTUM
    if nd[1] or not 0 < nd[0] < q:
        return None
    return {o.name: (nd[0],) for o in graph.ops}


def run_search(cfg: SearchConfig, progress: Progress | None = None) -> Schedule:
    """Stage I, stage II, build, check. ScheduleError when no schedule was found.

    Two structures are allocated and the one whose replayed forward (L layers, the pipeline's
    fill and drain included: what a set entry is judged by) is faster is kept: the
    decode/prompt split (`boundary_cuts`, its order and offsets from stage I), then stage I's
    own search. Stage I prices nano-ops without interference, where any overlap is free, so
    among structures of nearly equal period it may pick one that stage II cannot fill
    (docs/search.md has the H100 figures)."""
    from nanosched.autosearch.build import build_schedule
    from nanosched.autosearch.check import check_schedule

    _check_config(cfg)
    limit = cfg.time_limit_s
    deadline = time.perf_counter() + limit
    batch = search_batch(cfg)
    mix = TokenMix(batch.dense_batch, batch.num_decode, batch.prompt_len)
    graph = layer_graph(cfg.spec, cfg.tp).with_forms(cfg.forms)
    cap = round(cfg.max_period_us * TICKS_PER_US) if cfg.max_period_us else None
    q = batch.dense_batch // TOKEN_QUANTUM
    tables = _tables(cfg, graph, batch)
    margin = min(MARGIN_S, 0.02 * limit)

    def allocate(structure: Structure, rep1: StageReport, seconds: float
                 ) -> tuple[Schedule | None, StageReport]:
        nanos = expand(graph, structure.split, mix, structure.forms)
        ctx = {n.id: op_context(n.op, batch.decode_context, batch.prompt_len) for n in nanos}
        p2 = Stage2Problem(
            {n.id: cfg.profile.kernel_time_us(n.op, n.work_tokens, None, ctx[n.id])
             for n in nanos},
            {n.id: alloc_options(cfg.profile, n.resource, n.op, n.work_tokens,
                                 batch.dense_batch, ctx[n.id]) for n in nanos},
            structure.orders, structure.offsets,
            precedences(nano_deps(graph, nanos, mix, structure.forms)), cap)
        alloc, rep2 = solve_stage2(p2, Limits(seconds, cfg.num_workers, cfg.deterministic),
                                   progress)
        if alloc is None:
            return None, rep2
        sched = build_schedule(cfg.spec, cfg.tp, cfg.profile, graph, mix, batch, structure,
                               alloc, (rep1, rep2), cfg.command)
        check_schedule(sched, cfg.profile)
        return sched, rep2

    found: list[Schedule] = []
    bcuts = boundary_cuts(graph, mix)
    if bcuts is not None:
        if progress:
            progress("structure: the decode/prompt split")
        bprob = Stage1Problem(graph, mix, tables, {o.name: 2 for o in graph.ops}, cap, bcuts)
        st, rep = solve_stage1(bprob, Limits(BOUNDARY_STAGE1 * limit, cfg.num_workers,
                                             cfg.deterministic), progress)
        if st is not None:
            left = BOUNDARY_STAGE2 * limit if cfg.deterministic else min(
                BOUNDARY_STAGE2 * limit, deadline - time.perf_counter() - margin)
            sched, _ = allocate(st, rep, max(left, 0.01))
            if sched is not None:
                found.append(sched)
    rest = limit * (1 - BOUNDARY_STAGE1 - BOUNDARY_STAGE2) if cfg.deterministic else max(
        deadline - time.perf_counter(), 0.5 * limit * (1 - BOUNDARY_STAGE1 - BOUNDARY_STAGE2))
    counts = {o.name: min(max(2, (cfg.counts or {}).get(o.name, 2)), cfg.max_nano_ops, q)
              for o in graph.ops}
    prob = Stage1Problem(graph, mix, tables, counts, cap)
    if progress and bcuts is not None:
        progress("structure: stage I's search")
    structure, rep1 = search_structure(prob, STAGE1_SHARE * rest, cfg.num_workers,
                                       cfg.max_nano_ops, progress, cfg.deterministic)
    if structure is not None:
        left = max(deadline - time.perf_counter() - margin, 0.1 * rest)
        if cfg.deterministic:
            left = (1 - STAGE1_SHARE) * rest
        sched, rep2 = allocate(structure, rep1, left)
        if sched is not None:
            found.append(sched)
        elif not found:
            raise ScheduleError(_no_solution("stage II", rep2))
    elif not found:
        raise ScheduleError(_no_solution("stage I", rep1))
    return min(found, key=lambda s: s.prediction.iteration_us)  # a forward: fill and drain too


def _no_solution(stage: str, rep: StageReport) -> str:
    why = ("the problem is infeasible (is --max-period-us below what the GPU can do?)"
           if rep.status == "INFEASIBLE" else
           f"no solution within the time limit of {rep.time_limit_s:g} s (raise --time-limit)")
    return f"search found no schedule: {stage} ended {rep.status}: {why}; no file written"
