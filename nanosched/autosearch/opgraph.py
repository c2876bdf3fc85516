r"""The nano-op graph of one decoder layer (DESIGN.md, "The op graph"); pure Python.

Ops. Each op A has a resource class, a token domain D_A and candidate streams. The dense batch
holds B tokens, decode tokens first: D = [0, n_d) for `attn_decode`, [n_d, B) for
`attn_prefill`, [0, B) for every other op. With tp > 1 each all-reduce has an alternative form,
reduce-scatter + all-gather (group `attn` or `ffn`, form `ar` or `rs_ag`); exactly one form of
each group is present.

Nano-ops. A split gives op A ranges r_A^i = [a_i, a_{i+1}), 0 = a_0 < ... < a_n = B, multiples
of 128. Nano-op i works on w_A^i = r_A^i ∩ D_A; one with an empty work range does not exist.

More in docs/search.md, module notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from nanosched.autosearch.periodic import Precedence
from nanosched.constants import TOKEN_QUANTUM
from nanosched.errors import ConfigError
from nanosched.models import ops as optable
from nanosched.models.ops import (
    COLLECTIVE_FORMS,
    COMPUTE,
    MEMORY,
    NETWORK,
    OTHER,
    OpSpec,
    layer_ops,
)
from nanosched.models.spec import ModelSpec

STREAMS = (COMPUTE, MEMORY, NETWORK)
GROUPS = {op.name: op.collective for op in optable.OPS if op.collective}  # all-reduce: group


@dataclass(frozen=True)
class GraphOp:
    name: str
    resource: str
    domain: str = "all"  # "all" | "decode" | "prefill"
    group: str | None = None  # collective group with alternative forms
    form: str | None = None  # "ar" | "rs_ag"

    @property
    def streams(self) -> tuple[str, ...]:
        """Streams the op may run on: its class's, or compute/memory for `other` ops."""
        return (COMPUTE, MEMORY) if self.resource == OTHER else (self.resource,)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    shift: int = 0  # 1: src in layer l, dst in layer l + 1
    kind: str = "data"  # "data" | "prompt"
    cond: tuple[str, str] | None = None  # (group, form) that must be chosen


@dataclass(frozen=True)
class OpGraph:
    ops: tuple[GraphOp, ...]
    edges: tuple[Edge, ...]

    def op(self, name: str) -> GraphOp:
        for o in self.ops:
            if o.name == name:
                return o
        raise ConfigError(f"op {name!r} is not in the layer; ops: {[o.name for o in self.ops]}")

    def groups(self) -> dict[str, tuple[str, ...]]:
        """Collective group -> its forms."""
        out: dict[str, list[str]] = {}
        for o in self.ops:
            if o.group and o.form not in out.setdefault(o.group, []):
                out[o.group].append(o.form or "")
        return {g: tuple(f) for g, f in out.items()}

    def with_forms(self, allowed: tuple[str, ...]) -> OpGraph:
        """This graph with only the `allowed` forms of each collective (its other forms' ops
        and the edges through them or conditioned on them dropped)."""
        ops = tuple(o for o in self.ops if o.group is None or o.form in allowed)
        names = {o.name for o in ops}
        return OpGraph(ops, tuple(e for e in self.edges if e.src in names and e.dst in names
                                  and (e.cond is None or e.cond[1] in allowed)))

    def active_ops(self, forms: dict[str, str]) -> list[GraphOp]:
        return [o for o in self.ops if o.group is None or forms.get(o.group) == o.form]

    def active_edges(self, forms: dict[str, str]) -> list[Edge]:
        names = {o.name for o in self.active_ops(forms)}
        return [e for e in self.edges if e.src in names and e.dst in names
                and (e.cond is None or forms.get(e.cond[0]) == e.cond[1])]


@dataclass(frozen=True)
class TokenMix:
    """Where decode tokens end and how long prompts are, for domains and prompt edges."""

    dense_batch: int
    num_decode: int
    prompt_len: int  # tokens per prompt in the prefill part

    def domain(self, kind: str) -> tuple[int, int]:
        return {"all": (0, self.dense_batch), "decode": (0, self.num_decode),
                "prefill": (self.num_decode, self.dense_batch)}[kind]

    def prompt_start(self, u: int) -> int:
        return self.num_decode + (u - self.num_decode) // self.prompt_len * self.prompt_len


def _collectives(spec: ModelSpec) -> list[tuple[OpSpec, str, OpSpec, str, int]]:
    """Each all-reduce of the table as (it, the op it reduces, the norm after it, the op that
    norm feeds, that edge's layer shift), for `spec`'s layers."""
    held = [op for op in optable.OPS if op.holds(spec)]
    names = {op.name for op in held}
    out = []
    for c in held:
        if c.collective is None:
            continue
        src = next(n for n, _ in c.inputs if n in names)
        norm = next(op for op in held if op is not c and (src, 0) in op.inputs)
        nxt, shift = next((op.name, s) for op in held for n, s in op.inputs if n == norm.name)
        out.append((c, src, norm, nxt, shift))
    return out


