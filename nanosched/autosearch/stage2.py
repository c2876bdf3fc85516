r"""Stage II: GPU shares under interference (NanoFlow §4.1.3), in CP-SAT.

The structure of stage I is kept: nano-ops, ranges, streams, issue order by phase and layer
offsets k_x. Each nano-op x picks one allocation option j from the profile (full GPU, or an R->P
point: share r_j in per-mille, performance P_j), literal o_{x,j}, Σ_j o_{x,j} = 1, and runs for

    d_x = Σ_j o_{x,j} ⌈t_x / P_j⌉          (t_x: us alone on the full GPU, kernel table)

Time in ticks of 1 us; s_x start of layer 0's copy, e_x = s_x + d_x, phase φ_x = s_x − k_x τ.

More in docs/search.md, module notes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from nanosched.autosearch.cpsat import Limits, Progress, gap, solve
from nanosched.autosearch.durations import (
    FULL_SHARE,
    PARTITION,
    SIDES,
    TICKS_PER_US,
    AllocOption,
    Mechanism,
    Side,
    hbm_stream,
)
from nanosched.autosearch.periodic import Precedence, min_period
from nanosched.schedules.format import StageReport


@dataclass(frozen=True)
class Stage2Problem:
    alone: dict[str, float]  # nano-op id -> us alone on the full GPU
    options: dict[str, list[AllocOption]]  # nano-op id -> allocation options
    orders: dict[str, list[str]]  # stream -> ids in issue order
    offsets: dict[str, int]  # id -> layer offset
    deps: list[Precedence]
    max_period_ticks: int | None = None


@dataclass(frozen=True)
class Allocation:
    """Stage II's answer: an option, a duration and a start per nano-op, and the period."""

    choice: dict[str, AllocOption]
    durations: dict[str, int]
    starts: dict[str, int]
    period: int


class OptionVar(NamedTuple):
    """Option j of a nano-op x in the model: literal o_{x,j}, duration ⌈t_x / P_j⌉ in ticks,
    share r_j in per-mille."""

    lit: Any
    ticks: int
    share: int


@dataclass(frozen=True)
class NanoVars:
    """The solver variables of one nano-op x: start s_x, end e_x, duration d_x, the start
    s_x + τ of the next layer's copy, and one `OptionVar` per allocation option (in the order
    of `Stage2Problem.options`)."""

    start: Any
    end: Any
    dur: Any
    start1: Any
    options: list[OptionVar]


@dataclass(frozen=True)
class Stage2Vars:
    """The variables of a stage II model: τ, the time horizon, every nano-op's variables,
    the next layer's ends e_x + τ made for the A_xy no-overlaps, and the A_xy literals."""

    tau: Any
    horizon: int
    nanos: dict[str, NanoVars] = field(default_factory=dict)  # nano-op id -> its variables
    end1: dict[str, Any] = field(default_factory=dict)  # nano-op id -> e_x + τ
    apart: dict[tuple[str, str], Any] = field(default_factory=dict)  # (x, y) -> A_xy


def _add_nano(m: Any, x: str, prob: Stage2Problem, tau: Any, horizon: int) -> NanoVars:
    opts = prob.options[x]
    lits = [m.new_bool_var(f"opt_{x}_{j}") for j in range(len(opts))]
    m.add_exactly_one(lits)
    ticks = [o.ticks(prob.alone[x]) for o in opts]
    s = m.new_int_var(0, horizon, f"start_{x}")
    d = m.new_int_var(min(ticks), max(ticks), f"dur_{x}")
    m.add(d == sum(lit * t for lit, t in zip(lits, ticks, strict=True)))
    e = m.new_int_var(0, horizon, f"end_{x}")
    m.add(e == s + d)
    s1 = m.new_int_var(0, 2 * horizon, f"start1_{x}")
    m.add(s1 == s + tau)
    return NanoVars(s, e, d, s1, [OptionVar(lit, t, o.share)
                                  for lit, t, o in zip(lits, ticks, opts, strict=True)])


