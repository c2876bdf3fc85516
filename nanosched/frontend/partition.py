"""The partition: a traced graph's nodes grouped into the ops of a repeating layer.

More in docs/frontend.md, module notes.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from nanosched.errors import ConfigError
from nanosched.frontend import custom_ops
from nanosched.frontend.rules import Rules, same_callable, target_name
from nanosched.models import ops as optable
from nanosched.models.ops import COMPUTE, MEMORY, NETWORK, OTHER

EMBED, HEAD = "embed", "head"
MATMULS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d", "conv2d",
           optable.EXPERTS_UG, optable.EXPERTS_D, optable.ATTN_PREFILL,
           "scaled_dot_product_attention"}
COLLECTIVE_CALLS = {"all_reduce", "all_gather", "reduce_scatter", "all_reduce_",
               "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "all_to_all_single"}
VIEW_METHODS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten",
                "unflatten", "expand", "contiguous", "narrow", "select", "t", "split", "chunk",
                "unbind", "view_as", "expand_as", "reshape_as", "movedim", "__getitem__"}
VIEW_FUNCTIONS = {torch.reshape, torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze,
                  torch.flatten, torch.narrow, torch.select, torch.split, torch.chunk,
                  torch.unbind, torch.movedim, torch.t}


@dataclass
class Group:
    """One op of the program: its nodes in graph order."""

    op: str
    layer: int  # -1 for the prologue and the epilogue
    nodes: list[fx.Node] = field(default_factory=list)
    resource: str = OTHER

    @property
    def name(self) -> str:
        return self.op if self.layer < 0 else f"L{self.layer}.{self.op}"


@dataclass
class Partition:
    groups: list[Group]  # program order: embed, the layers' ops, head
    num_layers: int
    layer_ops: list[tuple[str, str]]  # (op, resource) of one layer, in order
    group_of: dict[fx.Node, int]  # node -> index in `groups`


def partition(gm: fx.GraphModule, rules: Rules) -> Partition:
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    labels = {n: rules.label(n) for n in nodes if n.op in ("call_function", "call_method",
                                                            "call_module") and not is_size(n)}
    key_of, num_layers = _layers(nodes, labels, rules.start)
    first = min((pos[n] for n, k in key_of.items() if k[0] != EMBED), default=len(nodes))
    for n in nodes[:first]:  # everything before the first layer's first node: the prologue
        if n.op not in ("placeholder", "output"):
            key_of[n] = (EMBED, -1)
    for n in reversed(nodes):  # glue joins its earliest consumer
        if n in key_of or n.op in ("placeholder", "output"):
            continue
        users = sorted((u for u in n.users), key=pos.__getitem__)
        key_of[n] = _consumer_key(n, users, key_of, nodes, pos)
    for n in nodes:  # an element of a multi-output node (topk, ...) stays with the node
        if is_projection(n):
            key_of[n] = key_of[n.args[0]]
    groups = _order(nodes, pos, key_of)
    group_of = {n: i for i, g in enumerate(groups) for n in g.nodes}
    for g in groups:
        g.resource = rules.resource_of(g.op) or infer_resource(g.nodes)
    layer_ops = _check_layers(groups, num_layers)
    return Partition(groups, num_layers, layer_ops, group_of)


def _layers(nodes: list[fx.Node], labels: dict[fx.Node, str | None], start: str
            ) -> tuple[dict[fx.Node, tuple[str, int]], int]:
    layer, prev = -1, None
    key_of: dict[fx.Node, tuple[str, int]] = {}
    for n in nodes:
        op = labels.get(n)
        if op is None:
            continue
        if op == start and prev != start:
            layer += 1
        prev = op
        key_of[n] = (EMBED, -1) if layer < 0 else (op, layer)
    if layer < 0:
        raise ConfigError(f"no node of the traced graph matches the rules of op {start!r}, the "
                          f"op a layer starts at: check the rules against the model's module "
                          f"paths and functions")
    return key_of, layer + 1


def _consumer_key(n: fx.Node, users: list[fx.Node], key_of: dict[fx.Node, tuple[str, int]],
                  nodes: list[fx.Node], pos: dict[fx.Node, int]) -> tuple[str, int]:
    for u in users:
        if u.op == "output":
            return HEAD, -1
        if u in key_of:
            return key_of[u]
    for later in nodes[pos[n] + 1:]:  # read by nothing: stays beside the next op
        if later in key_of and key_of[later][0] != HEAD:
            return key_of[later]
    return HEAD, -1


def _order(nodes: list[fx.Node], pos: dict[fx.Node, int],
           key_of: dict[fx.Node, tuple[str, int]]) -> list[Group]:
    """Groups in a program order that keeps every dependency (module docstring, step 4)."""
    members: dict[tuple[str, int], list[fx.Node]] = {}
    for n in nodes:
        if n in key_of:
            members.setdefault(key_of[n], []).append(n)
    edges: dict[tuple[str, int], set[tuple[str, int]]] = {k: set() for k in members}

    def edge(a: fx.Node, b: fx.Node) -> None:
        ka, kb = key_of.get(a), key_of.get(b)
        if ka is not None and kb is not None and ka != kb:
            edges[ka].add(kb)

    last_effect = None
    for n in nodes:
        if n not in key_of:
            continue
        for a in n.all_input_nodes:
            for src in sources(a):
                edge(src, n)
        if n.is_impure():
            if last_effect is not None:
                edge(last_effect, n)
            last_effect = n
        for v in mutated(n):
            for u in v.users:
                if u is not n:
                    edge(*((n, u) if pos[u] > pos[n] else (u, n)))
    rank = {k: (k[0] == HEAD, k[0] != EMBED, min(pos[n] for n in ns))
            for k, ns in members.items()}
    indegree = {k: 0 for k in members}
    for k in edges:
        for k2 in edges[k]:
            indegree[k2] += 1
    ready = [(rank[k], k) for k, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    out: list[Group] = []
    while ready:
        _, k = heapq.heappop(ready)
        out.append(Group(k[0], k[1], members[k]))
        for k2 in edges[k]:
            indegree[k2] -= 1
            if indegree[k2] == 0:
                heapq.heappush(ready, (rank[k2], k2))
    if len(out) < len(members):
        stuck = sorted(Group(k[0], k[1]).name for k, d in indegree.items() if d > 0)
        raise ConfigError(f"the partition's ops depend on each other in a cycle ({', '.join(stuck)}"
                          f"): a rule puts nodes on both sides of another op into one op")
    return out


def mutated(n: fx.Node) -> list[fx.Node]:
    """The graph values node `n` writes in place (schema-declared, `x.add_()`, `x += y`)."""
    if n.op == "call_method" and n.target.endswith("_") and not n.target.endswith("__"):
        return [n.args[0]] if isinstance(n.args[0], fx.Node) else []
    if n.op != "call_function":
        return []
    if n.target in (operator.iadd, operator.isub, operator.imul, operator.itruediv):
        return [n.args[0]] if isinstance(n.args[0], fx.Node) else []
    if same_callable(n.target, custom_ops.KV_APPEND):  # writes the KV cache, not its arguments
        return []
    target = n.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    schema = getattr(target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                out.append(value)
    return out


def infer_resource(nodes: list[fx.Node]) -> str:
    names = {target_name(n.target) for n in nodes if n.op in ("call_function", "call_method")}
    if names & COLLECTIVE_CALLS:
        return NETWORK
    if any(n.op == "call_function" and same_callable(n.target, custom_ops.ATTN_DECODE)
           for n in nodes):
        return MEMORY
    return COMPUTE if names & MATMULS else OTHER


def _check_layers(groups: list[Group], num_layers: int) -> list[tuple[str, str]]:
    per_layer: list[list[Group]] = [[] for _ in range(num_layers)]
    for g in groups:
        if g.layer >= 0:
            per_layer[g.layer].append(g)
    want = [g.op for g in per_layer[0]]
    for layer, gs in enumerate(per_layer):
        got = [g.op for g in gs]
        if got != want:
            raise ConfigError(f"layer {layer} partitions into ops {got}, layer 0 into {want}: "
                              f"every layer must hold the same ops in the same order")
    return [(g.op, g.resource) for g in per_layer[0]]


def is_projection(n: fx.Node) -> bool:
    """`getitem` of one output of a multi-output node that is not a view (topk, ...)."""
    if n.op != "call_function" or n.target is not operator.getitem:
        return False
    src = n.args[0]
    return isinstance(src, fx.Node) and src.op != "placeholder" and \
        isinstance(example(src), (tuple, list)) and not is_view(src)


def is_view(n: fx.Node) -> bool:
    """Whether `n` only views or reshapes its input (cheap to recompute where it is read)."""
    if n.op == "call_method":
        return n.target in VIEW_METHODS
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and (is_tensor(src) or is_view(src))
    return n.target in VIEW_FUNCTIONS


def is_size(node: fx.Node) -> bool:
    """Size arithmetic (`n * k`, `x.size()[:-1] + (d,)`): glue, whatever a rule says, and
    recomputed from the token count wherever it is read."""
    return _is_size_value(example(node))


def _is_size_value(v: object) -> bool:
    if isinstance(v, (tuple, list)):
        return all(isinstance(x, (torch.SymInt, int)) for x in v)
    return isinstance(v, (torch.SymInt, int, float, bool))


def sources(node: fx.Node) -> list[fx.Node]:
    """The computed values a node's data comes from: itself, or for a view what it views
    (sizes and placeholders carry no dependency between ops)."""
    if node.op == "placeholder" or is_size(node):
        return []
    if is_view(node):
        return [s for a in node.all_input_nodes for s in sources(a)]
    return [node]


def is_tensor(node: object) -> bool:
    return isinstance(node, fx.Node) and isinstance(example(node), torch.Tensor)


def example(node: fx.Node) -> object:
    """The value Dynamo recorded for `node` (a fake tensor, a SymInt, a tuple, ...)."""
    return node.meta.get("example_value", node.meta.get("val"))
