"""Profiling and searching a frontend model: its own ops, measured and priced like named ones.

`model_spec(fm, name)` is the `ModelSpec` a profile records for the model and the search
prices it with, read off the partition (hidden size, heads, KV heads, head dim, the FFN's
width at `act`, vocabulary, layers; experts and positions from the model's config). The
search's op graph is the named-op layer's (autosearch/opgraph.py), so the partition must name
exactly those ops in that order (`llama_rules()` and the GPT-2 rules of docs/usage.md do); an
ungated FFN (GPT-2's) is priced by the cost model as a gated one of the same width, while
every duration the search uses is a measured row.

More in docs/frontend.md, module notes.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from nanosched.constants import PAGE_SIZE
from nanosched.errors import ConfigError
from nanosched.frontend import custom_ops
from nanosched.frontend.program import runner
from nanosched.frontend.rules import same_callable
from nanosched.kernels.impls import cublaslt_missing, persistent_name
from nanosched.models import ops as optable
from nanosched.models.ops import layer_ops
from nanosched.models.spec import ModelSpec
from nanosched.profiler.impl_registry import (
    Impl,
    Kernel,
    OpCall,
    available_in,
    launch_of,
    triton_missing,
)
from nanosched.profiler.impls_kernels import SM_MECHANISMS, prefill_rows
from nanosched.profiler.plan import ImplInfo

BOUNDED = ("full", "green_ctx", "cta_bound")


def model_spec(fm: Any, name: str) -> ModelSpec:
    """The shapes of frontend model `fm` as a `ModelSpec` (module docstring)."""
    query = _operand(fm, custom_ops.ATTN_DECODE, 0)  # [1, Hq, T, d]
    key = _operand(fm, custom_ops.KV_APPEND, 0)  # [1, Hkv, T, d]
    hidden = fm.values[fm.head.reads()[0]].sizes[-1]
    vocab = int(next(n for n in fm.head.sub.returns).meta["example_value"].shape[-1])
    act = next(s for s in fm.steps if s.sub.group.op == optable.ACT)
    cfg = getattr(fm.model, "config", None)
    experts = int(getattr(cfg, "num_local_experts", 0) or 0)
    spec = ModelSpec(
        name=name, arch="mixtral" if experts else "llama", hidden_size=hidden,
        num_layers=fm.num_layers, num_heads=int(query.shape[1]),
        num_kv_heads=int(key.shape[1]), head_dim=int(query.shape[3]),
        intermediate_size=fm.values[act.value_id(act.sub.outputs[0])].sizes[-1],
        vocab_size=vocab,
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096) or 4096),
        num_experts=experts,
        num_experts_per_tok=int(getattr(cfg, "num_experts_per_tok", 0) or 0) if experts else 0,
        dtype_bytes=fm.dtype.itemsize)
    want = [op.name for op in layer_ops(spec, 1)]
    if fm.op_names() != want:
        raise ConfigError(f"the partition's layer is {fm.op_names()}; profiles and the search "
                          f"take the named-op layer {want}: name the ops so (docs/usage.md)")
    return spec


def _operand(fm: Any, op: Any, index: int) -> torch.Tensor:
    for n in fm.trace.gm.graph.nodes:
        if n.op == "call_function" and same_callable(n.target, op):
            return n.args[index].meta["example_value"]
    raise ConfigError("the traced model calls no frontend attention: run hf.use_nanosched "
                      "on it (or route its attention through nanosched.frontend.custom_ops)")


class _Launch:
    """A launch dict where the frontend's run expects a LaunchConfig."""

    def __init__(self, launch: dict[str, Any]) -> None:
        self.launch = launch

    def launch_dict(self, op: str) -> dict[str, Any]:
        return self.launch


