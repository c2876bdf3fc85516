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
Relaxation R (solved first, its bound becomes τ's lower bound): the same cuts, durations,
forms, stream literals, e_x ≤ 2τ, op-work, stream-load and lane rows, without the interval
no-overlaps, the reified dependencies and the translation row. Every constraint of R is a
constraint of the model above (lane rows are implied by the dependencies, as the docstring
says), so R's optimum, and any bound CP-SAT proves for it, is ≤ the optimum of stage I.
Unlike the constant bound LB, R ties each op's nano-op durations to one set of cuts, so the
first and last token's lane cycles (Σ of their nano-ops' durations ≤ τ, one periodic edge)
and the loads are priced on the same split (shipped llama3-70b tp=8 H200 quick: LB 681 us,
R 700 us). R is small (no scheduling) and solves in about a second.
Symmetry and search:
  translation:               some present nano-op starts at 0 (shifting all starts changes no
                             constraint but s ≥ 0)
  horizon:                   τ ≤ the period of a heuristic structure (even splits, all-reduce
                             forms, simple orders, `periodic.min_period`), which also hints
                             every cut, form, stream and start; s_x, e_x ≤ 2 τ_max
Objective: minimise τ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from nanosched.autosearch.cpsat import Limits, Progress, solve
from nanosched.autosearch.opgraph import QUANTUM, GraphOp, OpGraph, TokenMix, expand
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
    q, nd = prob.mix.dense_batch // QUANTUM, prob.mix.num_decode // QUANTUM
    size = {"all": q, "decode": nd, "prefill": q - nd}
    load = dict.fromkeys((COMPUTE, MEMORY, NETWORK, OTHER), 0)
    by_form: dict[str, dict[str, dict[str, int]]] = {}
    for o in prob.graph.ops:
        lb = op_min_ticks(prob.tables[o.name], prob.counts[o.name], size[o.domain],
                          o.domain == "all")
        if o.group is None:
            load[o.resource] += lb
        else:
            per = by_form.setdefault(o.group, {}).setdefault(o.form or "", {})
            per[o.resource] = per.get(o.resource, 0) + lb
    for forms in by_form.values():
        for cls in load:
            load[cls] += min(per.get(cls, 0) for per in forms.values())
    return load


def _add_cuts(m: Any, op: str, count: int, q: int) -> list[Any]:
    if not 1 <= count <= q:
        raise ConfigError(f"op {op!r}: {count} nano-ops need at least {count * QUANTUM} tokens")
    cuts = [m.new_constant(0)]
    for i in range(1, count):
        cuts.append(m.new_int_var(i, q - count + i, f"cut_{op}_{i}"))
    cuts.append(m.new_constant(q))
    for a, b in zip(cuts, cuts[1:], strict=False):
        m.add(b >= a + 1)
    return cuts


def _add_nano(m: Any, op: GraphOp, i: int, cuts: list[Any], dom: tuple[int, int],
              table: list[int], form_lit: Any, horizon: int) -> dict[str, Any]:
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
    return {"id": (op.name, i), "op": op, "ws": ws, "we": we, "w": w, "p": p, "d": d, "s": s,
            "e": e, "q": {}, "cut_end": cuts[i + 1]}