def build_cp_model(prob: Stage2Problem, rows: bool = True) -> tuple[Any, Stage2Vars]:
    """The CP-SAT model of stage II for a fixed structure; `rows`: add the exclusive-set
    rows (redundant; left out of the warm start, whose bound is not reported)."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    worst = {x: max(o.ticks(t) for o in prob.options[x]) for x, t in prob.alone.items()}
    horizon = 2 * sum(worst.values()) + 2
    tau = m.new_int_var(1, prob.max_period_ticks or horizon, "tau")
    v = Stage2Vars(tau, horizon)
    intervals, demands, energy, hbm = [], [], [], []
    for x in prob.alone:
        n = v.nanos[x] = _add_nano(m, x, prob, tau, horizon)
        k = prob.offsets.get(x, 0)
        m.add(n.start >= k * tau)
        m.add(n.start <= k * tau + tau - 1)
        m.add(n.end <= 2 * tau)
        for (lit, t, share), opt in zip(n.options, prob.options[x], strict=True):
            for copy, start in enumerate((n.start, n.start1)):
                intervals.append(m.new_optional_interval_var(
                    start, t, start + t, lit, f"iv{copy}_{x}_{len(intervals)}"))
                demands.append(share)
                if opt.mechanism == PARTITION and hbm_stream(opt):
                    hbm.append(intervals[-1])
            energy.append(lit * (share * t))
    m.add_cumulative(intervals, demands, FULL_SHARE)
    if len(hbm) > 1:
        m.add_no_overlap(hbm)
    m.add(sum(energy) <= FULL_SHARE * tau)
    for fair in _fair_energies(prob, v):
        m.add(sum(fair) <= FULL_SHARE * tau)
    for pick in exclusive_sets(prob) if rows else []:
        m.add(sum(v.nanos[x].options[j].lit * v.nanos[x].options[j].ticks for x, j in pick)
              <= tau)
    _add_order(m, prob, v, tau)
    v.apart.update(_add_point_consistency(m, prob, v))
    for x, y, shift in prob.deps:
        m.add(v.nanos[y].start + shift * tau >= v.nanos[x].end)
    m.minimize(tau)
    return m, v


def _add_point_consistency(m: Any, prob: Stage2Problem, v: Stage2Vars
                           ) -> dict[tuple[str, str], Any]:
    """A_xy literals and their no-overlaps (docs/search.md); {} when not needed."""
    npj = {x: [j for j, o in enumerate(prob.options[x]) if o.paired] for x in prob.alone}
    if not any(npj.values()):
        return {}
    stream = {x: sn for sn, chain in prob.orders.items() for x in chain}
    lits = {x: [o.lit for o in v.nanos[x].options] for x in prob.alone}

    def total(x: str, js: list[int]) -> Any:
        return sum(lits[x][j] for j in js)

    green = {x: [j for j, o in enumerate(prob.options[x]) if o.mechanism == PARTITION]
             for x in prob.alone}
    nonfull = {x: [j for j, o in enumerate(prob.options[x]) if o.mechanism != Mechanism.FULL]
               for x in prob.alone}
    ids = list(prob.alone)
    apart: dict[tuple[str, str], Any] = {}
    ends1 = v.end1

    def end1(z: str) -> Any:
        if z not in ends1:
            ends1[z] = m.new_int_var(0, 3 * v.horizon, f"end1_{z}")
            m.add(ends1[z] == v.nanos[z].start1 + v.nanos[z].dur)
        return ends1[z]

    for i, x in enumerate(ids):
        for y in ids[i + 1:]:
            if stream.get(x, x) == stream.get(y, y):
                continue
            if not ((npj[x] and nonfull[y]) or (npj[y] and nonfull[x])):
                continue
            a = m.new_bool_var(f"apart_{x}_{y}")
            apart[(x, y)] = a
            nx, ny = total(x, npj[x]), total(y, npj[y])
            if npj[x] and green[y]:
                m.add(a >= nx + total(y, green[y]) - 1)
            if npj[y] and green[x]:
                m.add(a >= total(x, green[x]) + ny - 1)
            if npj[x] and npj[y]:
                for j in npj[x]:
                    ox = prob.options[x][j]
                    mate = [k for k in npj[y] if prob.options[y][k].point == ox.point
                            and prob.options[y][k].side != ox.side]
                    m.add(a >= lits[x][j] + ny - total(y, mate) - 1)
            ivs = []
            for z in (x, y):
                nz = v.nanos[z]
                ivs.append(m.new_optional_interval_var(nz.start, nz.dur, nz.end, a,
                                                       f"ap0_{z}_{x}_{y}"))
                ivs.append(m.new_optional_interval_var(nz.start1, nz.dur, end1(z), a,
                                                       f"ap1_{z}_{x}_{y}"))
            m.add_no_overlap(ivs)
    return apart


def exclusive_sets(prob: Stage2Problem) -> list[list[tuple[str, int]]]:
    """The exclusive sets of docs/search.md, as (nano-op, option index) lists: for a
    pivot stream σ and a share level h of its options, the full and green_ctx options of σ
    with share ≥ h and those of the other streams with share ≥ h' = 1001 − h (at least 501
    when two or more other streams have nano-ops), plus either the non-partition options
    with share ≥ their stream's level, or (with point consistency) for each non-partition
    point one side's options with a positive share (one side for all points, or one side for
    a point q and the other side for every other point). No two options of a set
    can run at once, so Σ over a set of o_{x,j} ⌈t_x / P_j⌉ ≤ τ."""
    stream = {x: sn for sn, chain in prob.orders.items() for x in chain}
    used = {stream.get(x, x) for x in prob.alone}
    consistent = any(o.paired for opts in prob.options.values() for o in opts)
    points = sorted({o.point for opts in prob.options.values() for o in opts if o.paired})
    sets, seen = [], set()
    for sn in sorted(used):
        levels = sorted({o.share for x in prob.alone if stream.get(x, x) == sn
                         for o in prob.options[x] if o.share > 0})
        for h in levels:
            other = FULL_SHARE + 1 - h
            if len(used) > 2:
                other = max(other, FULL_SHARE // 2 + 1)
            base, by_share = [], []
            for x in prob.alone:
                need = h if stream.get(x, x) == sn else other
                for j, o in enumerate(prob.options[x]):
                    if o.share < need:
                        continue
                    (by_share if o.paired else base).append((x, j))
            variants = [base + by_share]
            if consistent:
                variants += [base + [(x, j) for x in prob.alone
                                     for j, o in enumerate(prob.options[x]) if o.side == side
                                     and o.paired and o.share > 0]
                             for side in SIDES]
                variants += [base + [(x, j) for x in prob.alone
                                     for j, o in enumerate(prob.options[x])
                                     if o.paired and o.share > 0
                                     and (o.side == side) == (o.point == q)]
                             for q in points for side in SIDES]
            for pick in variants:
                key = frozenset(pick)
                if pick and key not in seen:
                    seen.add(key)
                    sets.append(pick)
    keys = [frozenset(p) for p in sets]  # a subset of another set only repeats a weaker row
    return [p for p, k in zip(sets, keys, strict=True) if not any(k < o for o in keys)]


def _fair_energies(prob: Stage2Problem, v: Stage2Vars) -> list[list[Any]]:
    """The energy rows with effective shares of non-partition options (docs/search.md):
    a non-partition option only ever runs beside the other side of its own point, so any
    split e_c + e_o = 1000 of the GPU between the two sides is a valid demand. Rows for the
    fair split e_σ = 1000 P_σ / (P_c + P_o) (each unit of work costs the same GPU time
    whichever side does it) and for the two extremes (compute side 1000 or 0); [] when no
    nano-op has a non-partition option."""
    pts: dict[str, dict[str, float]] = {}
    for opts in prob.options.values():
        for o in opts:
            if o.paired:
                pts.setdefault(o.point, {})[o.side] = o.p
    if not pts:
        return []
    rows: list[list[Any]] = [[], [], []]
    for x, n in v.nanos.items():
        for (lit, t, share), o in zip(n.options, prob.options[x], strict=True):
            if not o.paired:
                for row in rows:
                    row.append(lit * (share * t))
                continue
            sides = pts[o.point]
            mate = sides.get(o.side.mate, 0.0)
            fair = FULL_SHARE * o.p / (o.p + mate) if o.p + mate > 0 else FULL_SHARE
            for row, e in zip(rows, (fair, FULL_SHARE * (o.side == Side.COMPUTE),
                                     FULL_SHARE * (o.side != Side.COMPUTE)), strict=True):
                row.append(lit * math.floor(e * t))
    return rows


def _add_order(m: Any, prob: Stage2Problem, v: Stage2Vars, tau: Any) -> None:
    k = prob.offsets
    for chain in prob.orders.values():
        for a, b in zip(chain, chain[1:], strict=False):
            m.add(v.nanos[b].start - k.get(b, 0) * tau >= v.nanos[a].end - k.get(a, 0) * tau)
        if chain:
            a, b = chain[-1], chain[0]
            m.add(v.nanos[b].start - k.get(b, 0) * tau + tau
                  >= v.nanos[a].end - k.get(a, 0) * tau)
        m.add(tau >= sum(v.nanos[x].end - v.nanos[x].start for x in chain))


def full_options(prob: Stage2Problem) -> dict[str, AllocOption]:
    """Each nano-op's whole-GPU option (its P is 1 / the op's settled factor)."""
    return {x: next(o for o in opts if o.mechanism == Mechanism.FULL)
            for x, opts in prob.options.items()}


def sequential_hint(prob: Stage2Problem) -> tuple[int, dict[str, int]] | None:
    """Everything on the full GPU, one nano-op at a time in phase order: always feasible."""
    full = {x: o.ticks(prob.alone[x]) for x, o in full_options(prob).items()}
    return min_period(full, {"all": _merge_by_phase(prob)}, prob.deps, prob.offsets)


def _merge_by_phase(prob: Stage2Problem) -> list[str]:
    """One global order: stage I's streams merged, each kept in its own order."""
    heads = {sn: 0 for sn in prob.orders}
    out: list[str] = []
    pending = {y: {x for x, yy, shift in prob.deps if yy == y
                   and shift + prob.offsets.get(y, 0) - prob.offsets.get(x, 0) == 0}
               for y in prob.alone}
    while len(out) < len(prob.alone):
        for sn, chain in prob.orders.items():
            if heads[sn] < len(chain) and pending[chain[heads[sn]]] <= set(out):
                out.append(chain[heads[sn]])
                heads[sn] += 1
                break
        else:
            return [x for chain in prob.orders.values() for x in chain]
    return out


