"""The pipeline ceiling of one batch: how much faster than Sequential any pipeline of row groups
could be predicted, priced as the search prices it, with the order of its nano-ops relaxed away.

The search (stages I and II) answers "what is the best schedule it finds in its time"; this
module answers "how much could there be", so that a search that finds nothing can be told apart
from a GPU that offers nothing. It is a linear program per structure, solved exactly (GLOP).

**Structures.** The batch's decode rows are cut into `kd` groups and its prompt rows into `kp`
groups on the 128-row grid (every composition up to `max_groups` groups per part, or only equal
ones), and every op of the layer is cut at the same groups: one piece per (op, group) that the
op's domain covers. Pieces of one group form a chain in every layer (each op reads the previous
op's rows), so they never run at once, and a group's chain of one layer must end before its
chain of the next begins.

**Modes.** At any instant the GPU runs one mode: one piece alone on the whole GPU (P = 1 / F,
the forward table), or a compute piece beside one or two pieces of other classes (attention,
elementwise, collectives), or two such pieces beside each other, all of pairwise different
groups, under options that may run at once (`durations.compatible`; green-context shares
summing to at most the GPU). A piece's options and P are `durations.alloc_options`, exactly as
stage II prices its nano-op. Two compute pieces never run at once: no R->P point pairs two GEMMs.

**The LP.** Variables: the time t_m each mode runs per layer, and the period tau. Rows:
  - work: for each piece x, sum over modes m holding x of t_m P_{m,x} >= x's time alone (its row);
  - one mode at a time: sum_m t_m <= tau;
  - chains: for each group g, sum over its pieces of their time (sum of t_m over modes holding
    them) <= tau (in the steady state each group finishes one layer per period).
Minimise tau. Every schedule of that structure that stage II could build is a feasible point
(its modes' times, its period), so Sequential's time / tau bounds its predicted gain per layer;
the ceiling is the largest over the structures tried. It ignores what a real schedule also pays:
integer ticks, the order of the nano-ops, fill and drain, a prompt chunk split between groups.
A piece may run under several allocations (a part beside the attention on a partition, a part
CTA-bound), as a search that cuts it into several nano-ops could; `one_option` holds each piece
to one allocation in every mode it runs in (binaries and big-M rows: a MILP for SCIP), the
ceiling of the structures whose nano-ops are exactly the pieces, lower and closer to what a
search of few nano-ops per op can find. Each MILP gets `MILP_SECONDS`; one stopped there
reports its proven bound, so the figure stays a ceiling.

What it does not cover: pipelines that cut different ops at different rows (the search may), and
at tp > 1 the reduce-scatter / all-gather form of a collective (the all-reduce form is priced).
So the search proves its NO GAIN with the looser resource ceiling instead
(`nanosched.autosearch.proof`: the same pricing without row groups, every form), which covers
every pipeline it can return.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from nanosched.autosearch.durations import (
    AllocOption,
    Mechanism,
    alloc_options,
    op_context,
)
from nanosched.autosearch.opgraph import TokenMix, layer_graph
from nanosched.autosearch.proof import fits
from nanosched.autosearch.search import SearchConfig
from nanosched.autosearch.simulate import sequential_op_times
from nanosched.constants import TOKEN_QUANTUM
from nanosched.models.ops import COMPUTE
from nanosched.schedules.format import BatchInfo

Group = tuple[int, int]  # rows [lo, hi) of the batch
MILP_SECONDS = 20.0  # per structure with `one_option`; past it the MILP's proven bound is kept


@dataclass(frozen=True)
class Piece:
    """One op over one row group."""

    op: str
    resource: str
    group: int  # index into the structure's groups
    alone_us: float  # its row at the group's rows: P is against it
    options: tuple[AllocOption, ...]

    @property
    def full(self) -> AllocOption:
        """Its option alone on the whole GPU (P = 1 / F)."""
        return next(o for o in self.options if o.mechanism == Mechanism.FULL)


@dataclass(frozen=True)
class StructureCeiling:
    """The LP's answer for one structure."""

    decode_groups: tuple[int, ...]  # rows of each decode group
    prompt_groups: tuple[int, ...]  # rows of each prompt group
    period_us: float
    gain: float  # Sequential's layer time / period_us
    modes: tuple[tuple[str, float], ...]  # (mode, us per layer) of its answer, largest first