def _add_streams(m: Any, nanos: list[dict[str, Any]], tau: Any, horizon: int,
                 intervals: bool = True) -> None:
    """Stream choice; no-overlap per stream over two unrolled layers (shift τ). Without
    `intervals` (the relaxation) only the stream literals and e_x ≤ 2τ."""
    by_stream: dict[str, list[Any]] = {}
    for x in nanos:
        name = f"{x['op'].name}_{x['id'][1]}"
        streams = x["op"].streams
        lits = [x["p"]] if len(streams) == 1 else [m.new_bool_var(f"on_{sn}_{name}")
                                                     for sn in streams]
        if len(streams) > 1:
            m.add(sum(lits) == x["p"])
        if not intervals:
            x["q"] = dict(zip(streams, lits, strict=True))
            m.add(x["e"] <= 2 * tau)
            continue
        s1 = m.new_int_var(0, 2 * horizon, f"start1_{name}")
        e1 = m.new_int_var(0, 2 * horizon, f"end1_{name}")
        m.add(s1 == x["s"] + tau)
        m.add(e1 == x["e"] + tau)
        for sn, lit in zip(streams, lits, strict=True):
            x["q"][sn] = lit
            by_stream.setdefault(sn, []).extend([
                m.new_optional_interval_var(x["s"], x["d"], x["e"], lit, f"iv_{sn}_{name}"),
                m.new_optional_interval_var(s1, x["d"], e1, lit, f"iv1_{sn}_{name}")])
        m.add(x["e"] <= 2 * tau)
    for intervals in by_stream.values():
        m.add_no_overlap(intervals)


def _add_deps(m: Any, prob: Stage1Problem, by_op: dict[str, list[dict[str, Any]]],
              forms: dict[str, dict[str, Any]], tau: Any) -> None:
    nd, plen, b = prob.mix.num_decode, prob.mix.prompt_len, prob.mix.dense_batch
    for edge in prob.graph.edges:
        cond = [~forms[edge.cond[0]][edge.cond[1]]] if edge.cond else []
        for y in by_op[edge.dst]:
            lo, hi = y["ws"], y["we"]
            if edge.kind == "prompt":
                lo, hi = _prompt_start(m, y, nd, plen, b), y["ws"]
            for x in by_op[edge.src]:
                tag = f"{x['op'].name}_{x['id'][1]}_{y['op'].name}_{y['id'][1]}_{edge.kind}"
                dep = m.new_bool_var(f"dep_{tag}")
                m.add(y["s"] + edge.shift * tau >= x["e"]).only_enforce_if(dep)
                before, after = m.new_bool_var(f"before_{tag}"), m.new_bool_var(f"after_{tag}")
                scale = QUANTUM if edge.kind == "prompt" else 1
                m.add(scale * x["we"] <= lo).only_enforce_if(before)
                m.add(x["ws"] >= hi).only_enforce_if(after)
                m.add_bool_or([dep, ~x["p"], ~y["p"], before, after, *cond])


def _add_loads(m: Any, prob: Stage1Problem, by_op: dict[str, list[dict[str, Any]]],
               tau: Any) -> None:
    """Redundant load bounds: Σ_i d_{A,i} ≥ m_A per op; τ ≥ Σ_{x on σ} d_x per stream σ."""
    q, nd = prob.mix.dense_batch // QUANTUM, prob.mix.num_decode // QUANTUM
    size = {"all": q, "decode": nd, "prefill": q - nd}
    on: dict[str, list[Any]] = {}
    for o in prob.graph.ops:
        xs = by_op[o.name]
        m.add(sum(x["d"] for x in xs) >= op_min_ticks(prob.tables[o.name], len(xs),
                                                       size[o.domain], o.domain == "all"))
        for x in xs:
            for sn, lit in x["q"].items():
                if len(x["q"]) == 1 and o.group is None:
                    on.setdefault(sn, []).append(x["d"])  # d_x = 0 when absent (w_x = 0)
                    continue
                load = m.new_int_var(0, max(prob.tables[o.name]),
                                     f"load_{sn}_{o.name}_{x['id'][1]}")
                m.add(load == x["d"]).only_enforce_if(lit)
                m.add(load == 0).only_enforce_if(~lit)
                on.setdefault(sn, []).append(load)
    for loads in on.values():
        m.add(tau >= sum(loads))


