"""The frontend's ops as the runtime's `Program`, over buffers shared by the whole forward.

`BoundSubgraph` is one op of the forward, a step of its program: a subgraph (codegen.py)
bound to one layer (`shift` layers after the traced layer it was built from: its weights and
KV layer are the shifted ones).
Every tensor one step computes for later steps is a value `(op, output index, layer)`;
values of equal shape, dtype and layout share a buffer when their lifetimes (first writer to
last reader, in program order) do not overlap, so the buffers hold about one layer's
intermediates whatever the depth, as the named-op workspace does. A step reads and writes
only its token rows of them; the attention steps touch only their own kind of rows (decode
or prompt) and read the K/V of earlier rows of their prompt through the cache
(runtime/modelprogram.py's spans).

More in docs/frontend.md, module notes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from nanosched.errors import ConfigError
from nanosched.frontend import custom_ops
from nanosched.frontend.boundary import Value, evaluate, rows
from nanosched.frontend.codegen import Subgraph
from nanosched.frontend.fuse import JOIN
from nanosched.frontend.partition import is_size, mutated
from nanosched.frontend.rules import same_callable
from nanosched.runtime.modelprogram import attention_spans
from nanosched.runtime.program import Access, LaunchConfig, Program, ProgramOp

ValueId = tuple[str, int, int]  # (producing op, its output index, real layer or -1)


@dataclass
class BoundSubgraph:
    sub: Subgraph
    shift: int  # real layer - traced layer
    roles: dict[fx.Node, tuple[str, int, int]]  # value -> (op, output index, traced layer)
    bound: list[Any] = field(default_factory=list)  # per graph input: token name or tensor

    @property
    def layer(self) -> int:
        g = self.sub.group
        return g.layer + self.shift if g.layer >= 0 else -1

    def value_id(self, node: fx.Node) -> ValueId:
        """A value by role, so the traced layer bound to several layers names each layer's
        own copy: the previous layer's output j of op X is (X, j, layer - 1) in every layer."""
        op, j, t = self.roles[node]
        return op, j, (t + self.shift if t >= 0 else -1)

    def reads(self) -> list[ValueId]:
        return [self.value_id(n) for n in self.sub.reads.values]

    def writes(self) -> list[ValueId]:
        own = [self.value_id(n) for n in self.sub.outputs]
        changed = [self.value_id(v) for n in self.sub.group.nodes for v in mutated(n)
                   if v in self.roles and v in self.sub.reads.values]
        return own + changed

    def has(self, op: Any) -> bool:
        return any(n.op == "call_function" and same_callable(n.target, op)
                   for n in self.sub.group.nodes)


def assign_buffers(steps: Sequence[BoundSubgraph], values: dict[ValueId, Value]
                   ) -> dict[ValueId, str]:
    """Buffer name of every value: reuse one whose last reader came strictly earlier."""
    first: dict[ValueId, int] = {}
    last: dict[ValueId, int] = {}
    for i, s in enumerate(steps):
        for v in s.writes():
            first.setdefault(v, i)
            last[v] = max(last.get(v, i), i)
        for v in s.reads():
            last[v] = max(last.get(v, i), i)
    free: dict[tuple, list[tuple[int, str]]] = {}  # signature -> (busy until, name)
    out: dict[ValueId, str] = {}
    count = 0
    for v in sorted(first, key=first.__getitem__):
        pool = free.setdefault(values[v].signature(), [])
        slot = next((k for k, (until, _) in enumerate(pool) if until < first[v]), None)
        if slot is None:
            name = f"b{count}"
            count += 1
            pool.append((last[v], name))
        else:
            name = pool[slot][1]
            pool[slot] = (last[v], name)
        out[v] = name
    return out


def program(fm: Any, ws: Any, meta: Any, segments: Sequence[tuple[int, int, bool]]) -> Program:
    """The forward of frontend model `fm` over the batch `meta` describes (runtime contract:
    runtime/program.py), on workspace `ws`."""
    num_tokens = segments[-1][1] if segments else 0
    decode, prefill, prefill_kv = attention_spans(segments)
    out = []
    for step in fm.steps:
        span, kv_span = None, None
        if step.has(custom_ops.ATTN_PREFILL):
            kv_span = prefill_kv
            span = None if step.has(custom_ops.ATTN_DECODE) else prefill
        elif step.has(custom_ops.ATTN_DECODE):
            span = kv_span = decode
        reads = [Access(fm.buffers[v], span) for v in step.reads()]
        writes = [Access(fm.buffers[v], span) for v in step.writes()]
        if kv_span is not None:
            reads.append(Access(f"kv{step.layer}", kv_span))
        if step.has(custom_ops.KV_APPEND):
            writes.append(Access(f"kv{step.layer}"))
        if "input_ids" in fm.inputs_of(step):
            reads.append(Access("token_ids"))
        out.append(ProgramOp(step.sub.group.op, step.layer, step.sub.group.resource,
                             runner(fm, step, ws, meta), tuple(reads), tuple(writes)))
    return Program(num_tokens, tuple(out))