class FrontendImpls:
    """The profiler's implementation registry for one frontend model (module docstring)."""

    def __init__(self, fm: Any) -> None:
        self.fm = fm
        self.steps = {s.sub.group.op: s for s in fm.steps if s.layer == 0}
        self.table = {op: self._impls(op) for op in fm.op_names()}
        self._ws: Any = None
        self._next_request = 0

    def _impls(self, op: str) -> list[Impl]:
        setup = self._setup
        family = optable.OP_FAMILY.get(op)
        if family == optable.GEMM:
            return [Impl("cublas", SM_MECHANISMS, setup),
                    Impl("cublaslt", SM_MECHANISMS, setup, targets_sms=True,
                         requires=cublaslt_missing),
                    Impl(persistent_name(128, 128), SM_MECHANISMS, setup, targets_sms=True,
                         requires=triton_missing)]
        if family in (optable.GROUPED, optable.PREFILL):
            return [Impl("triton", SM_MECHANISMS, setup, requires=triton_missing),
                    Impl("torch", SM_MECHANISMS, setup)]
        if family == optable.DECODE:
            return [Impl("triton_pipelined", BOUNDED, setup, requires=triton_missing),
                    Impl("triton_paged", BOUNDED, setup, quick=False, requires=triton_missing),
                    Impl("torch", SM_MECHANISMS, setup, quick=False)]
        return [Impl("torch", SM_MECHANISMS, setup)]  # the model's own torch code

    # ---- the registry's functions ------------------------------------------------------------
    def available(self, ops_: list[str]) -> tuple[dict[str, list[ImplInfo]], list[str]]:
        return available_in(self.table, ops_)

    def get(self, op: str, name: str) -> Impl:
        for impl in self.table.get(op, []):
            if impl.name == name:
                return impl
        raise KeyError(f"no implementation {name!r} of the frontend's op {op!r}")

    def layer_kernels(self, calls: list[tuple[OpCall, str]]) -> list[Kernel]:
        """A layer's ops in order over one batch of its mix (decode rows with their context,
        prompt rows), each reading what the op before it wrote."""
        decode = next((c for c, _ in calls if c.op == optable.ATTN_DECODE), None)
        prefill = next((c for c, _ in calls if c.op == optable.ATTN_PREFILL), None)
        rows = max(c.tokens for c, _ in calls)
        ws, meta = self._batch(rows, decode.tokens if decode else 0,
                               decode.context if decode else 0,
                               prefill.context if prefill else rows, calls[0][0])
        kernels = []
        for call, name in calls:
            run, cfg = runner(self.fm, self.steps[call.op], ws, meta), _Launch(
                launch_of(call, name))
            kernels.append(Kernel(lambda run=run, cfg=cfg: run(0, rows, cfg)))
        return kernels

    # ---- setting a row up --------------------------------------------------------------------
    def _setup(self, call: OpCall, launch: dict[str, Any]) -> Kernel:
        if call.op == optable.ATTN_DECODE:
            ws, meta = self._batch(call.tokens, call.tokens, call.context, 0, call)
        elif call.op == optable.ATTN_PREFILL:
            ws, meta = self._batch(call.tokens, 0, 0, call.context, call)
        else:
            ws, meta = self._batch(call.tokens, 0, 0, call.tokens, call)
        run, cfg, t = runner(self.fm, self.steps[call.op], ws, meta), _Launch(launch), call.tokens
        return Kernel(lambda: run(0, t, cfg))

    def _batch(self, rows: int, num_decode: int, context: int, prompt: int,
               call: OpCall) -> tuple[Any, Any]:
        """A workspace and the metadata of `num_decode` decode rows (each after `context - 1`
        cached tokens), then `rows - num_decode` prompt rows cut from prompts of `prompt`."""
        segments = prefill_rows(rows - num_decode, prompt) if rows > num_decode else []
        pages = num_decode * math.ceil(max(context, 1) / PAGE_SIZE) + sum(
            math.ceil((e - s + p) / PAGE_SIZE) for s, e, p in segments) + 8
        ws = self._workspace(max(rows, call.max_tokens), pages, call.kv_dtype)
        for r in list(ws.kv.tables):
            ws.kv.release(r)
        first, chunks = self._next_request, []
        for i in range(num_decode):
            if context > 1:
                ws.kv.plan([(first + i, context - 1, False)])
            chunks.append((first + i, 1, True))
        for j, (s, e, p) in enumerate(segments):
            if p:
                ws.kv.plan([(first + num_decode + j, p, False)])
            chunks.append((first + num_decode + j, e - s, False))
        self._next_request += len(chunks)
        meta = ws.kv.plan(chunks)
        meta.prefill_tensors()  # on the device now: a launch (or a graph capture) copies nothing
        return ws, meta

    def _workspace(self, max_tokens: int, pages: int, kv_dtype: str) -> Any:
        ws = self._ws
        if ws is None or ws.max_tokens < max_tokens or ws.kv.allocator.num_pages < pages or \
                ws.kv.kv_dtype != kv_dtype:
            self._ws = None
            if self.fm.device.type == "cuda":
                torch.cuda.empty_cache()
            grown = 2 * ws.kv.allocator.num_pages if ws is not None else 0
            ws = self.fm.new_workspace(max_tokens, max(pages, grown), kv_dtype=kv_dtype,
                                       kv_layers=1)
            g = torch.Generator(self.fm.device).manual_seed(0)
            for buf in ws.buffers.values():
                if buf.is_floating_point():
                    buf.normal_(generator=g)
            ws.kv.fill_random(g)
            self._ws = ws
        return ws