def paired_options(prob: Stage2Problem) -> Stage2Problem:
    """Drop the non-partition options whose other side no nano-op of another stream has:
    such an option may overlap nothing (point consistency), so it is never better than the
    full GPU, and it would only slow the solver (e.g. the network table's points at tp 1)."""
    stream = {x: sn for sn, chain in prob.orders.items() for x in chain}
    have: dict[tuple[str, str], set[str]] = {}
    for x, opts in prob.options.items():
        for o in opts:
            if o.paired:
                have.setdefault((o.point, o.side), set()).add(stream.get(x, x))

    def keep(x: str, o: AllocOption) -> bool:
        if not o.paired:
            return True
        return bool(have.get((o.point, o.side.mate), set()) - {stream.get(x, x)})

    options = {x: [o for o in opts if keep(x, o)] for x, opts in prob.options.items()}
    return replace(prob, options=options)


def _set_hint(v: Stage2Vars, m: Any, prob: Stage2Problem, tau: int,
              starts: dict[str, int], choice: dict[str, AllocOption]) -> None:
    """The hint: starts, option literals and τ; complete (durations, ends, copies, A_xy = 0)
    when A_xy literals exist, as CP-SAT then needs it complete to use it (`choice` holds
    full or green options only, which never force an A_xy)."""
    for x, s in starts.items():
        j = prob.options[x].index(choice[x])
        n = v.nanos[x]
        d = n.options[j].ticks
        m.add_hint(n.start, s)
        if v.apart:
            m.add_hint(n.dur, d)
            m.add_hint(n.end, s + d)
            m.add_hint(n.start1, s + tau)
        if x in v.end1:
            m.add_hint(v.end1[x], s + tau + d)
        for i, o in enumerate(n.options):
            m.add_hint(o.lit, i == j)
    for a in v.apart.values():
        m.add_hint(a, False)
    m.add_hint(v.tau, tau)


