r"""Stage I's lower bounds and redundant constraints (see `stage1_model` for the model).

Least split times of an op (`op_min_ticks`) and their sums per class (`class_loads`) give the
period's constant bound (`period_lower_bound`); op work, stream loads, lanes and token cycles
are rows implied by the model that give its LP relaxation and propagation a bound, so CP-SAT
proves optimality (or a small gap) instead of only finding incumbents.

More in docs/search.md, module notes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nanosched.autosearch.opgraph import OpGraph, TokenMix
from nanosched.constants import TOKEN_QUANTUM
from nanosched.models.ops import COMPUTE, MEMORY, NETWORK, OTHER

if TYPE_CHECKING:
    from nanosched.autosearch.stage1_model import NanoVars, Stage1Problem


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


def add_loads(m: Any, prob: Stage1Problem, by_op: dict[str, list[NanoVars]],
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


def add_lanes(m: Any, prob: Stage1Problem, by_op: dict[str, list[NanoVars]],
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


def add_token_cycles(m: Any, prob: Stage1Problem, by_op: dict[str, list[NanoVars]],
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
