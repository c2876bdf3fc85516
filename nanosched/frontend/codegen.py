"""One op of the partition as a callable subgraph that writes its results into buffers.

More in docs/frontend.md, module notes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from nanosched.frontend import custom_ops
from nanosched.frontend.boundary import Reads
from nanosched.frontend.fuse import LINEAR
from nanosched.frontend.partition import Group, is_tensor
from nanosched.kernels import dispatch as K
from nanosched.kernels.dispatch import KernelOptions

BINARY = {operator.add: torch.add, operator.mul: torch.mul, operator.sub: torch.sub,
          operator.truediv: torch.div, torch.add: torch.add, torch.mul: torch.mul,
          torch.sub: torch.sub, torch.div: torch.div}
BINARY_METHODS = {"add": torch.add, "mul": torch.mul, "sub": torch.sub, "div": torch.div}
COMMUTATIVE = {torch.add, torch.mul}
WITH_OUT = {torch.addmm, torch.mm, torch.matmul, torch.bmm, torch.baddbmm, torch.cat,
            torch.tanh, torch.exp, torch.rsqrt, torch.neg, torch.sigmoid}
UNARY_ATEN = {F.silu: torch.ops.aten.silu.out, F.gelu: torch.ops.aten.gelu.out}
CONVERSIONS = {"float", "half", "bfloat16", "to", "type_as"}
ALLOCATIONS = {"new_empty", "empty_like"}


def linear_out(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
               out: torch.Tensor) -> torch.Tensor:
    """F.linear into `out` through the project's GEMM dispatch (the launch dict of the
    running call: implementation, SM target)."""
    if not out.is_contiguous():
        out.copy_(F.linear(x, w, bias))
        return out
    K.linear(x.reshape(-1, x.shape[-1]), w, bias, out.view(-1, out.shape[-1]),
             custom_ops.CALL.kernels or KernelOptions(), custom_ops.CALL.launch)
    return out


@dataclass
class Subgraph:
    """A callable op: `module(*args)` with the arguments of the module docstring."""

    group: Group
    module: fx.GraphModule | Any  # or its torch.compile'd form (FrontendModel compile_ops)
    reads: Reads
    outputs: list[fx.Node]  # values written, in `out_` argument order
    writes: dict[str, str]  # value name -> "alloc" | "out" | "copy"
    returns: list[fx.Node]  # head only: the graph outputs it returns


def build(gm: fx.GraphModule, group: Group, reads: Reads, outputs: list[fx.Node],
          graph_outputs: list[Any] | None = None) -> Subgraph:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for prefix, nodes in (("in_", reads.values), ("", reads.inputs), ("sym_", reads.symbols)):
        for n in nodes:
            env[n] = g.placeholder(f"{prefix}{n.name}")
            env[n].meta = dict(n.meta)  # the traced value: its tensor-ness, dtype, shape
    outs = {}
    for n in outputs:
        outs[n] = g.placeholder(f"out_{n.name}")
        outs[n].meta = dict(n.meta)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in sorted([*reads.remat, *group.nodes], key=order.__getitem__):
        env[n] = g.node_copy(n, lambda a: env[a])
    returns = [a for a in graph_outputs or () if isinstance(a, fx.Node)]
    output = g.output(tuple(env[a] for a in returns) if graph_outputs is not None else None)
    writes = {n.name: _write(g, env[n], outs[n], output) for n in outputs}
    module = fx.GraphModule(gm, g, class_name=f"Op_{group.name.replace('.', '_')}")
    return Subgraph(group, module, reads, outputs, writes, returns)


def _write(g: fx.Graph, node: fx.Node, out: fx.Node, output: fx.Node) -> str:
    """Make `node` write its value into `out` (module docstring); returns how."""
    if node.op == "call_method" and node.target in ALLOCATIONS or \
            node.op == "call_function" and node.target in (torch.empty, torch.empty_like):
        node.replace_all_uses_with(out)
        g.erase_node(node)
        return "alloc"
    if _with_out(node, out):
        return "out"
    with g.inserting_before(output):
        g.call_method("copy_", (out, node))
    return "copy"


def _with_out(node: fx.Node, out: fx.Node) -> bool:
    """Rewrite `node` in place to compute into `out`, where a form with an output exists."""
    if node.op == "call_function" and node.target in LINEAR:
        node.target, node.kwargs = linear_out, {**node.kwargs, "out": out}
        return True
    if node.op == "call_function" and node.target in WITH_OUT and "out" not in node.kwargs:
        node.kwargs = {**node.kwargs, "out": out}
        return True
    if node.op == "call_function" and node.target in UNARY_ATEN and len(node.args) == 1 and \
            not node.kwargs.get("inplace"):
        kwargs = {k: v for k, v in node.kwargs.items() if k != "inplace"}
        node.target, node.kwargs = UNARY_ATEN[node.target], {**kwargs, "out": out}
        return True
    if node.op == "call_method" and node.target in CONVERSIONS and _is_conversion(node):
        node.op, node.target = "call_method", "copy_"
        node.args, node.kwargs = (out, node.args[0]), {}
        return True
    fn = BINARY.get(node.target) if node.op == "call_function" else \
        BINARY_METHODS.get(node.target) if node.op == "call_method" else None
    if fn is None or len(node.args) != 2 or node.kwargs:
        return False
    a, b = node.args
    if not is_tensor(a):
        if fn not in COMMUTATIVE or not is_tensor(b):
            return False
        a, b = b, a
    node.op, node.target, node.args, node.kwargs = "call_function", fn, (a, b), {"out": out}
    return True


def _is_conversion(node: fx.Node) -> bool:
    """`x.float()`, `x.to(dtype)`, `x.type_as(y)`: a dtype change, nothing else."""
    if node.target == "to":
        extra = node.args[1:]
        return len(extra) == 1 and isinstance(extra[0], torch.dtype) and not node.kwargs or \
            not extra and set(node.kwargs) == {"dtype"}
    return not node.kwargs and (node.target != "type_as" or len(node.args) == 2)
