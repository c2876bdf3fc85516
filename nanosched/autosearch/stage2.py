r"""Stage II: GPU shares under interference (NanoFlow §4.1.3), in CP-SAT.

The structure of stage I is kept: nano-ops, ranges, streams, issue order by phase and layer
offsets k_x. Each nano-op x picks one allocation option j from the profile (full GPU, or an R->P
point: share r_j in per-mille, performance P_j), literal o_{x,j}, Σ_j o_{x,j} = 1, and runs for

    d_x = Σ_j o_{x,j} ⌈t_x / P_j⌉          (t_x: us alone on the full GPU, kernel table)

Time in ticks of 1 us; s_x start of layer 0's copy, e_x = s_x + d_x, phase φ_x = s_x − k_x τ.

Constraints
  dependencies (x → y, δ):   s_y + δ τ ≥ e_x
  stream order (kept):       φ_b ≥ φ_a + d_a for consecutive a, b; φ_first + τ ≥ φ_last + d_last
  phases:                    0 ≤ φ_x ≤ τ − 1;  e_x ≤ 2 τ
  capacity:                  cumulative over the union of two unrolled layers of the optional
                             intervals [s_x + lτ, s_x + lτ + ⌈t_x / P_j⌉) with demand r_j and
                             presence o_{x,j}, l ∈ {0, 1}: Σ r ≤ 1000 at every instant
  energy (redundant):        Σ_{x,j} o_{x,j} r_j ⌈t_x / P_j⌉ ≤ 1000 τ
Objective: minimise τ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanosched.autosearch.cpsat import Limits, Progress, solve
from nanosched.autosearch.durations import FULL_SHARE, AllocOption, to_ticks
from nanosched.autosearch.periodic import min_period
from nanosched.schedules.format import StageReport


@dataclass(frozen=True)
class Stage2Problem:
    alone: dict[str, float]  # nano-op id -> us alone on the full GPU
    options: dict[str, list[AllocOption]]  # nano-op id -> allocation options
    orders: dict[str, list[str]]  # stream -> ids in issue order
    offsets: dict[str, int]  # id -> layer offset
    deps: list[tuple[str, str, int]]  # (x, y, δ)
    max_period_ticks: int | None = None


@dataclass(frozen=True)
class Allocation:
    """Stage II's answer: an option, a duration and a start per nano-op, and the period."""

    choice: dict[str, AllocOption]
    durations: dict[str, int]
    starts: dict[str, int]
    period: int


def _add_nano(m: Any, x: str, prob: Stage2Problem, tau: Any, horizon: int
              ) -> tuple[Any, Any, list[tuple[Any, int, int]]]:
    opts = prob.options[x]
    lits = [m.new_bool_var(f"opt_{x}_{o.share}") for o in opts]
    m.add_exactly_one(lits)
    ticks = [o.ticks(prob.alone[x]) for o in opts]
    s = m.new_int_var(0, horizon, f"start_{x}")
    d = m.new_int_var(min(ticks), max(ticks), f"dur_{x}")
    m.add(d == sum(lit * t for lit, t in zip(lits, ticks, strict=True)))
    e = m.new_int_var(0, horizon, f"end_{x}")
    m.add(e == s + d)
    return s, e, [(lit, t, o.share) for lit, t, o in zip(lits, ticks, opts, strict=True)]


def build_model(prob: Stage2Problem) -> tuple[Any, dict[str, Any]]:
    """The CP-SAT model of stage II for a fixed structure."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    worst = {x: max(o.ticks(t) for o in prob.options[x]) for x, t in prob.alone.items()}
    horizon = 2 * sum(worst.values()) + 2
    tau = m.new_int_var(1, prob.max_period_ticks or horizon, "tau")
    v: dict[str, Any] = {"tau": tau, "s": {}, "e": {}, "opts": {}}
    intervals, demands, energy = [], [], []
    for x in prob.alone:
        s, e, opts = _add_nano(m, x, prob, tau, horizon)
        v["s"][x], v["e"][x], v["opts"][x] = s, e, opts
        s1 = m.new_int_var(0, 2 * horizon, f"start1_{x}")
        m.add(s1 == s + tau)
        k = prob.offsets.get(x, 0)
        m.add(s >= k * tau)
        m.add(s <= k * tau + tau - 1)
        m.add(e <= 2 * tau)
        for lit, t, share in opts:
            for copy, start in enumerate((s, s1)):
                intervals.append(m.new_optional_interval_var(
                    start, t, start + t, lit, f"iv{copy}_{x}_{share}"))
                demands.append(share)
            energy.append(lit * (share * t))
    m.add_cumulative(intervals, demands, FULL_SHARE)
    m.add(sum(energy) <= FULL_SHARE * tau)
    _add_order(m, prob, v, tau)
    for x, y, shift in prob.deps:
        m.add(v["s"][y] + shift * tau >= v["e"][x])
    m.minimize(tau)
    return m, v


def _add_order(m: Any, prob: Stage2Problem, v: dict[str, Any], tau: Any) -> None:
    k = prob.offsets
    for chain in prob.orders.values():
        for a, b in zip(chain, chain[1:], strict=False):
            m.add(v["s"][b] - k.get(b, 0) * tau >= v["e"][a] - k.get(a, 0) * tau)
        if chain:
            a, b = chain[-1], chain[0]
            m.add(v["s"][b] - k.get(b, 0) * tau + tau >= v["e"][a] - k.get(a, 0) * tau)
        m.add(tau >= sum(v["e"][x] - v["s"][x] for x in chain))


def sequential_hint(prob: Stage2Problem) -> tuple[int, dict[str, int]] | None:
    """Everything on the full GPU, one nano-op at a time in phase order: always feasible."""
    full = {x: to_ticks(t) for x, t in prob.alone.items()}
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


def solve_stage2(prob: Stage2Problem, limits: Limits, progress: Progress | None = None
                 ) -> tuple[Allocation | None, StageReport]:
    """Solve stage II; (None, report) when no solution was found."""
    m, v = build_model(prob)
    hint = sequential_hint(prob)
    if hint is not None:
        m.add_hint(v["tau"], hint[0])
        for x, s in hint[1].items():
            m.add_hint(v["s"][x], s)
            for lit, _, share in v["opts"][x]:
                m.add_hint(lit, share == FULL_SHARE)
    solver, report, found = solve(m, "stage II", limits, progress)
    if not found:
        return None, report
    choice, durations = {}, {}
    for x, opts in v["opts"].items():
        j = next(i for i, (lit, _, _) in enumerate(opts) if solver.boolean_value(lit))
        choice[x], durations[x] = prob.options[x][j], opts[j][1]
    starts = {x: solver.value(s) for x, s in v["s"].items()}
    return Allocation(choice, durations, starts, solver.value(v["tau"])), report