def _solve(prob: Stage2Problem, limits: Limits, progress: Progress | None,
           hint: tuple[int, dict[str, int], dict[str, AllocOption]] | None, stage: str,
           rows: bool = True) -> tuple[Allocation | None, StageReport]:
    m, v = build_cp_model(prob, rows)
    if hint is not None:
        _set_hint(v, m, prob, *hint)
    solver, report, found = solve(m, stage, limits, progress)
    if not found:
        return None, report
    choice, durations = {}, {}
    for x, n in v.nanos.items():
        j = next(i for i, o in enumerate(n.options) if solver.boolean_value(o.lit))
        choice[x], durations[x] = prob.options[x][j], n.options[j].ticks
    starts = {x: solver.value(n.start) for x, n in v.nanos.items()}
    return Allocation(choice, durations, starts, solver.value(v.tau)), report


GREEN_SHARE = 0.4  # of stage II's time for the warm start over full and green_ctx options


def solve_stage2(prob: Stage2Problem, limits: Limits, progress: Progress | None = None
                 ) -> tuple[Allocation | None, StageReport]:
    """Solve stage II (over `paired_options`); (None, report) when no solution was found.

    Hinted with the all-sequential placement. When some option is non-partition (point
    consistency applies), a warm start first solves the problem restricted to full and
    green_ctx options (no A_xy literals: much easier) for `GREEN_SHARE` of the time; its
    answer, feasible for the whole problem, is the complete hint of the whole problem, which
    gets the rest of the time and gives the reported bound."""
    prob = paired_options(prob)
    seq = sequential_hint(prob)
    hint = None
    if seq is not None:
        hint = (seq[0], seq[1], full_options(prob))
    plain = {x: [o for o in opts if not o.paired]
             for x, opts in prob.options.items()}
    if plain == prob.options:
        alloc, report = _solve(prob, limits, progress, hint, "stage II")
        return (alloc, report) if alloc is not None else _keep_hint(prob, hint, report)
    warm_limits = replace(limits, time_limit_s=GREEN_SHARE * limits.time_limit_s)
    warm, warm_rep = _solve(replace(prob, options=plain), warm_limits, progress, hint,
                     "stage II (full and green_ctx options)", rows=False)
    if warm is not None:
        hint = (warm.period, warm.starts, warm.choice)
    spent = warm_rep.wall_s if not limits.deterministic else warm_limits.time_limit_s
    rest = replace(limits, time_limit_s=max(limits.time_limit_s - spent,
                                            (1 - GREEN_SHARE) * limits.time_limit_s * 0.25))
    alloc, report = _solve(prob, rest, progress, hint, "stage II")
    if alloc is None and warm is not None:  # too little time to even load the hint
        return warm, replace(warm_rep, stage="stage II", note=(
            "the whole problem found no solution in its time: this is the warm start's "
            "answer, with the bound and gap of its problem (full and green_ctx options only)"))
    if alloc is None:
        return _keep_hint(prob, hint, report)
    return alloc, report