def load_frontend(target: str, device: str) -> Any:
    """`FILE.py:NAME` → `NAME(device)` from that file: the user's function that builds a
    frontend model on `device` (what `nanosched profile --frontend` measures).

    The user's code failing is no bug of nanosched: an exception (or `sys.exit`) while FILE
    is imported or NAME runs is a `ConfigError` naming the flag, the exception and the line of
    FILE it came from (exit 2), not a traceback with exit 1."""
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    from nanosched.frontend.model import FrontendModel

    path, _, name = target.rpartition(":")
    if not path or not name:
        raise ConfigError(f"--frontend {target!r}: give FILE.py:FUNCTION")
    if not Path(path).is_file():
        raise ConfigError(f"--frontend {target!r}: no file {path}")
    if Path(path).suffix != ".py":
        raise ConfigError(f"--frontend {target!r}: {path} is not a Python file: give "
                          f"FILE.py:FUNCTION")
    loader = importlib.machinery.SourceFileLoader(f"_frontend_{Path(path).stem}", path)
    module_spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(module_spec)
    with user_code(target, path, f"importing {path}"):
        loader.exec_module(module)
    build = getattr(module, name, None)
    if not callable(build):
        raise ConfigError(f"--frontend {target!r}: {path} has no function {name}")
    with user_code(target, path, f"{name}(device)"):
        fm = build(device)
    if not isinstance(fm, FrontendModel):
        raise ConfigError(f"--frontend {target!r}: {name}(device) returned a "
                          f"{type(fm).__name__}, not a nanosched.frontend.FrontendModel")
    return fm


@contextlib.contextmanager
def user_code(target: str, path: str, what: str) -> Iterator[None]:
    """Run the user's code of `--frontend target`: its failure named as the user's (above).
    A `ConfigError` raised by nanosched's own frontend (a rule that matches nothing, ...) is
    said as it is; Ctrl-C stays Ctrl-C."""
    import traceback

    try:
        yield
    except (ConfigError, KeyboardInterrupt):
        raise
    except SystemExit as exc:
        raise ConfigError(f"--frontend {target!r}: {what} called sys.exit({exc.code!r}); "
                          f"the build function must return a FrontendModel") from None
    except Exception as exc:
        mine = os.path.realpath(path)
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if os.path.realpath(f.filename) == mine]
        where = f" at {path}, line {frames[-1].lineno}" if frames else ""
        text = " ".join(str(exc).split())[:300]
        raise ConfigError(f"--frontend {target!r}: {what} raised {type(exc).__name__}: "
                          f"{text}{where} (an error of the build function, not of nanosched)"
                          ) from None