def runner(fm: Any, step: BoundSubgraph, ws: Any, meta: Any
           ) -> Callable[[int, int, LaunchConfig], None]:
    """`run(start, end, cfg)` of one step; what does not depend on the range is looked up once."""
    sub = step.sub
    ins = [(ws.buffers[fm.buffers[v]], fm.values[v]) for v in step.reads()]
    outs = [(ws.buffers[fm.buffers[v]], fm.values[v])
            for v in map(step.value_id, sub.outputs)]
    inputs = fm.inputs_of(step)  # token input name, or a bound constant tensor
    syms = [fm.sizes[n] for n in sub.reads.symbols]
    module, kernels, shift, op, symbol = sub.module, fm.kernels, step.shift, sub.group.op, \
        fm.trace.symbol

    def run(s: int, e: int, cfg: LaunchConfig) -> None:
        n = e - s
        if n <= 0:  # as the named-op model's run_op: an empty range launches nothing
            return
        args: list[Any] = [rows(b, v, s, e) for b, v in ins]
        args += [token_rows(ws, meta, x, s, e) if isinstance(x, str) else x for x in inputs]
        args += [evaluate(x, symbol, n) for x in syms]
        args += [rows(b, v, s, e) for b, v in outs]
        with custom_ops.calling(ws.kv, meta, s, e, cfg.launch_dict(op), kernels, shift):
            module(*args)

    return run


def token_rows(ws: Any, meta: Any, name: str, s: int, e: int) -> torch.Tensor:
    """Rows [s, e) of a token input as the traced graph takes it ([1, n])."""
    if name == "input_ids":
        return ws.token_ids[s:e].view(1, -1)
    return meta.slice(s, e).positions.view(1, -1)


def check_same_layers(a: list[Subgraph], b: list[Subgraph], trace: Any,
                      values: dict[fx.Node, Value]) -> None:
    """Traced layers 0 and 1 run the same subgraphs up to their weights (else a deeper model
    cannot run the traced layer 1 as every middle layer)."""
    for sa, sb in zip(a, b, strict=True):
        if signature(sa, trace, values) != signature(sb, trace, values):
            raise ConfigError(f"op {sa.group.op} differs between layers 0 and 1 beyond their "
                              f"weights: trace every layer (trace_layers=None)")


def signature(sub: Subgraph, trace: Any, values: dict[fx.Node, Value]) -> tuple:
    """A subgraph's structure up to its layer: values' layouts, weights by relative path,
    nodes and literals (the frontend's layer index relative to the op's)."""
    layer = sub.group.layer
    prefix = re.escape(trace.layer_prefix) + r"\.(\d+)\."

    def rel_path(path: str) -> str:
        m = re.match(prefix, path)
        return f"@{int(m.group(1)) - layer}.{path[m.end():]}" if m else path

    def rel(n: fx.Node) -> str:
        path = trace.paths.get(n, "")
        return JOIN.join(map(rel_path, path.split(JOIN))) if path else n.name

    kept = [n for n in sub.module.graph.nodes if n.op == "placeholder" or not is_size(n)]
    index = {n: i for i, n in enumerate(kept)}
    body = []
    for n in kept:  # size arithmetic is recomputed from the token count: not compared
        if n.op == "placeholder":
            continue
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index.get(a, 'size')}")
        if n.op == "call_function" and any(same_callable(n.target, op)
                                              for op in custom_ops.LAYERED):
            args = (args[0][:2] + (args[0][2] - layer,) + args[0][3:], args[1])
        body.append((n.op, str(n.target), repr(args)))
    return (tuple(values[v].signature() for v in (*sub.reads.values, *sub.outputs)),
            tuple(rel(n) for n in sub.reads.inputs), tuple(sub.writes.values()), tuple(body))
