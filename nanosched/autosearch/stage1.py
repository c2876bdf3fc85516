r"""Stage I: pipeline structure without interference (NanoFlow §4.1.2), in CP-SAT.

Given op counts n_A (nano-ops per op), choose ranges, streams, order and the period τ.
Time is in ticks of 1 us, tokens in quanta q of 128, B = Q q; t_A(w) is op A's profiled time
alone on the full GPU at w quanta (t_A(0) = 0).

Variables, per op A: cuts 0 = c_{A,0} < c_{A,1} < ... < c_{A,n_A} = Q; per nano-op x = (A, i):
work range [ws_x, we_x) = [c_{A,i}, c_{A,i+1}) ∩ D_A, w_x = max(0, we_x − ws_x);
presence p_x ⇔ (w_x ≥ 1 ∧ form of A chosen); duration d_x = t_A(w_x) (element constraint);
start s_x ≥ 0, end e_x = s_x + d_x; stream literal q_{x,σ} for σ ∈ streams(A), Σ_σ q_{x,σ} = p_x.
Per collective group g: exactly one form literal f_{g,φ}.

Constraints
  no-overlap per stream σ:   intervals [s_x, e_x) with q_{x,σ} pairwise disjoint (one class
                             per stream, so same-class nano-ops never overlap)
  periodicity:               layer l runs at s_x + l τ; e_x ≤ 2 τ (a layer spans at most two
                             periods), so the no-overlap above is imposed on the union of two
                             unrolled layers {[s_x, e_x)} ∪ {[s_x + τ, e_x + τ)}: every pair of
                             layers that can meet in the steady state. Nano-op x is issued in
                             period ⌊s_x / τ⌋ after its layer's (its layer offset), at phase
                             s_x mod τ on its stream.
  dependencies (A → B, δ):   for x ∈ A, y ∈ B a literal a_{xy}: a_{xy} ⇒ s_y + δ τ ≥ e_x, and
                             a_{xy} ∨ ¬p_x ∨ ¬p_y ∨ ¬f_cond ∨ (we_x ≤ ws_y) ∨ (we_y ≤ ws_x)
                             (prompt edges: the range [ps(ws_y), ws_y) in place of [ws_y, we_y))
Redundant constraints (implied by the above; they give the LP and propagation a bound):
  op work:                   Σ_i d_{A,i} ≥ m_A, m_A the least total time of the op's present
                             nano-ops covering D_A (n_A pieces of ≥ 1 quantum when D_A is the
                             batch, 1 to n_A pieces otherwise; dynamic programme over t_A)
  stream loads:              τ ≥ Σ_x L_{x,σ} per stream σ, L_{x,σ} = d_x if q_{x,σ} else 0
                             (over two unrolled layers a stream is busy Σ L_{x,σ} per period)
  constant bound:            τ ≥ LB = max(M_C, M_M, M_N, ⌈(M_C + M_M + M_O) / 2⌉), M_c = Σ m_A
                             over ops of class c (`other` ops run on compute or memory; a
                             collective group adds its cheapest form): τ's initial domain
  lanes:                     the first (last) token lies in nano-op 0 (n_A − 1) of every op
                             whose domain holds it, so for an edge (A → B, δ) between such
                             nano-ops x, y: s_y + δ τ ≥ e_x without a literal; a collective
                             group G between A and B (A → G → B): s_y + δ τ ≥ e_x + Σ_G L_G,
                             L_G = d_G if p_G else 0 (one form is present)
  token cycles:              for every quantum j, the nano-ops holding j (one per op whose
                             domain holds j; of a collective group the present form's) lie on
                             the layer's cycle of data edges, so Σ_A D_{A,j} ≤ τ with
                             D_{A,j} ≥ d_{A,i} when c_{A,i} ≤ j < c_{A,i+1} (and A's form is
                             present). Proof: x_A(j) and x_B(j) share token j, so every data
                             edge (A → B, δ) between ops holding j is a dependency
                             s_B(j) + δ τ ≥ e_A(j); summing them around the cycle (total
                             shift 1; `token_cycle_ops` checks the cycle for every choice of
                             forms) gives Σ d ≤ τ, and D ≥ d only loosens it. The lane rows
                             are this for j = 0 and Q − 1 with precedences; the middle quanta
                             matter when ops are cut at different points (e.g. decode
                             attention cut at 384 tokens and o at 1024).
Relaxation R (solved first, its bound becomes τ's lower bound): the same cuts, durations,
forms, stream literals, e_x ≤ 2τ, op-work, stream-load, lane and token-cycle rows, without
the interval no-overlaps, the reified dependencies and the translation row. Every constraint
of R is a constraint of the model above (lane and token-cycle rows are implied by the
dependencies, as said above), so R's optimum, and any bound CP-SAT proves for it, is ≤ the
optimum of stage I.
Unlike the constant bound LB, R ties each op's nano-op durations to one set of cuts, so the
first and last token's lane cycles (Σ of their nano-ops' durations ≤ τ, one periodic edge)
and the loads are priced on the same split, so R's bound is at least LB and often above it.
R is small (no scheduling) and quick to solve.
Symmetry and search:
  translation:               some present nano-op starts at 0 (shifting all starts changes no
                             constraint but s ≥ 0)
  horizon:                   τ ≤ the period of a heuristic structure (even splits, all-reduce
                             forms, simple orders, `periodic.min_period`), which also hints
                             every cut, form, stream and start; s_x, e_x ≤ 2 τ_max
Objective: minimise τ.
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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from nanosched.autosearch.cpsat import Limits, Progress, gap, solve
from nanosched.autosearch.durations import TICKS_PER_US
from nanosched.autosearch.opgraph import GraphOp, OpGraph, TokenMix, expand
from nanosched.constants import TOKEN_QUANTUM
from nanosched.errors import ConfigError
from nanosched.models.ops import COMPUTE, MEMORY, NETWORK, OTHER
from nanosched.schedules.format import StageReport


@dataclass(frozen=True)
class Stage1Problem:
    graph: OpGraph
    mix: TokenMix
    tables: dict[str, list[int]]  # op -> ticks alone at 0, 1, ..., Q quanta
    counts: dict[str, int]  # op -> number of nano-ops
    max_period_ticks: int | None = None
    # op -> its cuts c_{A,1..n_A-1} in quanta, fixed (len = count - 1); other ops' cuts are free
    fixed_cuts: dict[str, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        q = self.mix.dense_batch // TOKEN_QUANTUM
        for op, cuts in (self.fixed_cuts or {}).items():
            n = self.counts.get(op, 0)
            if len(cuts) != n - 1 or list(cuts) != sorted(set(cuts)) \
                    or not all(0 < c < q for c in cuts):
                raise ConfigError(f"op {op!r}: fixed cuts {cuts} are not {n - 1} increasing "
                                  f"quanta inside (0, {q})")

    def cuts_of(self, op: str) -> tuple[int, ...] | None:
        """The fixed cuts of `op`, or None when the solver chooses them."""
        return (self.fixed_cuts or {}).get(op)


@dataclass(frozen=True)
class Structure:
    """Stage I's answer: ranges, forms, stream and issue order of every nano-op."""

    split: dict[str, list[tuple[int, int]]]
    forms: dict[str, str]
    streams: dict[str, str]  # nano-op id -> stream
    orders: dict[str, list[str]]  # stream -> nano-op ids in issue order (by phase)
    offsets: dict[str, int]  # nano-op id -> layer offset k = start // period
    starts: dict[str, int]  # ticks
    period: int  # ticks
    counts: dict[str, int]