def _keep_hint(prob: Stage2Problem, hint: tuple[int, dict[str, int], dict[str, AllocOption]]
               | None, report: StageReport) -> tuple[Allocation | None, StageReport]:
    """No solve found a solution in its time (a short --time-limit, a loaded machine): the
    all-sequential placement it was hinted with, which is always feasible, reported with the
    model's simple lower bound so that the report stays finite (a schedule refuses NaN)."""
    if hint is None or (prob.max_period_ticks and hint[0] > prob.max_period_ticks):
        return None, report
    period, starts, choice = hint
    durations = {x: o.ticks(prob.alone[x]) for x, o in choice.items()}
    bound = min(lower_bound(prob), period)
    return Allocation(choice, durations, starts, period), replace(
        report, status="HINT", objective_us=period / TICKS_PER_US,
        bound_us=bound / TICKS_PER_US, gap=gap(period, bound),
        note="no solve finished in time: every nano-op on the whole GPU, one at a time")


def lower_bound(prob: Stage2Problem) -> int:
    """A lower bound of τ that needs no solve: the largest of each stream's nano-ops at their
    shortest options (a stream runs its nano-ops one after another within τ) and the GPU
    energy Σ_x min_j r_j d_{x,j} / 1000 (the energy row)."""
    shortest = {x: min(o.ticks(prob.alone[x]) for o in opts) for x, opts in prob.options.items()}
    streams = [sum(shortest[x] for x in chain if x in shortest) for chain in prob.orders.values()]
    energy = sum(min(o.share * o.ticks(prob.alone[x]) for o in opts)
                 for x, opts in prob.options.items())
    return max([1, math.ceil(energy / FULL_SHARE)] + streams)
