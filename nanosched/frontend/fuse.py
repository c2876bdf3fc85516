"""Horizontal fusion: sibling linears of one op that read the same input run as one GEMM.

HF's attention computes q, k and v with three `nn.Linear`s on one input and its MLP gate and
up with two; the named-op model runs each group as one GEMM on concatenated weights, as vLLM's
`QKVParallelLinear` does by hand. `fuse_linears(trace, label, weights)` rewrites the traced
graph so that the `linear` calls of one op (the same rule label) on the same input, whose
weights (and biases, all or none) are the model's parameters of one dtype and input width,
become one `linear` on the concatenated weight; each former output is a `narrow` view of its
columns. The partition then sees one GEMM and one value crossing ops (the views are recomputed
inside the ops that read them, boundary.py); op names and resource classes are unchanged.

More in docs/frontend.md, module notes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from nanosched.frontend.partition import example
from nanosched.frontend.trace import Trace

LINEAR = {F.linear, torch._C._nn.linear}
JOIN = "+"


class FusedWeights:
    """Model tensors by path; a `+`-joined path is the concatenation of its parts (rows)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self._cache: dict[str, torch.Tensor] = {}

    def get(self, path: str) -> torch.Tensor:
        if JOIN not in path:
            return self.params[path]
        if path not in self._cache:
            self._cache[path] = _concatenate([self.params[p] for p in path.split(JOIN)])
        return self._cache[path]


def _concatenate(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows of `parts` as one tensor that the parts then view (module docstring)."""
    first = parts[0].detach()
    rows = sum(p.shape[0] for p in parts)
    if _adjacent(parts):
        return first.as_strided((rows, *first.shape[1:]), first.stride(),
                                first.storage_offset())
    cat = torch.cat([p.detach() for p in parts])
    start = 0
    for p in parts:
        p.data = cat[start:start + p.shape[0]]
        start += p.shape[0]
    return cat


def _adjacent(parts: list[torch.Tensor]) -> bool:
    if not all(p.is_contiguous() for p in parts):
        return False
    storage = parts[0].untyped_storage().data_ptr()
    for a, b in zip(parts, parts[1:], strict=False):
        if b.untyped_storage().data_ptr() != storage or \
                b.data_ptr() != a.data_ptr() + a.numel() * a.element_size():
            return False
    return True


def fuse_linears(trace: Trace, label: Callable[[fx.Node], str | None],
                 weights: FusedWeights) -> list[list[str]]:
    """Fuse sibling linears in `trace.gm` (module docstring); returns the fused nodes' names."""
    siblings: dict[tuple, list[fx.Node]] = {}
    for n in trace.gm.graph.nodes:
        key = _sibling_key(trace, n, label)
        if key is not None:
            siblings.setdefault(key, []).append(n)
    fused = []
    for nodes in siblings.values():
        if len(nodes) > 1 and len({id(trace.constants[n.args[1]]) for n in nodes}) == len(nodes):
            fused.append([n.name for n in nodes])
            _fuse(trace, nodes, weights)
    trace.gm.graph.lint()
    return fused


def _parts(n: fx.Node) -> tuple[Any, Any, Any]:
    args = [*n.args, None, None][:3]
    bias = n.kwargs.get("bias", args[2])
    return args[0], args[1], bias


def _sibling_key(trace: Trace, n: fx.Node, label: Callable[[fx.Node], str | None]
                 ) -> tuple | None:
    if n.op != "call_function" or n.target not in LINEAR or set(n.kwargs) - {"bias"}:
        return None
    x, w, b = _parts(n)
    if not isinstance(x, fx.Node) or not _is_weight(trace, w) or \
            b is not None and not _is_weight(trace, b):
        return None
    weight = trace.constants[w]
    if weight.dim() != 2:
        return None
    return x, label(n), b is None, weight.dtype, weight.device, weight.shape[1]


def _is_weight(trace: Trace, n: object) -> bool:
    return isinstance(n, fx.Node) and n in trace.constants and n in trace.paths


def _fuse(trace: Trace, nodes: list[fx.Node], weights: FusedWeights) -> None:
    graph = trace.gm.graph
    x = nodes[0].args[0]
    w_inputs = [_parts(n)[1] for n in nodes]
    b_inputs = [_parts(n)[2] for n in nodes]
    w = _placeholder(trace, w_inputs, weights)
    b = _placeholder(trace, b_inputs, weights) if b_inputs[0] is not None else None
    widths = [int(trace.constants[n].shape[0]) for n in w_inputs]
    with graph.inserting_before(nodes[0]):
        out = graph.call_function(nodes[0].target, (x, w, b))
    out.meta = dict(nodes[0].meta)
    first = example(nodes[0])
    with first.fake_mode:  # [..., sum of widths]: the shape alone (a fake linear costs more)
        out.meta["example_value"] = first.new_empty((*first.shape[:-1], sum(widths)))
    start = 0
    for n, width in zip(nodes, widths, strict=True):
        with graph.inserting_after(out):
            view = graph.call_method("narrow", (out, -1, start, width))
        view.meta = dict(n.meta)  # its traced value's shape; a view never crosses ops
        n.replace_all_uses_with(view)
        graph.erase_node(n)
        start += width


def _placeholder(trace: Trace, parts: list[fx.Node], weights: FusedWeights) -> fx.Node:
    """A graph input for the concatenation of the weight inputs `parts`."""
    graph = trace.gm.graph
    path = JOIN.join(trace.paths[p] for p in parts)
    tensor = weights.get(path)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        node = graph.placeholder(f"fused_{parts[0].name}")
    fake = example(parts[0])
    with fake.fake_mode:
        node.meta["example_value"] = torch.empty(tuple(tensor.shape), dtype=tensor.dtype,
                                                 device=fake.device)
    trace.constants[node], trace.paths[node] = tensor, path
    return node
