"""Whether a set entry's NO GAIN is proven: the resource ceiling of a batch, and each sequential
key's proof.

`resource_ceiling` is an LP (GLOP) over modes, sets of compatible allocations at most one per
stream, each op's least split row time to do: Sequential / its least period bounds the predicted
gain of every pipeline the search can return, both collective forms priced. `with_proof` records
why a sequential entry's NO GAIN holds: the ceiling below min-gain, stage I within 5% and stage
II's bound below min-gain, or unproven. So a set says where no pipeline can gain, not only where
none was found.

More in docs/search.md, module notes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from nanosched.autosearch.durations import (
    FULL_SHARE,
    PARTITION,
    AllocOption,
    alloc_options,
    compatible,
    op_context,
)
from nanosched.autosearch.opgraph import TokenMix, layer_graph
from nanosched.autosearch.search import SearchConfig
from nanosched.autosearch.simulate import sequential_op_times
from nanosched.autosearch.stage1_bounds import op_min_ticks
from nanosched.constants import SEQUENTIAL, TOKEN_QUANTUM
from nanosched.models.ops import COMPUTE, MEMORY, NETWORK, OTHER
from nanosched.schedules.format import BatchInfo, Schedule
from nanosched.schedules.sets import GAP_PROVEN, SetEntry


@dataclass(frozen=True)
class OpWork:
    """One op of the layer in the resource LP: its least row time per layer and its options."""

    op: str
    resource: str
    work_us: float
    options: tuple[AllocOption, ...]


@dataclass(frozen=True)
class ResourceCeiling:
    """The resource ceiling of a batch: the gain, and the forms and period that give it."""

    gain: float
    period_us: float
    sequential_us: float  # one layer, as the search prices Sequential
    forms: dict[str, str]


def fits(opts: tuple[AllocOption, ...]) -> bool:
    """Options that may run at once: pairwise compatible (so no full option, and green ones
    only beside green ones), green shares within the GPU."""
    return (all(compatible(a, b) for a, b in itertools.combinations(opts, 2))
            and sum(o.share for o in opts if o.mechanism == PARTITION) <= FULL_SHARE)


def least_work_us(cfg: SearchConfig, op: str, quanta: int, whole: bool,
                  context: float | None) -> float:
    """Least total row time of `op`'s nano-ops over `quanta` quanta: 2..max_nano_ops of them
    when the domain is the batch (`whole`), else 1..max_nano_ops (the search's counts)."""
    table = [0.0] + [cfg.profile.kernel_time_us(op, k * TOKEN_QUANTUM, None, context)
                     for k in range(1, quanta + 1)]
    first = 2 if whole else 1
    top = max(first, min(cfg.max_nano_ops, quanta))
    return min(op_min_ticks(table, c, quanta, whole) for c in range(first, top + 1))


def best_options(cfg: SearchConfig, resource: str, op: str, quanta: int, batch_tokens: int,
                 context: float | None) -> tuple[AllocOption, ...]:
    """Every option a nano-op of `op` of 1..quanta quanta may get, each with the largest P it
    has at any of those sizes (compatibility depends on mechanism, share, side, table and, off
    a partition, the point: those are kept apart)."""
    best: dict[tuple, AllocOption] = {}
    for k in range(1, quanta + 1):
        for o in alloc_options(cfg.profile, resource, op, k * TOKEN_QUANTUM, batch_tokens,
                               context):
            key = option_key(o)
            if key not in best or best[key].p < o.p:
                best[key] = o
    return tuple(best.values())


def option_key(o: AllocOption) -> tuple:
    """What an option is in the LP's modes, whatever the nano-op's size: what compatibility
    and the GPU's shares look at (mechanism, share, side, and the table on a partition, else
    the point)."""
    return (o.mechanism, o.share, o.side, o.table if o.mechanism == PARTITION else o.point)


def op_works(cfg: SearchConfig, batch: BatchInfo) -> dict[str, OpWork]:
    """Every op of the layer (both forms of each collective) with a non-empty domain at
    `batch`, by name."""
    mix = TokenMix(batch.dense_batch, batch.num_decode, batch.prompt_len)
    out = {}
    for o in layer_graph(cfg.spec, cfg.tp).ops:
        lo, hi = mix.domain(o.domain)
        quanta = (hi - lo) // TOKEN_QUANTUM
        if quanta <= 0:
            continue
        ctx = op_context(o.name, batch.decode_context, batch.prompt_len)
        out[o.name] = OpWork(o.name, o.resource,
                             least_work_us(cfg, o.name, quanta, o.domain == "all", ctx),
                             best_options(cfg, o.resource, o.name, quanta, batch.dense_batch,
                                          ctx))
    return out


def modes(ops: list[OpWork]) -> list[tuple[tuple[int, ...], tuple[AllocOption, ...]]]:
    """Every mode: (op indices, their options), at most one op per stream (compute: compute
    or elementwise ops; memory: memory or elementwise ops; network)."""
    def of(*classes: str) -> list[int | None]:
        return [None, *(i for i, o in enumerate(ops) if o.resource in classes)]

    sets = {tuple(sorted(x for x in (a, b, c) if x is not None))
            for a in of(COMPUTE, OTHER) for b in of(MEMORY, OTHER) for c in of(NETWORK)}
    out: list[tuple[tuple[int, ...], tuple[AllocOption, ...]]] = []

    def extend(idx: tuple[int, ...], chosen: tuple[AllocOption, ...]) -> None:
        if len(chosen) == len(idx):
            out.append((idx, chosen))
            return
        for o in ops[idx[len(chosen)]].options:
            if not chosen or fits((*chosen, o)):
                extend(idx, (*chosen, o))

    for idx in sorted(s for s in sets if s and len(set(s)) == len(s)):
        extend(idx, ())
    return out


@dataclass(frozen=True)
class ModeTime:
    """One mode of the resource LP's optimum: its ops, their options, its us per layer."""

    ops: tuple[str, ...]
    options: tuple[AllocOption, ...]
    us: float


def solve_modes(ops: list[OpWork]) -> tuple[float, list[ModeTime]]:
    """tau* of the resource LP (docs/search.md) over `ops`, and the modes its optimum runs
    (those of more than 1e-6 us per layer, longest first)."""
    from ortools.linear_solver import pywraplp

    lp = pywraplp.Solver.CreateSolver("GLOP")
    tau = lp.NumVar(0, lp.infinity(), "tau")
    found = modes(ops)
    t = [lp.NumVar(0, lp.infinity(), f"m{k}") for k in range(len(found))]
    work: list[list] = [[] for _ in ops]
    for var, (idx, opts) in zip(t, found, strict=True):
        for i, o in zip(idx, opts, strict=True):
            work[i].append(var * o.p)
    for i, o in enumerate(ops):
        lp.Add(lp.Sum(work[i]) >= o.work_us)
    lp.Add(lp.Sum(t) <= tau)
    lp.Minimize(tau)
    if lp.Solve() != pywraplp.Solver.OPTIMAL:  # always feasible: every op alone in turn
        raise RuntimeError("the resource ceiling's LP did not solve")
    used = [ModeTime(tuple(ops[i].op for i in idx), opts, var.solution_value())
            for var, (idx, opts) in zip(t, found, strict=True) if var.solution_value() > 1e-6]
    return tau.solution_value(), sorted(used, key=lambda m: -m.us)


def least_period_us(ops: list[OpWork]) -> float:
    """tau* of the resource LP (docs/search.md) over `ops`."""
    return solve_modes(ops)[0]


def form_ops(cfg: SearchConfig, batch: BatchInfo, forms: dict[str, str],
             works: dict[str, OpWork] | None = None) -> list[OpWork]:
    """The ops of the layer under collective `forms` with a non-empty domain at `batch`, in
    the layer's order (`works`: `op_works` of the batch, when already built)."""
    works = works if works is not None else op_works(cfg, batch)
    return [works[o.name] for o in layer_graph(cfg.spec, cfg.tp).active_ops(forms)
            if o.name in works]


def resource_ceiling(cfg: SearchConfig, batch: BatchInfo) -> ResourceCeiling:
    """The resource ceiling of `batch` under `cfg`, over every choice of collective forms
    (docs/search.md)."""
    spec, tp = cfg.spec, cfg.tp
    seq = sum(sequential_op_times(spec, tp, cfg.profile, batch).values())
    graph = layer_graph(spec, tp)
    works = op_works(cfg, batch)
    groups = graph.groups()
    best: ResourceCeiling | None = None
    for pick in itertools.product(*groups.values()):
        forms = dict(zip(groups, pick, strict=True))
        period = least_period_us(form_ops(cfg, batch, forms, works))
        if best is None or seq / period > best.gain:
            best = ResourceCeiling(seq / period, period, seq, forms)
    assert best is not None  # one choice at least (none to make at tp = 1)
    return best


def stage_gaps(sched: Schedule | None) -> tuple[float | None, float | None]:
    """(stage I's gap, stage II's gap) of a kept pipeline; None where unknown."""
    gaps: dict[str, float | None] = {}
    for st in (sched.stages if sched is not None else ()):
        gaps[st.stage] = st.gap if math.isfinite(st.gap) else None
    return gaps.get("stage I"), gaps.get("stage II")


def structure_gain(sched: Schedule) -> float | None:
    """Stage II's bound of the kept pipeline as a gain: Sequential's period over it (no
    allocation of that structure beats it, as stage II prices it)."""
    st = next((s for s in sched.stages if s.stage == "stage II"), None)
    if st is None or not math.isfinite(st.bound_us) or st.bound_us <= 0:
        return None
    return sched.prediction.sequential_period_us / st.bound_us


def structure_proves(stage1_gap: float | None, bound_gain: float | None,
                     min_gain: float) -> bool:
    """The `gap` proof (docs/search.md): stage I within `GAP_PROVEN` of its bound, and
    stage II's bound for the kept structure, as a gain, below min_gain."""
    return stage1_gap is not None and stage1_gap <= GAP_PROVEN \
        and bound_gain is not None and bound_gain < min_gain


def no_gain_proof(sched: Schedule | None, ceiling: float | None, min_gain: float) -> str:
    """`ceiling`, `gap` or `unproven` for a searched key the set runs Sequential (docs/search.md);
    `sched`: the best pipeline its search found (None: it found none)."""
    if ceiling is not None and ceiling < min_gain:
        return "ceiling"
    if sched is not None and structure_proves(stage_gaps(sched)[0], structure_gain(sched),
                                              min_gain):
        return "gap"
    return "unproven"


def with_proof(entry: SetEntry, sched: Schedule | None, ceiling: float | None,
               min_gain: float) -> SetEntry:
    """A searched key's entry with its ceiling, the gaps and stage II's bound (as a gain) of
    the best pipeline found (`sched`, None when the search found none) and, when the set runs
    Sequential there, its proof."""
    g1, g2 = stage_gaps(sched)
    proof = no_gain_proof(sched, ceiling, min_gain) if entry.kind == SEQUENTIAL else None
    return replace(entry, proof=proof, ceiling=ceiling, stage1_gap=g1, stage2_gap=g2,
                   structure_bound=structure_gain(sched) if sched is not None else None)