def layer_graph(spec: ModelSpec, tp: int) -> OpGraph:
    """The op graph of one layer, from the op table's inputs; with tp > 1 both forms of each
    collective are present between the GEMM it reduces and the norm after it."""
    colls = _collectives(spec)
    group_of = {c.name: c.collective for c, *_ in colls}
    gather_after = {norm.name: c.name for c, _, norm, _, _ in colls}
    ops: list[GraphOp] = []
    for od in layer_ops(spec, tp):
        domain = optable.BY_NAME[od.name].domain
        if od.name in group_of:
            rs = COLLECTIVE_FORMS[od.name][0]
            ops.append(GraphOp(od.name, od.resource, domain, group_of[od.name], "ar"))
            ops.append(GraphOp(rs.name, rs.resource, "all", group_of[od.name], "rs_ag"))
        else:
            ops.append(GraphOp(od.name, od.resource, domain))
        if od.name in gather_after and tp > 1:
            ar = gather_after[od.name]
            ag = COLLECTIVE_FORMS[ar][1]
            ops.append(GraphOp(ag.name, ag.resource, "all", group_of[ar], "rs_ag"))
    names = {op.name for op in optable.OPS if op.holds(spec)}
    boundary = set(gather_after)
    edges = []
    for op in optable.OPS:
        if op.name not in names or op.collective or op.name in boundary:
            continue
        for src, shift in op.inputs:
            if src in names and src not in boundary:
                edges.append(Edge(src, op.name, shift))
                if op.domain == "prefill":  # the earlier part of the same prompt
                    edges.append(Edge(src, op.name, shift, "prompt"))
    for c, src, norm, nxt, shift in colls:
        if tp == 1:
            edges += [Edge(src, norm.name), Edge(norm.name, nxt, shift)]
            continue
        ar, group = c.name, c.collective
        rs, ag = (f.name for f in COLLECTIVE_FORMS[ar])
        edges += [Edge(src, ar), Edge(src, rs), Edge(ar, norm.name), Edge(rs, norm.name),
                  Edge(norm.name, ag), Edge(ag, nxt, shift),
                  Edge(norm.name, nxt, shift, cond=(group, "ar"))]
    return OpGraph(tuple(ops), tuple(edges))


@dataclass(frozen=True)
class NanoOpDef:
    """Nano-op `index` of `op`: token range [start, end), work range [work_start, work_end)."""

    op: str
    index: int
    resource: str
    start: int
    end: int
    work_start: int
    work_end: int

    @property
    def id(self) -> str:
        return f"{self.op}.{self.index}"

    @property
    def work_tokens(self) -> int:
        return self.work_end - self.work_start


class NanoDep(NamedTuple):
    """A dependency of a nano-op: on nano-op `src` of the layer `shift` before, of `kind`
    "data" or "prompt" (the edge it comes from)."""

    src: str
    shift: int
    kind: str


def check_split(split: dict[str, list[tuple[int, int]]], ops: list[GraphOp],
                dense_batch: int) -> None:
    """Every op's ranges are consecutive multiples of 128 covering [0, B)."""
    for o in ops:
        ranges = split.get(o.name)
        if not ranges:
            raise ConfigError(f"split: op {o.name!r} has no ranges")
        pos = 0
        for s, e in ranges:
            if s != pos or e <= s or s % TOKEN_QUANTUM or e % TOKEN_QUANTUM:
                raise ConfigError(f"split: op {o.name!r} ranges {ranges} must be consecutive "
                                  f"multiples of {TOKEN_QUANTUM} covering [0, {dense_batch})")
            pos = e
        if pos != dense_batch:
            raise ConfigError(f"split: op {o.name!r} ranges end at {pos}, not {dense_batch}")


def expand(graph: OpGraph, split: dict[str, list[tuple[int, int]]], mix: TokenMix,
           forms: dict[str, str]) -> list[NanoOpDef]:
    """The nano-ops of one layer: each op's ranges clipped to its domain, empty ones dropped."""
    ops = graph.active_ops(forms)
    check_split(split, ops, mix.dense_batch)
    out = []
    for o in ops:
        lo, hi = mix.domain(o.domain)
        index = 0
        for s, e in split[o.name]:
            ws, we = max(s, lo), min(e, hi)
            if we > ws:
                out.append(NanoOpDef(o.name, index, o.resource, s, e, ws, we))
                index += 1
    return out


def nano_deps(graph: OpGraph, nanos: list[NanoOpDef], mix: TokenMix,
              forms: dict[str, str]) -> dict[str, list[NanoDep]]:
    """Nano-op id -> the nano-ops it depends on, from the graph's edges."""
    by_op: dict[str, list[NanoOpDef]] = {}
    for n in nanos:
        by_op.setdefault(n.op, []).append(n)
    deps: dict[str, list[NanoDep]] = {n.id: [] for n in nanos}
    for edge in graph.active_edges(forms):
        for y in by_op.get(edge.dst, []):
            lo, hi = y.work_start, y.work_end
            if edge.kind == "prompt":
                lo, hi = mix.prompt_start(y.work_start), y.work_start
            have = {(d.src, d.shift) for d in deps[y.id]}
            for x in by_op.get(edge.src, []):
                if lo < hi and x.work_start < hi and lo < x.work_end \
                        and (x.id, edge.shift) not in have:
                    deps[y.id].append(NanoDep(x.id, edge.shift, edge.kind))
    return deps


def precedences(deps: dict[str, list[NanoDep]]) -> list[Precedence]:
    """`nano_deps` as (x → y, δ) precedences, in its order (kinds dropped): the dependencies
    of the period search and of stage II."""
    return [Precedence(d.src, y, d.shift) for y, ds in deps.items() for d in ds]


def even_split(dense_batch: int, count: int) -> list[tuple[int, int]]:
    """`count` ranges of nearly equal size in multiples of 128."""
    quanta = dense_batch // TOKEN_QUANTUM
    if not 1 <= count <= quanta:
        raise ConfigError(f"cannot split {dense_batch} tokens into {count} nano-batches of at "
                          f"least {TOKEN_QUANTUM}")
    cuts = [round(i * quanta / count) * TOKEN_QUANTUM for i in range(count + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))