@dataclass(frozen=True)
class NanoVars:
    """The solver variables of nano-op x = (op, index): work range [ws, we) in quanta (a cut
    or its clip to the op's domain), work w_x, presence p_x, duration d_x, start s_x, end e_x,
    the cut c_{A,i+1} ending its token range, and its stream literals q_{x,σ} (`on`, filled
    by `_add_streams`)."""

    op: GraphOp
    index: int
    ws: Any
    we: Any
    w: Any
    present: Any
    dur: Any
    start: Any
    end: Any
    cut_end: Any
    on: dict[str, Any] = field(default_factory=dict)  # stream -> q_{x,σ}

    @property
    def name(self) -> str:
        """The nano-op's part of its variables' names."""
        return f"{self.op.name}_{self.index}"


@dataclass(frozen=True)
class Stage1Vars:
    """The variables of a stage I model: τ, the form literals f_{g,φ} and every nano-op's."""

    tau: Any
    forms: dict[str, dict[str, Any]]  # group -> form -> literal
    by_op: dict[str, list[NanoVars]]  # op -> its nano-ops' variables, in index order


def make_structure(split: dict[str, list[tuple[int, int]]], forms: dict[str, str],
                   streams: dict[str, str], starts: dict[str, int], period: int,
                   counts: dict[str, int]) -> Structure:
    """Orders by phase (start mod period) and layer offsets follow from the starts."""
    orders: dict[str, list[str]] = {}
    for nid in sorted(starts, key=lambda i: (starts[i] % period, i)):
        orders.setdefault(streams[nid], []).append(nid)
    offsets = {nid: s // period for nid, s in starts.items()}
    return Structure(split, forms, streams, orders, offsets, starts, period, dict(counts))


def min_split_ticks(table: list[int], count: int, q: int | None = None) -> int:
    """Least total time of `count` nano-ops that together cover q quanta (default: all)."""
    q = len(table) - 1 if q is None else q
    best = [0] + [10**12] * q
    for _ in range(count):
        best = [min((best[j] + table[k - j] for j in range(k)), default=10**12)
                for k in range(q + 1)]
    return best[q]


def op_min_ticks(table: list[int], count: int, quanta: int, whole: bool) -> int:
    """Least Σ_i d_{A,i} of an op with `count` nano-ops over a domain of `quanta` quanta: the
    present nano-ops (all `count` of them when the domain is the whole batch, else 1 to
    count), each ≥ 1 quantum, cover the domain exactly."""
    if quanta <= 0:
        return 0
    if whole:
        return min_split_ticks(table, count, quanta)
    return min(min_split_ticks(table, k, quanta) for k in range(1, min(count, quanta) + 1))


def period_lower_bound(prob: Stage1Problem) -> int:
    """The constant bound LB of the docstring: stream loads of the cheapest splits."""
    load = _const_loads(prob)
    both = load[COMPUTE] + load[MEMORY] + load[OTHER]
    return max(1, load[COMPUTE], load[MEMORY], load[NETWORK], -(-both // 2))


def _const_loads(prob: Stage1Problem) -> dict[str, int]:
    """Per class (compute, memory, network; `other` ops may go on compute or memory): the least
    work that must run on it per period, Σ_A m_A; a collective group adds its cheapest form."""
    return class_loads(prob.graph, prob.mix, lambda op, quanta, whole: op_min_ticks(
        prob.tables[op], prob.counts[op], quanta, whole))


def class_loads(graph: OpGraph, mix: TokenMix, least: Callable[[str, int, bool], int]
                ) -> dict[str, int]:
    """Per class, Σ over ops of `least(op, quanta of its domain, whether that is the whole
    batch)`; of a collective group, its cheapest form's."""
    q, nd = mix.dense_batch // TOKEN_QUANTUM, mix.num_decode // TOKEN_QUANTUM
    size = {"all": q, "decode": nd, "prefill": q - nd}
    load = dict.fromkeys((COMPUTE, MEMORY, NETWORK, OTHER), 0)
    by_form: dict[str, dict[str, dict[str, int]]] = {}
    for o in graph.ops:
        lb = least(o.name, size[o.domain], o.domain == "all")
        if o.group is None:
            load[o.resource] += lb
        else:
            per = by_form.setdefault(o.group, {}).setdefault(o.form or "", {})
            per[o.resource] = per.get(o.resource, 0) + lb
    for forms in by_form.values():
        for cls in load:
            load[cls] += min(per.get(cls, 0) for per in forms.values())
    return load


def _add_cuts(m: Any, op: str, count: int, q: int, fixed: tuple[int, ...] | None = None
              ) -> list[Any]:
    if not 1 <= count <= q:
        raise ConfigError(f"op {op!r}: {count} nano-ops need at least "
                          f"{count * TOKEN_QUANTUM} tokens")
    if fixed is not None:
        return [m.new_constant(c) for c in (0, *fixed, q)]
    cuts = [m.new_constant(0)]
    for i in range(1, count):
        cuts.append(m.new_int_var(i, q - count + i, f"cut_{op}_{i}"))
    cuts.append(m.new_constant(q))
    for a, b in zip(cuts, cuts[1:], strict=False):
        m.add(b >= a + 1)
    return cuts


def _add_nano(m: Any, op: GraphOp, i: int, cuts: list[Any], dom: tuple[int, int],
              table: list[int], form_lit: Any, horizon: int) -> NanoVars:
    name, q = f"{op.name}_{i}", len(table) - 1
    ws, we = cuts[i], cuts[i + 1]
    w = m.new_int_var(0, q, f"w_{name}")
    if op.domain != "all":
        ws, we = m.new_int_var(0, q, f"ws_{name}"), m.new_int_var(0, q, f"we_{name}")
        m.add_max_equality(ws, [cuts[i], dom[0]])
        m.add_min_equality(we, [cuts[i + 1], dom[1]])
        m.add_max_equality(w, [we - ws, 0])
        p = m.new_bool_var(f"present_{name}")
        m.add(w >= 1).only_enforce_if(p)
        m.add(w == 0).only_enforce_if(~p)
    else:
        m.add(w == we - ws)
        p = form_lit if form_lit is not None else m.new_constant(1)
    d = m.new_int_var(0, max(table), f"dur_{name}")
    m.add_element(w, table, d)
    s = m.new_int_var(0, horizon, f"start_{name}")
    e = m.new_int_var(0, horizon, f"end_{name}")
    m.add(e == s + d)
    return NanoVars(op, i, ws, we, w, p, d, s, e, cuts[i + 1])


def _add_streams(m: Any, nanos: list[NanoVars], tau: Any, horizon: int,
                 intervals: bool = True) -> None:
    """Stream choice; no-overlap per stream over two unrolled layers (shift τ). Without
    `intervals` (the relaxation) only the stream literals and e_x ≤ 2τ."""
    by_stream: dict[str, list[Any]] = {}
    for x in nanos:
        name = x.name
        streams = x.op.streams
        lits = [x.present] if len(streams) == 1 else [m.new_bool_var(f"on_{sn}_{name}")
                                                     for sn in streams]
        if len(streams) > 1:
            m.add(sum(lits) == x.present)
        if not intervals:
            x.on.update(zip(streams, lits, strict=True))
            m.add(x.end <= 2 * tau)
            continue
        s1 = m.new_int_var(0, 2 * horizon, f"start1_{name}")
        e1 = m.new_int_var(0, 2 * horizon, f"end1_{name}")
        m.add(s1 == x.start + tau)
        m.add(e1 == x.end + tau)
        for sn, lit in zip(streams, lits, strict=True):
            x.on[sn] = lit
            by_stream.setdefault(sn, []).extend([
                m.new_optional_interval_var(x.start, x.dur, x.end, lit, f"iv_{sn}_{name}"),
                m.new_optional_interval_var(s1, x.dur, e1, lit, f"iv1_{sn}_{name}")])
        m.add(x.end <= 2 * tau)
    for intervals in by_stream.values():
        m.add_no_overlap(intervals)


def _add_deps(m: Any, prob: Stage1Problem, by_op: dict[str, list[NanoVars]],
              forms: dict[str, dict[str, Any]], tau: Any) -> None:
    nd, plen, b = prob.mix.num_decode, prob.mix.prompt_len, prob.mix.dense_batch
    for edge in prob.graph.edges:
        cond = [~forms[edge.cond[0]][edge.cond[1]]] if edge.cond else []
        for y in by_op[edge.dst]:
            lo, hi = y.ws, y.we
            if edge.kind == "prompt":
                lo, hi = _prompt_start(m, y, nd, plen, b), y.ws
            for x in by_op[edge.src]:
                tag = f"{x.name}_{y.name}_{edge.kind}"
                dep = m.new_bool_var(f"dep_{tag}")
                m.add(y.start + edge.shift * tau >= x.end).only_enforce_if(dep)
                before, after = m.new_bool_var(f"before_{tag}"), m.new_bool_var(f"after_{tag}")
                scale = TOKEN_QUANTUM if edge.kind == "prompt" else 1
                m.add(scale * x.we <= lo).only_enforce_if(before)
                m.add(x.ws >= hi).only_enforce_if(after)
                m.add_bool_or([dep, ~x.present, ~y.present, before, after, *cond])


def _add_loads(m: Any, prob: Stage1Problem, by_op: dict[str, list[NanoVars]],
               tau: Any) -> None:
    """Redundant load bounds: Σ_i d_{A,i} ≥ m_A per op; τ ≥ Σ_{x on σ} d_x per stream σ."""
    q, nd = prob.mix.dense_batch // TOKEN_QUANTUM, prob.mix.num_decode // TOKEN_QUANTUM
    size = {"all": q, "decode": nd, "prefill": q - nd}
    on: dict[str, list[Any]] = {}
    for o in prob.graph.ops:
        xs = by_op[o.name]
        m.add(sum(x.dur for x in xs) >= op_min_ticks(prob.tables[o.name], len(xs),
                                                       size[o.domain], o.domain == "all"))
        for x in xs:
            for sn, lit in x.on.items():
                if len(x.on) == 1 and o.group is None:
                    on.setdefault(sn, []).append(x.dur)  # d_x = 0 when absent (w_x = 0)
                    continue
                load = m.new_int_var(0, max(prob.tables[o.name]),
                                     f"load_{sn}_{x.name}")
                m.add(load == x.dur).only_enforce_if(lit)
                m.add(load == 0).only_enforce_if(~lit)
                on.setdefault(sn, []).append(load)
    for loads in on.values():
        m.add(tau >= sum(loads))


def _add_lanes(m: Any, prob: Stage1Problem, by_op: dict[str, list[NanoVars]],
               tau: Any) -> None:
    """Redundant lane precedences, without disjunction: the first (last) token of the batch lies
    in the first (last) nano-op of every op whose domain holds it, so those nano-ops depend on
    each other whatever the cuts. A collective group between two ops is bridged by the load
    L_g of its present form: s_B + δ τ ≥ e_A + Σ_{G: A → G → B} L_G."""
    q, nd = prob.mix.dense_batch // TOKEN_QUANTUM, prob.mix.num_decode // TOKEN_QUANTUM
    span = {"all": (0, q), "decode": (0, nd), "prefill": (nd, q)}
    ops = {o.name: o for o in prob.graph.ops}
    out: dict[str, list[Any]] = {}
    into: dict[str, list[Any]] = {}
    for e in prob.graph.edges:
        if e.kind == "data":
            out.setdefault(e.src, []).append(e)
            into.setdefault(e.dst, []).append(e)
    for token, pick in ((0, 0), (q - 1, -1)):
        def lane(name: str, token: int = token, pick: int = pick) -> NanoVars | None:
            lo, hi = span[ops[name].domain]
            return by_op[name][pick] if lo <= token < hi else None

        for e in prob.graph.edges:
            x, y = lane(e.src), lane(e.dst)
            if e.kind != "data" or x is None or y is None:
                continue
            if ops[e.src].group is None and ops[e.dst].group is None and e.cond is None:
                m.add(y.start + e.shift * tau >= x.end)
        bridges: dict[tuple[str, str, int], list[Any]] = {}
        for name, g in ops.items():
            if g.group is None or lane(name) is None:
                continue
            for a in into.get(name, []):
                for b in out.get(name, []):
                    if ops[a.src].group is None and ops[b.dst].group is None:
                        key = (a.src, b.dst, a.shift + b.shift)
                        bridges.setdefault(key, []).append((g, lane(name)))
        for (a, b, shift), via in bridges.items():
            x, y = lane(a), lane(b)
            if x is None or y is None or len({g.group for g, _ in via}) != 1 \
                    or len({g.form for g, _ in via}) != len(via):
                continue
            loads = []
            for _, z in via:
                load = m.new_int_var(0, 10**9, f"bridge_{z.name}_{token}")
                m.add(load == z.dur).only_enforce_if(z.present)
                m.add(load == 0).only_enforce_if(~z.present)
                loads.append(load)
            m.add(y.start + shift * tau >= x.end + sum(loads))


def token_cycle_ops(prob: Stage1Problem, j: int) -> list[str] | None:
    """The ops whose domain holds quantum j, when for every choice of collective forms those
    of them that are active form one cycle of data edges with total shift 1; else None."""
    import itertools

    q, nd = prob.mix.dense_batch // TOKEN_QUANTUM, prob.mix.num_decode // TOKEN_QUANTUM
    span = {"all": (0, q), "decode": (0, nd), "prefill": (nd, q)}
    holds = {o.name for o in prob.graph.ops
             if span[o.domain][0] <= j < span[o.domain][1]}
    groups = prob.graph.groups()
    for pick in itertools.product(*groups.values()):
        forms = dict(zip(groups, pick, strict=True))
        names = {o.name for o in prob.graph.active_ops(forms)} & holds
        edges = [e for e in prob.graph.active_edges(forms)
                 if e.kind == "data" and e.src in names and e.dst in names]
        succ: dict[str, list[Any]] = {}
        for e in edges:
            succ.setdefault(e.src, []).append(e)
        if not names or any(len(succ.get(n, [])) != 1 for n in names) \
                or len({e.dst for e in edges}) != len(names):
            return None
        start = next(iter(sorted(names)))
        node, seen, shift = start, set(), 0
        while node not in seen:
            seen.add(node)
            shift += succ[node][0].shift
            node = succ[node][0].dst
        if node != start or seen != names or shift != 1:
            return None
    return sorted(holds)


def _add_token_cycles(m: Any, prob: Stage1Problem, by_op: dict[str, list[NanoVars]],
                      tau: Any) -> None:
    """Redundant token cycles: for every quantum j, the nano-ops holding j (one per op whose
    domain holds j; of a collective group only the present form's) depend on each other
    along the layer's cycle of data edges (shift 1), so Σ_A d_{A(j)} ≤ τ. D_{A,j} ≥ d_{A,i}
    when c_{A,i} ≤ j < c_{A,i+1} (and the form of A is present), D_{A,j} ≥ 0 otherwise."""
    q = prob.mix.dense_batch // TOKEN_QUANTUM
    ge: dict[tuple[str, int, int], Any] = {}

    def at_least(op: str, i: int, j: int) -> Any:  # literal c_{op,i} ≤ j
        if (op, i, j) not in ge:
            cut = by_op[op][i - 1].cut_end
            lit = m.new_bool_var(f"cut_le_{op}_{i}_{j}")
            m.add(cut <= j).only_enforce_if(lit)
            m.add(cut >= j + 1).only_enforce_if(~lit)
            ge[(op, i, j)] = lit
        return ge[(op, i, j)]

    for j in range(q):
        names = token_cycle_ops(prob, j)
        if names is None:
            continue
        terms = []
        for op in names:
            xs = by_op[op]
            dur = m.new_int_var(0, max(prob.tables[op]), f"tok_{op}_{j}")
            for i, x in enumerate(xs):
                when = [] if x.op.group is None else [x.present]
                if i > 0:
                    when.append(at_least(op, i, j))
                if i < len(xs) - 1:
                    when.append(~at_least(op, i + 1, j))
                m.add(dur >= x.dur).only_enforce_if(when)
            terms.append(dur)
        m.add(sum(terms) <= tau)


def _break_translation(m: Any, by_op: dict[str, list[NanoVars]]) -> None:
    """Some present nano-op starts at 0 (shifting every start by the same amount changes
    nothing: dependencies and overlaps are differences, and e_x ≤ 2τ only gets easier)."""
    zero = []
    for xs in by_op.values():
        for x in xs:
            z = m.new_bool_var(f"first_{x.name}")
            m.add(x.start == 0).only_enforce_if(z)
            m.add_implication(z, x.present)
            zero.append(z)
    m.add_bool_or(zero)


def _prompt_start(m: Any, y: NanoVars, nd: int, plen: int, b: int) -> Any:
    """ps(ws_y) in tokens: the first token of the prompt that work range y starts in."""
    if plen >= b - nd:
        return nd
    name = y.name
    num = m.new_int_var(0, b, f"psnum_{name}")
    m.add(num == TOKEN_QUANTUM * y.ws - nd)
    k = m.new_int_var(0, b // plen + 1, f"prompt_{name}")
    m.add_division_equality(k, num, plen)
    return nd + plen * k


def build_cp_model(prob: Stage1Problem, upper: int | None = None, relaxed: bool = False,
                lower: int | None = None) -> tuple[Any, Stage1Vars]:
    """The CP-SAT model of stage I for fixed op counts; `upper`: a known feasible period;
    `relaxed`: the lane-and-load relaxation R (no intervals, no reified dependencies);
    `lower`: a proven lower bound of τ (R's optimum)."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    q = prob.mix.dense_batch // TOKEN_QUANTUM
    nd = prob.mix.num_decode // TOKEN_QUANTUM
    top = sum(prob.counts[o.name] * max(prob.tables[o.name]) for o in prob.graph.ops)
    for cap in (prob.max_period_ticks, upper):
        top = min(top, cap) if cap else top
    lower = max(period_lower_bound(prob), lower or 0)
    tau = m.new_int_var(min(lower, top), top, "tau")
    horizon = 2 * top
    forms = {g: {f: m.new_bool_var(f"form_{g}_{f}") for f in fs}
             for g, fs in prob.graph.groups().items()}
    for lits in forms.values():
        m.add_exactly_one(lits.values())
    by_op: dict[str, list[NanoVars]] = {}
    for op in prob.graph.ops:
        cuts = _add_cuts(m, op.name, prob.counts[op.name], q, prob.cuts_of(op.name))
        dom = {"all": (0, q), "decode": (0, nd), "prefill": (nd, q)}[op.domain]
        lit = forms[op.group][op.form or ""] if op.group else None
        by_op[op.name] = [_add_nano(m, op, i, cuts, dom, prob.tables[op.name], lit, horizon)
                          for i in range(prob.counts[op.name])]
    nanos = [x for xs in by_op.values() for x in xs]
    _add_streams(m, nanos, tau, horizon, intervals=not relaxed)
    if not relaxed:
        _add_deps(m, prob, by_op, forms, tau)
    _add_loads(m, prob, by_op, tau)
    _add_lanes(m, prob, by_op, tau)
    _add_token_cycles(m, prob, by_op, tau)
    if not relaxed:
        _break_translation(m, by_op)
    m.minimize(tau)
    return m, Stage1Vars(tau, forms, by_op)


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


RELAX_SHARE = 0.1  # of a stage I solve's time for the relaxation R
PHASE1_SHARE = 0.5  # at most, of a stage I solve's time, for the hinted solve
STALL_S = 3.0  # the hinted solve stops when its incumbent has not improved for this long
TARGET_GAP = 0.05  # the proof solve tries to lift the bound to (1 - TARGET_GAP) τ_inc
PROOF_SUBSOLVERS = ("no_lp", "max_lp")


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