def _add_lanes(m: Any, prob: Stage1Problem, by_op: dict[str, list[dict[str, Any]]],
               tau: Any) -> None:
    """Redundant lane precedences, without disjunction: the first (last) token of the batch lies
    in the first (last) nano-op of every op whose domain holds it, so those nano-ops depend on
    each other whatever the cuts. A collective group between two ops is bridged by the load
    L_g of its present form: s_B + δ τ ≥ e_A + Σ_{G: A → G → B} L_G."""
    q, nd = prob.mix.dense_batch // QUANTUM, prob.mix.num_decode // QUANTUM
    span = {"all": (0, q), "decode": (0, nd), "prefill": (nd, q)}
    ops = {o.name: o for o in prob.graph.ops}
    out: dict[str, list[Any]] = {}
    into: dict[str, list[Any]] = {}
    for e in prob.graph.edges:
        if e.kind == "data":
            out.setdefault(e.src, []).append(e)
            into.setdefault(e.dst, []).append(e)
    for token, pick in ((0, 0), (q - 1, -1)):
        def lane(name: str, token: int = token, pick: int = pick) -> dict[str, Any] | None:
            lo, hi = span[ops[name].domain]
            return by_op[name][pick] if lo <= token < hi else None

        for e in prob.graph.edges:
            x, y = lane(e.src), lane(e.dst)
            if e.kind != "data" or x is None or y is None:
                continue
            if ops[e.src].group is None and ops[e.dst].group is None and e.cond is None:
                m.add(y["s"] + e.shift * tau >= x["e"])
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
                load = m.new_int_var(0, 10**9, f"bridge_{z['op'].name}_{z['id'][1]}_{token}")
                m.add(load == z["d"]).only_enforce_if(z["p"])
                m.add(load == 0).only_enforce_if(~z["p"])
                loads.append(load)
            m.add(y["s"] + shift * tau >= x["e"] + sum(loads))


def _break_translation(m: Any, by_op: dict[str, list[dict[str, Any]]]) -> None:
    """Some present nano-op starts at 0 (shifting every start by the same amount changes
    nothing: dependencies and overlaps are differences, and e_x ≤ 2τ only gets easier)."""
    zero = []
    for xs in by_op.values():
        for x in xs:
            z = m.new_bool_var(f"first_{x['op'].name}_{x['id'][1]}")
            m.add(x["s"] == 0).only_enforce_if(z)
            m.add_implication(z, x["p"])
            zero.append(z)
    m.add_bool_or(zero)


