"""TorchDynamo capture of an unmodified model's forward, as the frontend's input.

`capture(model, ...)` compiles the model with a `torch.compile` backend that keeps the graph
Dynamo hands it, and calls it once on `example_tokens` tokens of one sequence
(`input_ids` and `position_ids` of shape [1, T], T marked dynamic, `use_cache=False`), so every
size that depends on T is a symbol. The graph's placeholders are then sorted into the token
inputs (rows of the batch), the symbolic sizes (functions of T) and the constants (the model's
parameters and buffers, found by identity, so a path like `model.layers.3.mlp.up_proj.weight`
names each).

More in docs/frontend.md, module notes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx

from nanosched.errors import ConfigError

TOKEN_INPUTS = ("input_ids", "position_ids")


@dataclass
class Trace:
    gm: fx.GraphModule
    symbol: sympy.Symbol  # the token count T
    tokens: dict[fx.Node, str] = field(default_factory=dict)  # placeholder -> token input
    constants: dict[fx.Node, torch.Tensor] = field(default_factory=dict)
    paths: dict[fx.Node, str] = field(default_factory=dict)  # constant -> the model's name
    symbols: dict[fx.Node, sympy.Expr] = field(default_factory=dict)  # SymInt placeholders
    layers: int = 0  # decoder layers traced
    layer_prefix: str = ""  # the layer list's path ("model.layers")
    seconds: float = 0.0
    start_seconds: float = 0.0  # Dynamo's first start in the process, before the trace


def layer_list(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The model's decoder layers: the longest `ModuleList` of modules of one class."""
    best: tuple[str, torch.nn.ModuleList] | None = None
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and \
                len({type(x) for x in m}) == 1 and (best is None or len(m) > len(best[1])):
            best = (name, m)
    if best is None:
        raise ConfigError(f"{type(model).__name__} has no list of decoder layers "
                          f"(a torch.nn.ModuleList of modules of one class)")
    return best


@contextmanager
def _shallow(model: torch.nn.Module, prefix: str, layers: int) -> Iterator[None]:
    parent_name, _, attr = prefix.rpartition(".")
    parent = model.get_submodule(parent_name)
    full = getattr(parent, attr)
    config = getattr(model, "config", None)
    saved = getattr(config, "num_hidden_layers", None)
    setattr(parent, attr, torch.nn.ModuleList(list(full)[:layers]))
    if saved is not None:
        config.num_hidden_layers = layers
    try:
        yield
    finally:
        setattr(parent, attr, full)
        if saved is not None:
            config.num_hidden_layers = saved


def capture(model: torch.nn.Module, example_tokens: int = 8, layers: int | None = None
            ) -> Trace:
    """Trace `model` (see the module docstring); `layers=None` traces every layer."""
    prefix, full = layer_list(model)
    depth = len(full) if layers is None else min(layers, len(full))
    first = next(model.parameters())
    started = start_dynamo(first.device, first.dtype)
    ids, pos = _token_inputs(example_tokens, first.device)
    t0 = time.perf_counter()
    try:
        with _shallow(model, prefix, depth):
            graphs = _graphs(model, input_ids=ids, position_ids=pos, use_cache=False)
    except torch._dynamo.exc.Unsupported as exc:
        raise ConfigError(f"TorchDynamo cannot trace {type(model).__name__} as one graph: "
                          f"{str(exc).splitlines()[0]}") from exc
    if len(graphs) != 1:
        raise ConfigError(f"tracing {type(model).__name__} gave {len(graphs)} graphs, not one")
    gm, examples = graphs[0]
    trace = Trace(gm, _token_symbol(gm, examples, ids), layers=depth, layer_prefix=prefix,
                  seconds=time.perf_counter() - t0, start_seconds=started)
    _sort_inputs(trace, model, examples, {id(ids): "input_ids", id(pos): "position_ids"})
    return trace


class _Captured(Exception):
    """Raised by the capturing backend once it holds the graph, to stop Dynamo there."""


def _graphs(module: torch.nn.Module, **inputs: object) -> list[tuple[fx.GraphModule, list]]:
    """The graphs Dynamo hands a backend that keeps them and stops it (module docstring)."""
    graphs: list[tuple[fx.GraphModule, list]] = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        graphs.append((gm, list(example_inputs)))
        raise _Captured  # the graph is all the frontend needs: no guards, no forward run

    try:
        with torch.no_grad():
            torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(**inputs)
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        if not isinstance(exc.inner_exception, _Captured):
            raise
    return graphs


def _token_inputs(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and position_ids [1, n], n dynamic."""
    ids = torch.zeros((1, n), dtype=torch.int64, device=device)
    pos = torch.arange(n, device=device)[None]
    for t in (ids, pos):
        torch._dynamo.mark_dynamic(t, 1)
    return ids, pos


class _Probe(torch.nn.Module):
    """torch's own modules, as a decoder's layer uses them: what `start_dynamo` traces."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.proj, self.act = (torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16),
                                           torch.nn.SiLU())

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        gate, up = self.proj(x).chunk(2, dim=-1)
        return (self.act(gate) * up).transpose(1, 2) + position_ids[:, None].to(x.dtype)


_STARTED: set[tuple[str, str]] = set()


def start_dynamo(device: torch.device, dtype: torch.dtype) -> float:
    """Dynamo's first start in this process on `device` in `dtype` (module docstring);
    seconds, 0 once done."""
    key = (str(device), str(dtype))
    if key in _STARTED:
        return 0.0
    t0 = time.perf_counter()
    probe = _Probe().to(device=device, dtype=dtype if dtype.is_floating_point else None)
    ids, pos = _token_inputs(4, device)
    _graphs(probe, input_ids=ids, position_ids=pos)
    _STARTED.add(key)
    return time.perf_counter() - t0


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _token_symbol(gm: fx.GraphModule, examples: list, ids: torch.Tensor) -> sympy.Symbol:
    for node, value in zip(_placeholders(gm), examples, strict=True):
        if value is ids:
            size = node.meta["example_value"].shape[1]
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                return size.node.expr
    raise ConfigError("tracing kept no symbolic token count: the model's forward "
                      "specialised the sequence length (it must run on any number of tokens)")


def _sort_inputs(trace: Trace, model: torch.nn.Module, examples: list,
                 token_ids: dict[int, str]) -> None:
    names = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), name)
    for node, value in zip(_placeholders(trace.gm), examples, strict=True):
        if id(value) in token_ids:
            trace.tokens[node] = token_ids[id(value)]
        elif isinstance(value, torch.SymInt):
            trace.symbols[node] = value.node.expr
        elif isinstance(value, torch.Tensor):
            trace.constants[node] = value
            if id(value) in names:
                trace.paths[node] = names[id(value)]
        else:
            raise ConfigError(f"graph input {node.name} is a {type(value).__name__}; the "
                              f"frontend takes tensors and sizes")
