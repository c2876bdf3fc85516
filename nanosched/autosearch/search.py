"""The search entry point: stage I (growing nano-op counts near compute bubbles), stage II,
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
from nanosched.errors import ConfigError, ProfileError, ScheduleError
from nanosched.models.ops import COMPUTE
from nanosched.models.spec import ModelSpec
from nanosched.profiler.format import Profile, check_profile_for
from nanosched.schedules.format import BatchInfo, Schedule, StageReport
from nanosched.schedules.sets import ScheduleSet
from nanosched.workloads import Workload

STAGE1_SHARE = 0.65
FIRST_SHARE = 0.7  # of stage I's time for its first solve (two nano-ops per op)
MARGIN_S = 1.0  # at most (2% of the limit): kept for stage II's model building and the checks
MIN_GAIN = 0.995  # a grown count is kept when it shortens the period by at least 0.5%
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


def batch_info(workload: Workload, dense_batch: int) -> BatchInfo:
    """The steady-state mix, the decode/prefill boundary placed on the 128-token grid."""
    from nanosched.costmodel import batch_mix

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
            cap = math.ceil(MIN_GAIN * best.period) - 1  # a trial is kept only below it
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
    graph = layer_graph(cfg.spec, cfg.tp)
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


def default_out(spec: ModelSpec, tp: int, gpu: str, workload: Workload, batch: int) -> str:
    """e.g. `llama3-70b_tp8_h100_in1024-out512_b2048.schedule.json`."""
    gpu_key = gpu.lower().removeprefix("synthetic-").replace(" ", "-")
    return f"{spec.name}_tp{tp}_{gpu_key}_{workload.name}_b{batch}.schedule.json"


BUCKETS = ("all", "dense")
# solver work of the whole search, in CP-SAT deterministic seconds (`search_and_save`)
DEFAULT_TIME_LIMIT = {"all": 120.0, "dense": 20.0}


def profile_model(profile: str | None) -> object:
    """The model a measured profile was taken for (`search` without --model: a model the
    registry does not know, such as a frontend model's)."""
    from nanosched.autosearch.request import load_named_profile

    if profile is None:
        raise ConfigError("nanosched search needs --model, or --profile FILE to take the model "
                          "it was measured for")
    return load_named_profile(profile, None).model


def search_and_save(*, model: str | None, tp: int | None, profile: str | None, gpu: str | None,
                    workload: str | None, input_len: float | None, output_len: float | None,
                    dense_batch: str, time_limit: float | None, workers: int,
                    max_nano_ops: int, max_period_us: float | None, out: str | None,
                    echo: Progress, print_table: object, command: str = "",
                    allow_unsettled: bool = False, kv_dtype: str = "auto",
                    buckets: str = "all", min_gain: float | None = None) -> object:
    """What `nanosched search` does: resolve, search a schedule set with live progress (every
    batch shape, or with `buckets="dense"` only the steady state's), report, write.

    A measured profile whose pairs were timed in bursts is refused (its R->P points overstate
    overlap under the power cap) unless `allow_unsettled`. Ctrl-C stops the search with
    KeyboardInterrupt and writes nothing."""
    from nanosched.autosearch.request import resolve
    from nanosched.autosearch.sets import MIN_GAIN, SetSearchConfig, search_set
    from nanosched.autosearch.synthetic import context_grid, synthetic_profile
    from nanosched.fileio import check_output_file
    from nanosched.hardware import get_gpu
    from nanosched.models.spec import load_spec
    from nanosched.schedules.sets import save_schedule_set
    from nanosched.schedules.show import (
        PIPELINE_COLUMNS,
        SET_COLUMNS,
        pipeline_rows,
        proof_text,
        set_rows,
        set_summary_lines,
        summary_lines,
    )
    from nanosched.workloads import resolve_workload

    if buckets not in BUCKETS:
        raise ConfigError(f"--buckets must be one of {', '.join(BUCKETS)}, got {buckets!r}")
    limit = DEFAULT_TIME_LIMIT[buckets] if time_limit is None else time_limit
    gain = MIN_GAIN if min_gain is None else min_gain
    if not gain >= 1.0:
        raise ConfigError(f"--min-gain must be at least 1.0, got {gain}")
    if not 0 < limit < math.inf:
        raise ConfigError(f"--time-limit must be a finite number of seconds > 0, got {limit}")
    if workers < 1 or max_nano_ops < 2:
        raise ConfigError("--workers must be >= 1 and --max-nano-ops >= 2; "
                          f"got {workers}, {max_nano_ops}")
    if max_period_us is not None and not 0 < max_period_us < math.inf:
        raise ConfigError(f"--max-period-us must be a finite number of microseconds > 0, got "
                          f"{max_period_us}")
    if out is not None:
        check_output_file(out, "--out", make_parent=False)
    spec = load_spec(model) if model is not None else profile_model(profile)
    wl = resolve_workload(workload, input_len, output_len)
    choice = resolve(spec, tp, profile, gpu, wl, dense_batch, kv_dtype=kv_dtype)
    for msg in choice.messages:
        echo(msg)
    prof = choice.profile
    measured = prof
    if prof is None:
        b = batch_info(wl, choice.dense_batch)
        prof = synthetic_profile(spec, get_gpu(gpu or "h100"), choice.tp, choice.dense_batch,
                                 context_grid(b.decode_context, b.prompt_len))
    cfg = SearchConfig(spec, choice.tp, prof, wl, choice.dense_batch, limit, workers,
                       max_nano_ops, max_period_us, command, deterministic=True)
    why = measured.unsettled() if measured is not None else None
    if why and not allow_unsettled:
        raise ProfileError(f"profile for {prof.model.name} on {prof.identity.gpu_name}: {why}, "
                           f"so its R->P points overstate what overlap gives on a serving GPU; "
                           f"re-measure it with `nanosched profile` (pairs are timed sustained), "
                           f"or pass --allow-unsettled to search on it anyway")
    if why:
        echo(f"WARNING: {why}; searching on it because of --allow-unsettled")
    path = out or default_out(spec, choice.tp, prof.identity.gpu_name, wl, choice.dense_batch)
    if out is None:
        check_output_file(path, "--out", make_parent=False)
    steady = search_batch(cfg)
    keys = ((steady.num_decode, steady.dense_batch),) if buckets == "dense" else None
    what = "the steady-state batch" if keys else "every batch shape (bounds first)"
    echo(f"searching {spec.name} tp={choice.tp}, dense batch {choice.dense_batch}, {what}, "
         f"solver work {limit:g} (CP-SAT deterministic time, about a second each on an idle "
         f"core: the verdict does not depend on the machine's load), {workers} workers")
    started = time.perf_counter()

    def on_decided(decided: list, to_search: int, n: int) -> None:
        if keys is not None:
            return
        how = [r.how for r in decided]
        echo(f"[{len(decided)}/{n}] decided without a search: {how.count('small')} too small "
             f"for two nano-batches, {how.count('bounded') + how.count('ceiling')} bounded "
             f"below {gain:.2f}x ({how.count('bounded')} by the bound, "
             f"{how.count('ceiling')} by the ceiling); "
             f"searching {to_search}, the steady state's D={steady.num_decode} "
             f"T={steady.dense_batch} first ({time.perf_counter() - started:.0f} s)")

    def on_key(r: object, i: int, n: int) -> None:
        e = r.entry  # type: ignore[attr-defined]
        if r.how in ("small", "bounded", "ceiling") and keys is None:  # type: ignore
            return
        elapsed = time.perf_counter() - started
        proof = proof_text(e, gain)
        echo(f"[{i}/{n}] D={e.num_decode} T={e.num_tokens}: {e.kind}, {e.reason}"
             f"{'; NO GAIN ' + proof if proof else ''} "
             f"({r.wall_s:.1f} s; {elapsed:.0f} s so far)")  # type: ignore[attr-defined]

    sset = search_set(SetSearchConfig(cfg, gain, keys, bound=keys is None),
                      echo if keys else None, on_key, on_decided)
    full = sset.full
    if full is not None and full.schedule is not None:
        print_table(pipeline_rows(full.schedule), PIPELINE_COLUMNS)  # type: ignore[operator]
        echo(LEGEND)
        for line in summary_lines(full.schedule):
            echo(line)
    if keys is None:
        print_table(set_rows(sset), SET_COLUMNS)  # type: ignore[operator]
    for line in set_summary_lines(sset):
        echo(line)
    if choice.profile is None:
        echo("WARNING: predicted from a SYNTHETIC profile, not measurements")
    save_schedule_set(sset, path)
    echo(f"schedule set written to {path}")
    for line in verdict_lines(sset, path, what, limit, time.perf_counter() - started,
                              choice.profile is None):
        echo(line)
    return sset


LEGEND = ("(k: the layer a nano-op works on, l - k in period l; R: its share of the GPU, P: the "
          "speed it keeps there, 1 = alone on the whole GPU; alloc full:SMs = every SM, "
          "green_ctx:N = an N-SM partition, cta:N = at most N thread blocks; period / bound / "
          "gap: the solver's layer time, the least it proved possible, the distance between)")


def verdict_lines(s: ScheduleSet, path: str, what: str, work: float, wall_s: float,
                  synthetic: bool) -> list[str]:
    """The search's last lines, for a reader without the papers: what was searched, the
    verdict, what to run next."""
    pipes = s.pipelines
    gpu = s.gpu_name + (" (a SYNTHETIC profile)" if synthetic else "")
    lines = [f"searched: {s.model['name']} at tp {s.tp} on {gpu}, {what} ({len(s.entries)} "
             f"batch shapes), solver work {work:g} (deterministic), took {wall_s:.0f} s"]
    full = s.full
    best = full.schedule.prediction.speedup if full is not None and \
        full.schedule is not None else None
    found = f"; the best pipeline found at the steady state predicts {best:.2f}x" \
        if best is not None else ""
    if pipes:
        top = max(pipes, key=lambda e: e.speedup)
        lines.append(f"verdict: PIPELINED at {len(pipes)} of {len(s.entries)} batch shapes, up "
                     f"to {top.speedup:.2f}x of Sequential's speed predicted (D={top.num_decode}"
                     f", T={top.num_tokens}); Sequential elsewhere{found}")
        lines.append(f"next: on the GPU, nanosched verify {path} --out {path} (keeps the "
                     f"pipelines that win there), then nanosched bench --model "
                     f"{s.model['name']} --tp {s.tp} --schedule {path} --compare")
        return lines
    unproven = sum(e.proof == "unproven" for e in s.entries)
    proof = "proven" if not unproven else f"NOT proven at {unproven} shapes (a longer " \
        f"--time-limit may find a pipeline there)"
    lines.append(f"verdict: NO GAIN, {proof}: no pipeline reaches the {s.min_gain:.2f}x of "
                 f"Sequential an entry needs{found}; the set runs Sequential")
    lines.append(f"next: serve or bench with --schedule sequential (the default's choice "
                 f"here); nanosched show {path} --plot gantt.png draws the best pipeline found")
    return lines
