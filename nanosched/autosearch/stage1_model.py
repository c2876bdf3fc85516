r"""Stage I's CP-SAT model: pipeline structure without interference (NanoFlow §4.1.2).

Given op counts n_A (nano-ops per op), choose ranges, streams, order and the period τ.
Time is in ticks of 1 us, tokens in quanta q of 128, B = Q q; t_A(w) is op A's profiled time
alone on the full GPU at w quanta (t_A(0) = 0).

Variables, per op A: cuts 0 = c_{A,0} < c_{A,1} < ... < c_{A,n_A} = Q; per nano-op x = (A, i):
work range [ws_x, we_x) = [c_{A,i}, c_{A,i+1}) ∩ D_A, w_x = max(0, we_x − ws_x);
presence p_x ⇔ (w_x ≥ 1 ∧ form of A chosen); duration d_x = t_A(w_x) (element constraint);
start s_x ≥ 0, end e_x = s_x + d_x; stream literal q_{x,σ} for σ ∈ streams(A), Σ_σ q_{x,σ} = p_x.
Per collective group g: exactly one form literal f_{g,φ}.

More in docs/search.md, module notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanosched.autosearch.opgraph import GraphOp, OpGraph, TokenMix
from nanosched.autosearch.stage1_bounds import (
    add_lanes,
    add_loads,
    add_token_cycles,
    period_lower_bound,
)
from nanosched.constants import TOKEN_QUANTUM
from nanosched.errors import ConfigError


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
    add_loads(m, prob, by_op, tau)
    add_lanes(m, prob, by_op, tau)
    add_token_cycles(m, prob, by_op, tau)
    if not relaxed:
        _break_translation(m, by_op)
    m.minimize(tau)
    return m, Stage1Vars(tau, forms, by_op)