@dataclass(frozen=True)
class Ceiling:
    """The pipeline ceiling of a batch: the best structure and every structure tried."""

    sequential_us: float  # one layer, as the search prices Sequential
    best: StructureCeiling
    structures: tuple[StructureCeiling, ...]

    @property
    def gain(self) -> float:
        return self.best.gain


def compositions(quanta: int, max_parts: int, equal_only: bool) -> list[tuple[int, ...]]:
    """The ways to cut `quanta` 128-row quanta into 1..max_parts groups, as rows per group."""
    if quanta == 0:
        return [()]
    out: list[tuple[int, ...]] = []
    for parts in range(1, min(max_parts, quanta) + 1):
        if equal_only:
            cuts = [i * quanta // parts for i in range(parts + 1)]
            out.append(tuple((b - a) * TOKEN_QUANTUM for a, b in itertools.pairwise(cuts)))
            continue
        for inner in itertools.combinations(range(1, quanta), parts - 1):
            cuts = (0, *inner, quanta)
            out.append(tuple((b - a) * TOKEN_QUANTUM for a, b in itertools.pairwise(cuts)))
    return out


def _groups(num_decode: int, decode_sizes: tuple[int, ...], prompt_sizes: tuple[int, ...]
            ) -> list[Group]:
    groups, lo = [], 0
    for size in decode_sizes:
        groups.append((lo, lo + size))
        lo += size
    lo = num_decode
    for size in prompt_sizes:
        groups.append((lo, lo + size))
        lo += size
    return groups


def _pieces(cfg: SearchConfig, batch: BatchInfo, groups: list[Group]) -> list[Piece]:
    mix = TokenMix(batch.dense_batch, batch.num_decode, batch.prompt_len)
    graph = layer_graph(cfg.spec, cfg.tp)
    pieces = []
    for o in graph.active_ops({g: "ar" for g in graph.groups()}):
        lo, hi = mix.domain(o.domain)
        ctx = op_context(o.name, batch.decode_context, batch.prompt_len)
        for gi, (a, b) in enumerate(groups):
            if lo <= a and b <= hi:
                pieces.append(Piece(o.name, o.resource, gi,
                                    cfg.profile.kernel_time_us(o.name, b - a, None, ctx),
                                    tuple(alloc_options(cfg.profile, o.resource, o.name, b - a,
                                                        batch.dense_batch, ctx))))
    return pieces


def _modes(pieces: list[Piece]) -> list[tuple[tuple[int, ...], tuple[AllocOption, ...]]]:
    """Every mode: (piece indices, their options)."""
    modes: list[tuple[tuple[int, ...], tuple[AllocOption, ...]]] = []
    for i, p in enumerate(pieces):
        modes.append(((i,), (p.full,)))
    compute = [i for i, p in enumerate(pieces) if p.resource == COMPUTE]
    others = [i for i, p in enumerate(pieces) if p.resource != COMPUTE]
    sets: list[tuple[int, ...]] = [(c, m) for c in compute for m in others]
    sets += [(c, *ms) for c in compute for ms in itertools.combinations(others, 2)]
    sets += list(itertools.combinations(others, 2))
    for idx in sets:
        if len({pieces[i].group for i in idx}) < len(idx):
            continue  # two pieces of one group: one chain
        for opts in itertools.product(*(pieces[i].options for i in idx)):
            if fits(opts):
                modes.append((idx, opts))
    return modes


def _mode_name(pieces: list[Piece], idx: tuple[int, ...], opts: tuple[AllocOption, ...]) -> str:
    return " | ".join(f"{pieces[i].op}[{pieces[i].group}] {o.mechanism}"
                      f"{' ' + o.point if o.point else ''} {o.units} P {o.p:.2f}"
                      for i, o in zip(idx, opts, strict=True))


def structure_ceiling(cfg: SearchConfig, batch: BatchInfo, decode_sizes: tuple[int, ...],
                      prompt_sizes: tuple[int, ...], sequential_us: float,
                      one_option: bool = False) -> StructureCeiling:
    """The LP of one structure (module docstring); `one_option`: each piece keeps one
    allocation in every mode it runs in, as a nano-op does (a MILP, solved by SCIP)."""
    from ortools.linear_solver import pywraplp

    groups = _groups(batch.num_decode, decode_sizes, prompt_sizes)
    pieces = _pieces(cfg, batch, groups)
    modes = _modes(pieces)
    lp = pywraplp.Solver.CreateSolver("SCIP" if one_option else "GLOP")
    tau = lp.NumVar(0, lp.infinity(), "tau")
    t = [lp.NumVar(0, lp.infinity(), f"m{k}") for k in range(len(modes))]
    if one_option:
        # every piece alone, one after another, is feasible: no mode of an optimum runs longer
        longest = sum(p.alone_us / p.full.p for p in pieces)
        pick = {(i, o): lp.BoolVar(f"y{i}_{j}") for i, p in enumerate(pieces)
                for j, o in enumerate(p.options)}
        for i, p in enumerate(pieces):
            lp.Add(lp.Sum([pick[(i, o)] for o in p.options]) == 1)
        for var, (idx, opts) in zip(t, modes, strict=True):
            for i, o in zip(idx, opts, strict=True):
                lp.Add(var <= longest * pick[(i, o)])
    work: list[list] = [[] for _ in pieces]
    busy: list[list] = [[] for _ in pieces]
    for var, (idx, opts) in zip(t, modes, strict=True):
        for i, o in zip(idx, opts, strict=True):
            work[i].append(var * o.p)
            busy[i].append(var)
    for i, p in enumerate(pieces):
        lp.Add(lp.Sum(work[i]) >= p.alone_us)
    lp.Add(lp.Sum(t) <= tau)
    for g in range(len(groups)):
        lp.Add(lp.Sum([v for i, p in enumerate(pieces) if p.group == g for v in busy[i]]) <= tau)
    lp.Minimize(tau)
    if one_option:
        lp.SetTimeLimit(int(MILP_SECONDS * 1000))
    status = lp.Solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise RuntimeError(f"the ceiling LP of groups {groups} did not solve")  # always
        # feasible (every piece alone), so only a MILP out of time before any answer lands here
    # a MILP stopped by its time limit: its proven lower bound on tau keeps the ceiling a bound
    period = tau.solution_value() if status == pywraplp.Solver.OPTIMAL else \
        lp.Objective().BestBound()
    used = sorted(((_mode_name(pieces, *modes[k]), var.solution_value())
                   for k, var in enumerate(t) if var.solution_value() > 1e-6),
                  key=lambda m: -m[1])
    return StructureCeiling(decode_sizes, prompt_sizes, period, sequential_us / period,
                            tuple(used))


def pipeline_ceiling(cfg: SearchConfig, batch: BatchInfo, max_groups: int = 2,
                     equal_only: bool = False, one_option: bool = False) -> Ceiling:
    """The ceiling of `batch` over the structures of up to `max_groups` decode groups and as
    many prompt groups (module docstring); `one_option`: each piece keeps one allocation."""
    q = TOKEN_QUANTUM
    seq = sum(sequential_op_times(cfg.spec, cfg.tp, cfg.profile, batch).values())
    decode = compositions(batch.num_decode // q, max_groups, equal_only)
    prompt = compositions((batch.dense_batch - batch.num_decode) // q, max_groups, equal_only)
    found = [structure_ceiling(cfg, batch, d, p, seq, one_option)
             for d, p in itertools.product(decode, prompt) if len(d) + len(p) >= 2]
    if not found:  # one group of 128 rows: nothing can run beside anything
        found = [StructureCeiling(decode[0], prompt[0], seq, 1.0, ())]
    return Ceiling(seq, max(found, key=lambda s: s.gain), tuple(found))
