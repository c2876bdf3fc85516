"""TorchInductor for the frontend's elementwise ops: norms, activation, rotary, residual adds.

HF writes an RMSNorm as about eight torch kernels (dtype casts, square, mean, rsqrt, two
products), its rotary embedding as about ten (products, halves, negation, concatenation) and
SiLU * up as two, each reading and writing the whole activation, where the named-op model runs
one fused kernel per op. Inductor fuses each such subgraph into a few generated kernels.

More in docs/frontend.md, module notes.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.fx.experimental import _config as shape_config

from nanosched.errors import ConfigError
from nanosched.frontend.codegen import Subgraph
from nanosched.frontend.partition import infer_resource
from nanosched.models.ops import OTHER

AUTO = "auto"
WARM_PROMPT, WARM_ROWS = 11, 29  # prompt tokens, buffer rows: no other size of the model


def chosen_ops(subs: list[Subgraph], device: torch.device,
               compile_ops: tuple[str, ...] | str) -> tuple[str, ...]:
    """The ops whose subgraphs Inductor compiles (module docstring)."""
    layer_ops = list(dict.fromkeys(s.group.op for s in subs if s.group.layer >= 0))
    if compile_ops != AUTO:
        if isinstance(compile_ops, str):
            raise ConfigError(f"compile_ops={compile_ops!r}: give {AUTO!r} or a tuple of op "
                              f"names of the layer ({', '.join(layer_ops)})")
        unknown = [op for op in compile_ops if op not in layer_ops]
        if unknown:
            raise ConfigError(f"compile_ops names {', '.join(unknown)}, not ops of the layer "
                              f"({', '.join(layer_ops)})")
        return tuple(compile_ops)
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return ()
    return elementwise_ops(subs)


def elementwise_ops(subs: list[Subgraph]) -> tuple[str, ...]:
    """The layer's ops, in order, that call no matmul, attention, expert GEMM or collective."""
    ops = [s.group.op for s in subs if s.group.layer >= 0]
    heavy = {s.group.op for s in subs if infer_resource(s.group.nodes) != OTHER}
    return tuple(op for op in dict.fromkeys(ops) if op not in heavy)


def compile_subgraphs(subs: list[Subgraph], ops: tuple[str, ...],
                      token_dim: Callable[[fx.Node], int | None]) -> None:
    """Compile the subgraphs of `ops`; `token_dim(node)`: the token dimension of a value or
    graph input a subgraph takes (None: a weight or a size)."""
    for sub in subs:
        if sub.group.op in ops:
            _functional_writes(sub.module)
            r = sub.reads
            dims = [token_dim(n) for n in (*r.values, *r.inputs, *r.symbols, *sub.outputs)]
            sub.module = TokenDynamic(sub.module, dims)


class TokenDynamic:
    """A subgraph compiled with its token dimensions dynamic and every other size static.

    `torch.compile(dynamic=True)` would make every size symbolic, the hidden size too, and
    Inductor then generates reductions that loop over a row of unknown width; so while
    `marking` (the warm-up) each call marks its tensors' other dimensions static, and those
    of the buffers the row views come from (token-major: dimension 0 is the token one). Sizes
    passed as integers stay symbolic. Calls run in inference mode, as the warm-up does, since
    Dynamo guards on the grad mode (the profiler calls ops with it on)."""

    def __init__(self, module: fx.GraphModule, token_dims: list[int | None]) -> None:
        self.module, self.token_dims, self.marking = module, token_dims, True
        self.compiled = torch.compile(module, dynamic=True, fullgraph=True)

    @property
    def graph(self) -> fx.Graph:
        return self.module.graph

    def __call__(self, *args: Any) -> Any:
        if self.marking:
            for a, d in zip(args, self.token_dims, strict=True):
                if isinstance(a, torch.Tensor):
                    _static_except(a, d)
                    if a._base is not None:
                        _static_except(a._base, None if d is None else 0)
        with torch.inference_mode():  # the warm-up's mode, whatever the caller's: no recompile
            return self.compiled(*args)


def _static_except(t: torch.Tensor, dim: int | None) -> None:
    for d in range(t.dim()):
        if d != dim:
            torch._dynamo.mark_static(t, d)


def _functional_writes(module: fx.GraphModule) -> None:
    """`f(..., out=o)` as `o.copy_(f(...))`: Dynamo refuses an `out=` tensor that is not
    contiguous (a token-major buffer seen in the traced layout), while Inductor stores a
    copy into its input straight from the kernel that computes the value."""
    graph = module.graph
    for n in list(graph.nodes):
        out = n.kwargs.get("out") if n.op == "call_function" else None
        if out is None:
            continue
        if isinstance(n.target, torch._ops.OpOverload):  # aten.silu.out -> aten.silu.default
            n.target = n.target.overloadpacket.default
        n.kwargs = {k: v for k, v in n.kwargs.items() if k != "out"}
        with graph.inserting_after(n):
            graph.call_method("copy_", (out, n))
    graph.lint()
    module.recompile()


def warm_up(fm: Any) -> float:
    """Run the compiles now (module docstring); seconds spent."""
    t0 = time.perf_counter()
    pages = -(-(WARM_PROMPT + 1) // 16)
    ws = fm.new_workspace(max_tokens=WARM_ROWS, num_pages=pages, page_size=16)
    with torch.inference_mode(), shape_config.patch(use_duck_shape=False):
        for num_tokens, is_decode in ((WARM_PROMPT, False), (1, True)):
            meta = ws.kv.plan([(0, num_tokens, is_decode)])
            fm.forward(ws, meta, torch.zeros(1, dtype=torch.int64, device=fm.device))
    if fm.device.type == "cuda":
        torch.cuda.synchronize(fm.device)
    for step in fm.steps:
        if isinstance(step.sub.module, TokenDynamic):
            step.sub.module.marking = False
    return time.perf_counter() - t0