def _prompt_start(m: Any, y: dict[str, Any], nd: int, plen: int, b: int) -> Any:
    """ps(ws_y) in tokens: the first token of the prompt that work range y starts in."""
    if plen >= b - nd:
        return nd
    name = f"{y['op'].name}_{y['id'][1]}"
    num = m.new_int_var(0, b, f"psnum_{name}")
    m.add(num == QUANTUM * y["ws"] - nd)
    k = m.new_int_var(0, b // plen + 1, f"prompt_{name}")
    m.add_division_equality(k, num, plen)
    return nd + plen * k


def build_model(prob: Stage1Problem, upper: int | None = None, relaxed: bool = False,
                lower: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The CP-SAT model of stage I for fixed op counts; `upper`: a known feasible period;
    `relaxed`: the lane-and-load relaxation R (no intervals, no reified dependencies);
    `lower`: a proven lower bound of τ (R's optimum)."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    q = prob.mix.dense_batch // QUANTUM
    nd = prob.mix.num_decode // QUANTUM
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
    by_op: dict[str, list[dict[str, Any]]] = {}
    for op in prob.graph.ops:
        cuts = _add_cuts(m, op.name, prob.counts[op.name], q)
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
    if not relaxed:
        _break_translation(m, by_op)
    m.minimize(tau)
    return m, {"tau": tau, "forms": forms, "by_op": by_op}


def solve_stage1(prob: Stage1Problem, limits: Limits, progress: Progress | None = None
                 ) -> tuple[Structure | None, StageReport]:
    """Solve stage I for fixed counts; (None, report) when no solution was found."""
    hint = heuristic_structure(prob)
    if hint is not None and prob.max_period_ticks and hint.period > prob.max_period_ticks:
        hint = None
    upper = hint.period if hint is not None else None
    lower = relaxation_bound(prob, upper, replace(limits, time_limit_s=RELAX_SHARE
                                                  * limits.time_limit_s))
    if lower is None:  # R infeasible: so is the whole problem (R is a relaxation)
        lower = (upper or 0) + 1
    m, v = build_model(prob, upper, lower=lower)
    if hint is not None:
        add_hint(prob, m, v, hint)
    solver, report, found = solve(m, "stage I", limits, progress)
    if not found:
        return None, report
    return extract(prob, solver, v), report


RELAX_SHARE = 0.1  # of a stage I solve's time for the relaxation R


def relaxation_bound(prob: Stage1Problem, upper: int | None, limits: Limits) -> int | None:
    """R's best bound (its optimum when solved): a lower bound of stage I's τ; None when R is
    infeasible (then so is stage I)."""
    m, v = build_model(prob, upper, relaxed=True)
    solver, report, found = solve(m, "stage I relaxation", limits, None)
    if report.status == "INFEASIBLE":
        return None
    if not found:
        return period_lower_bound(prob)
    return math.ceil(solver.best_objective_bound - 1e-6)


def extract(prob: Stage1Problem, solver: Any, v: dict[str, Any]) -> Structure:
    forms = {g: next(f for f, lit in lits.items() if solver.boolean_value(lit))
             for g, lits in v["forms"].items()}
    split, placed = {}, {}
    for op, xs in v["by_op"].items():
        cuts = [0] + [QUANTUM * solver.value(x["cut_end"]) for x in xs]
        split[op] = list(zip(cuts[:-1], cuts[1:], strict=True))
        for x in xs:
            if solver.boolean_value(x["p"]):
                stream = next(sn for sn, lit in x["q"].items() if solver.boolean_value(lit))
                placed[(op, QUANTUM * solver.value(x["ws"]))] = (stream, solver.value(x["s"]))
    nanos = expand(prob.graph, split, prob.mix, forms)
    streams, starts = {}, {}
    for n in nanos:
        streams[n.id], starts[n.id] = placed[(n.op, n.work_start)]
    return make_structure(split, forms, streams, starts, solver.value(v["tau"]), prob.counts)


def heuristic_structure(prob: Stage1Problem) -> Structure | None:
    """Even splits, all-reduce forms, the best of a few simple orders: a hint and a fallback."""
    from nanosched.autosearch.opgraph import even_split, nano_deps
    from nanosched.autosearch.periodic import min_period

    forms = {g: fs[0] for g, fs in prob.graph.groups().items()}
    split = {o.name: even_split(prob.mix.dense_batch, prob.counts[o.name])
             for o in prob.graph.ops}
    nanos = expand(prob.graph, split, prob.mix, forms)
    pos = {o.name: i for i, o in enumerate(prob.graph.ops)}
    durations = {n.id: prob.tables[n.op][n.work_tokens // QUANTUM] for n in nanos}
    deps = [(x, y, shift) for y, ds in nano_deps(prob.graph, nanos, prob.mix, forms).items()
            for x, shift, _ in ds]
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


def add_hint(prob: Stage1Problem, m: Any, v: dict[str, Any], hint: Structure) -> None:
    """Hint the solver with a known structure (cuts, forms, streams, starts, period)."""
    m.add_hint(v["tau"], hint.period)
    for g, lits in v["forms"].items():
        for f, lit in lits.items():
            m.add_hint(lit, hint.forms[g] == f)
    nanos = {(n.op, n.start): n for n in expand(prob.graph, hint.split, prob.mix, hint.forms)}
    first = min(hint.starts.values())
    for op, xs in v["by_op"].items():
        for x, (s, e) in zip(xs, hint.split[op], strict=True):
            if not isinstance(x["cut_end"], int) and e < prob.mix.dense_batch:
                m.add_hint(x["cut_end"], e // QUANTUM)
            n = nanos.get((op, s))
            if n is None:
                continue
            m.add_hint(x["s"], hint.starts[n.id] - first)
            for sn, lit in x["q"].items():
                if len(x["q"]) > 1:
                    m.add_hint(lit, hint.streams[n.id] == sn)
