"""`FrontendModel`: an unmodified model, traced and partitioned, run as the runtime's ops.

    fm = FrontendModel(hf_model, llama_rules())          # trace + partition + subgraphs
    ws = fm.new_workspace(max_tokens, num_pages)         # value buffers + paged KV cache
    meta = ws.kv.plan([(request, num_tokens, is_decode), ...])
    ws.token_ids[:T] = ids
    program = fm.program(ws, meta, segments)             # a runtime Program, like model_program
    run_program(program, Sequential(), Backend(SerialDevice()))
    logits = fm.logits(ws, rows)                         # the epilogue on the rows that sample

More in docs/frontend.md, module notes.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from nanosched.constants import PAGE_SIZE
from nanosched.errors import ConfigError
from nanosched.frontend import custom_ops
from nanosched.frontend.boundary import (
    Value,
    allocate,
    crossing_values,
    evaluate,
    outside_reads,
    rows,
)
from nanosched.frontend.codegen import Subgraph, build
from nanosched.frontend.fuse import JOIN, FusedWeights, fuse_linears
from nanosched.frontend.hf import table_rules
from nanosched.frontend.inductor import AUTO, chosen_ops, compile_subgraphs, warm_up
from nanosched.frontend.partition import EMBED, HEAD, Partition, example, partition
from nanosched.frontend.program import (
    BoundSubgraph,
    assign_buffers,
    check_same_layers,
    program,
    token_rows,
)
from nanosched.frontend.rules import Rules, same_callable
from nanosched.frontend.trace import Trace, capture, layer_list
from nanosched.kernels.dispatch import KernelOptions
from nanosched.models.kvcache import KVCache
from nanosched.models.parallel import TensorParallel

# the frontend's own operators, named as the named-op model names them (below the user's rules)
DEFAULT_RULES = table_rules(("op",))


@dataclass(eq=False)
class FrontendWorkspace:
    """The buffers of one frontend model instance: token ids, value buffers, paged KV cache."""

    max_tokens: int
    token_ids: torch.Tensor  # [T] int64, filled by the caller
    buffers: dict[str, torch.Tensor]
    kv: KVCache


class FrontendModel:
    """An unmodified torch model partitioned into named ops (module docstring)."""

    def __init__(self, model: torch.nn.Module, rules: Rules, *,
                 kernels: KernelOptions | None = None, example_tokens: int = 8,
                 trace_layers: int | None = 3, compile_ops: tuple[str, ...] | str = AUTO,
                 fuse: bool = True) -> None:
        t0 = time.perf_counter()
        first = next(model.parameters())
        self.model, self.device, self.dtype = model, first.device, first.dtype
        self.kernels = kernels or KernelOptions()
        self.tp = TensorParallel()  # one process: what the runtime's CUDA graphs ask
        prefix, layers = layer_list(model)
        self.num_layers = len(layers)
        if trace_layers is not None and self.num_layers > trace_layers and trace_layers < 3:
            raise ConfigError(f"trace_layers={trace_layers}: a model deeper than the trace "
                              f"needs at least 3 traced layers (first, middle, last)")
        self.trace: Trace = capture(model, example_tokens, trace_layers)
        _check_attention(self.trace, model)
        self._params = dict([*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)])
        self.weights = FusedWeights(self._params)
        rules = rules.extended(DEFAULT_RULES)
        self.fused = fuse_linears(self.trace, rules.label, self.weights) if fuse else []
        self.part: Partition = partition(self.trace.gm, rules)
        subs, traced = self._subgraphs()
        self.compiled_ops = chosen_ops(subs, self.device, compile_ops)
        compile_subgraphs(subs, self.compiled_ops,  # one compile serves every layer bound
                          lambda n: traced[n].token_dim if n in traced else
                          1 if n in self.trace.tokens else None)
        self.steps, self.head = self._steps(subs, traced)
        self.values = {v: traced[n] for s in [*self.steps, self.head]
                       for n in (*s.sub.reads.values, *s.sub.outputs) for v in [s.value_id(n)]}
        self.buffers = assign_buffers(self.steps, self.values)
        for s in [*self.steps, self.head]:
            s.bound = self._bind(s)
        self.kv_heads, self.head_dim = self._kv_geometry()
        self.start_seconds = self.trace.start_seconds  # Dynamo's first start: not the model's
        self.init_seconds = time.perf_counter() - t0 - self.start_seconds  # trace + analysis
        self.compile_seconds = warm_up(self) if self.compiled_ops else 0.0

    # ---- what the runtime asks of a model ---------------------------------------------------
    def op_names(self) -> list[str]:
        """The layer's ops in program order (from the partition)."""
        return [op for op, _ in self.part.layer_ops]

    def layer_ops(self) -> list[tuple[str, str]]:
        """(op, resource class) of one layer, in program order."""
        return list(self.part.layer_ops)

    def new_workspace(self, max_tokens: int, num_pages: int, page_size: int = PAGE_SIZE,
                      kv_dtype: str = "auto", kv_layers: int | None = None
                      ) -> FrontendWorkspace:
        """Buffers for up to `max_tokens` tokens and a paged KV cache of `num_pages` pages
        for `kv_layers` layers (default: every layer; the profiler runs layer 0 alone)."""
        kv = KVCache(kv_layers or self.num_layers, num_pages, self.kv_heads, self.head_dim,
                     self.dtype, self.device, page_size, kv_dtype)
        specs: dict[str, Value] = {}
        for v, name in self.buffers.items():
            specs.setdefault(name, self.values[v])
        buffers = {name: allocate(spec, max_tokens, self.device) for name, spec in specs.items()}
        ids = torch.zeros(max_tokens, dtype=torch.int64, device=self.device)
        return FrontendWorkspace(max_tokens, ids, buffers, kv)

    def program(self, ws: FrontendWorkspace, meta: Any,
                segments: list[tuple[int, int, bool]]) -> Any:
        return program(self, ws, meta, segments)

    def logits(self, ws: FrontendWorkspace, rows_: torch.Tensor | None = None,
               num_tokens: int | None = None) -> torch.Tensor:
        """The epilogue on the given rows (all `num_tokens` rows if None): logits [R, V]."""
        if rows_ is None:
            rows_ = torch.arange(num_tokens or 0, device=self.device)
        head, sub = self.head, self.head.sub
        args: list[Any] = []
        for v in head.reads():
            value = self.values[v]
            if value.rows_per_token != 1:
                raise ConfigError(f"the epilogue reads {v[0]}, {value.rows_per_token} rows "
                                  f"per token: it must read one row per token")
            args.append(ws.buffers[self.buffers[v]].index_select(value.token_dim, rows_))
        for x in head.bound:
            if isinstance(x, str):
                raise ConfigError(f"the epilogue reads the graph input {x}: it must read only "
                                  f"what the last layer computes")
            args.append(x)
        args += [evaluate(self.sizes[n], self.trace.symbol, len(rows_))
                 for n in sub.reads.symbols]
        with custom_ops.calling(ws.kv, None, 0, len(rows_), None, self.kernels, head.shift):
            out = sub.module(*args)
        logits = next(t for t in out if isinstance(t, torch.Tensor))
        return logits.reshape(len(rows_), -1)

    def forward(self, ws: FrontendWorkspace, meta: Any, rows_: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Sequential reference: every op over the whole batch, then the logits."""
        from nanosched.runtime.program import DEFAULT_LAUNCH

        segments = [(s, e, i < meta.num_decode) for i, (s, e) in
                    enumerate(zip(meta.seg_starts, meta.seg_ends, strict=True))]
        for op in self.program(ws, meta, segments).ops:
            op.run(0, meta.end, DEFAULT_LAUNCH)
        return self.logits(ws, rows_, num_tokens=meta.end)

    def inputs_of(self, step: BoundSubgraph) -> list[Any]:
        return step.bound

    def describe(self) -> dict[str, Any]:
        """What the partition made: ops, how each value is written, buffer sizes, timings."""
        writes: dict[str, int] = {}
        for s in self.steps:
            for mode in s.sub.writes.values():
                writes[mode] = writes.get(mode, 0) + 1
        per_token = {}
        for v, name in self.buffers.items():
            spec = self.values[v]
            per_token[name] = spec.dtype.itemsize * int(torch.tensor(spec.sizes).prod())
        return {"layer_ops": self.layer_ops(), "num_layers": self.num_layers,
                "traced_layers": self.trace.layers, "writes": writes,
                "copies": sorted({f"{s.sub.group.op}:{v}" for s in self.steps
                                  for v, m in s.sub.writes.items() if m == "copy"}),
                "buffers": len(per_token), "buffer_bytes_per_token": sum(per_token.values()),
                "fused_linears": self.fused, "compiled_ops": list(self.compiled_ops),
                "trace_s": round(self.trace.seconds, 3), "init_s": round(self.init_seconds, 3),
                "compile_s": round(self.compile_seconds, 3),
                "dynamo_start_s": round(self.start_seconds, 3)}

    # ---- building -----------------------------------------------------------------------------
    @property
    def sizes(self) -> dict[fx.Node, Any]:
        return self._sizes

    def _subgraphs(self) -> tuple[list[Subgraph], dict[fx.Node, Value]]:
        part, gm, symbol = self.part, self.trace.gm, self.trace.symbol
        for node, name in self.trace.tokens.items():
            node.meta["nanosched_input"] = name
        reads = [outside_reads(g, set(g.nodes)) for g in part.groups]
        traced = crossing_values(part, reads, symbol)
        self._sizes = {**self.trace.symbols}
        for r in reads:
            for n in r.symbols:
                self._sizes.setdefault(n, example(n))
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        subs = []
        for i, g in enumerate(part.groups):
            outputs = [v for v in traced if part.group_of[v] == i]
            graph_outputs = list(_flatten(out_node.args)) if g.op == HEAD else None
            subs.append(build(gm, g, reads[i], outputs, graph_outputs))
        if subs[-1].group.op != HEAD:
            raise ConfigError("the traced graph has no epilogue: nothing after the last layer")
        return subs, traced

    def _steps(self, subs: list[Subgraph], traced: dict[fx.Node, Value]
               ) -> tuple[list[BoundSubgraph], BoundSubgraph]:
        roles = {}
        for s in subs:
            for j, v in enumerate(s.outputs):
                roles[v] = (s.group.op, j, s.group.layer)
        by_layer: dict[int, list[Subgraph]] = {}
        for s in subs:
            by_layer.setdefault(s.group.layer, []).append(s)
        embed = [s for s in by_layer[-1] if s.group.op == EMBED]
        depth, k = self.num_layers, self.part.num_layers
        if depth == k:
            plan = [(t, 0) for t in range(k)]
        else:
            if any(n.op == "get_attr" for s in subs if s.group.layer >= 0
                   for n in s.group.nodes):  # weights baked in: they cannot be rebound
                raise ConfigError("Dynamo kept the layers' weights as attributes of the graph, "
                                  "not inputs: trace every layer (trace_layers=None)")
            check_same_layers(by_layer[0], by_layer[1], self.trace, traced)
            middle = [(1, layer - 1) for layer in range(1, depth - 1)]
            plan = [(0, 0), *middle, (k - 1, depth - k)]
        steps = [BoundSubgraph(s, 0, roles) for s in embed]
        for t, shift in plan:
            steps += [BoundSubgraph(s, shift, roles) for s in by_layer[t]]
        head = BoundSubgraph(subs[-1], depth - k, roles)
        return steps, head

    def _bind(self, step: BoundSubgraph) -> list[Any]:
        """Per graph input the step reads: a token input's name or the constant tensor (the
        shifted layer's parameter for a layer's weight)."""
        out: list[Any] = []
        prefix = re.escape(self.trace.layer_prefix) + r"\.(\d+)\."
        for n in step.sub.reads.inputs:
            if n in self.trace.tokens:
                out.append(self.trace.tokens[n])
                continue
            path = self.trace.paths.get(n)
            if step.shift and path and re.match(prefix, path):
                parts = [re.sub(prefix, lambda m: f"{self.trace.layer_prefix}."
                                f"{int(m.group(1)) + step.shift}.", part, count=1)
                         for part in path.split(JOIN)]
                out.append(self.weights.get(JOIN.join(parts)).detach())
            else:
                out.append(self.trace.constants[n].detach())
        return out  # detached: ops write into buffers (out=) whether or not grad mode is on

    def _kv_geometry(self) -> tuple[int, int]:
        for n in self.trace.gm.graph.nodes:
            if n.op == "call_function" and same_callable(n.target, custom_ops.KV_APPEND):
                shape = example(n.args[0]).shape  # [1, Hkv, T, d]
                return int(shape[1]), int(shape[3])
        raise ConfigError("the traced model writes no KV cache: route its attention through "
                          "the frontend (hf.use_nanosched)")


def _check_attention(trace: Trace, model: torch.nn.Module) -> None:
    """A model whose attention is not the frontend's (HF's own: `use_nanosched` not called)
    writes no paged KV cache, and its mask tensors would meet the partition as a shape error:
    say what is missing before that."""
    if any(n.op == "call_function" and same_callable(n.target, custom_ops.KV_APPEND)
           for n in trace.gm.graph.nodes):
        return
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    have = f" (its attention implementation is {impl!r})" if impl else ""
    raise ConfigError(f"the traced model calls no frontend attention{have}: call "
                      f"nanosched.frontend.hf.use_nanosched(model) before FrontendModel(model, "
                      f"rules), or route its attention through nanosched.frontend.custom_ops")


def _flatten(x: Any) -> list[Any]:
    if isinstance(x, (tuple, list)):
        return [y for item in x for y in _flatten(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _flatten(item)]
    return [x]


__all__ = ["FrontendModel", "FrontendWorkspace", "rows", "token_rows"]
