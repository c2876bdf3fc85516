"""Tensor parallelism: which slice of each weight a rank holds, and its collectives.

Megatron-style sharding, applied when weights are created or loaded (model code only sees local
shapes): the QKV and gate/up projections are column-parallel (a rank holds Hq/tp query heads,
Hkv/tp KV heads, I/tp intermediate rows), O and down are row-parallel (partial sums, all-reduced
by the `ar_attn` / `ar_ffn` ops), the embedding and LM head are vocab-parallel (ceil(V/tp) rows
per rank, zero-padded at the end). With tp > Hkv each KV head is replicated on tp/Hkv ranks.

All-reduces run on NCCL (the group's backend: gloo on the CPU), optionally on a group whose NCCL
kernels are bounded to k CTAs, or on the copy engines (kernels/ce_allreduce.py) for tensors in
the buffers `symmetric_zeros` allocated (`with_copy_engine` sets that up, collectively).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing

from nanosched.errors import ConfigError
from nanosched.kernels.impls import network_impl
from nanosched.models.spec import ModelSpec


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (rank 0 of 1 without one)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None = the default group
    copy_engine: Any = None  # kernels.ce_allreduce.CopyEngineAllReduce, or None
    _bounded: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)

    def with_copy_engine(self, device: torch.device) -> TensorParallel:
        """This group with a copy-engine all-reduce (collective: every rank calls it)."""
        if self.size == 1 or self.copy_engine is not None:
            return self
        from nanosched.kernels.ce_allreduce import make_all_reduce

        return replace(self, copy_engine=make_all_reduce(self.rank, self.size, self.group,
                                                         torch.device(device)))

    def symmetric_zeros(self, *shape: int, dtype: torch.dtype,
                        device: torch.device | str) -> torch.Tensor:
        """A zeroed buffer the copy-engine all-reduce can run in (plain memory without one;
        collective when there is one: every rank allocates the same buffers in order)."""
        if self.copy_engine is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        return self.copy_engine.symmetric_zeros(*shape, dtype=dtype)

    def barrier(self) -> None:
        """Return once every rank of the group has come here (nothing to wait for alone)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def all_reduce(self, x: torch.Tensor, impl: str | None = None,
                   max_ctas: int | None = None) -> None:
        """Sum `x` over the group in place (nothing at tp = 1). `impl`: a network
        implementation of kernels/impls.py (None: nccl); its CTA bound, or `max_ctas`, bounds
        NCCL's kernels or the copy engine's reduction."""
        if self.size == 1:
            return
        kind, ctas = network_impl(impl, max_ctas)
        if kind == "copy_engine":
            if self.copy_engine is None:
                raise ConfigError("the copy-engine all-reduce was asked for, but this engine "
                                  "was started without it (--collective copy_engine)")
            self.copy_engine.all_reduce(x, max_ctas=ctas)
        else:
            dist.all_reduce(x, group=self._nccl_group(ctas))

    def _nccl_group(self, ctas: int | None) -> Any:
        """The group, or (NCCL only) a group over the same ranks whose kernels use at most
        `ctas` CTAs, made at its first use (every rank reaches it at the same op)."""
        if ctas is None or dist.get_backend(self.group) != "nccl":
            return self.group
        if ctas not in self._bounded:
            opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
            opts.config.max_ctas = ctas
            ranks = dist.get_process_group_ranks(self.group) if self.group else None
            self._bounded[ctas] = dist.new_group(ranks, backend="nccl", pg_options=opts)
        return self._bounded[ctas]

    def broadcast(self, x: torch.Tensor, src: int = 0) -> None:
        """Overwrite `x` on every rank with rank `src`'s `x` (nothing at tp = 1)."""
        if self.size > 1:
            dist.broadcast(x, src, group=self.group)

    def agree_min(self, value: int) -> int:
        """The least of every rank's `value` (a setting all ranks must share, e.g. how many KV
        pages fit on the fullest GPU); `value` itself at tp = 1."""
        if self.size == 1:
            return value
        on_gpu = dist.get_backend(self.group) == "nccl"
        t = torch.tensor([value], dtype=torch.int64,
                         device=torch.cuda.current_device() if on_gpu else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """[n, c] on every rank → [n, size * c], rank r's columns at r*c.. (x itself at tp=1)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


@dataclass(frozen=True)
class LocalShapes:
    """Sizes and offsets of one rank's shards (offsets index the full, unsharded tensors)."""

    num_heads: int  # Hq / tp
    num_kv_heads: int  # max(1, Hkv / tp)
    head_dim: int
    q_head_start: int
    kv_head_start: int
    intermediate: int  # I / tp
    inter_start: int
    vocab: int  # ceil(V / tp), padded
    vocab_start: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size


def local_shapes(spec: ModelSpec, tp: TensorParallel) -> LocalShapes:
    """The shard geometry of rank `tp.rank` of `tp.size` (spec.check_tp must pass first)."""
    spec.check_tp(tp.size)
    heads = spec.num_heads // tp.size
    if spec.num_kv_heads >= tp.size:
        kv_heads = spec.num_kv_heads // tp.size
        kv_start = tp.rank * kv_heads
    else:  # replicate: ranks r*(tp/Hkv) .. share KV head r
        kv_heads = 1
        kv_start = tp.rank // (tp.size // spec.num_kv_heads)
    inter = spec.intermediate_size // tp.size
    vocab = -(-spec.vocab_size // tp.size)
    return LocalShapes(num_heads=heads, num_kv_heads=kv_heads, head_dim=spec.head_dim,
                       q_head_start=tp.rank * heads, kv_head_start=kv_start,
                       intermediate=inter, inter_start=tp.rank * inter, vocab=vocab,
                       vocab_start=tp.rank * vocab)


def launch(fn: Callable[..., Any], size: int, backend: str, *args: Any) -> Any:
    """Run `fn(tp, *args)` in `size` spawned processes of one group; return rank 0's result.

    backend "gloo" (CPU) or "nccl" (one GPU per rank: cuda:rank is bound before `fn` runs).
    `fn` and its arguments must be picklable (module-level functions, plain data).
    """
    queue = mp.get_context("spawn").SimpleQueue()
    procs = torch.multiprocessing.spawn(
        _entry, args=(size, backend, free_port(), fn, args, queue), nprocs=size, join=False)
    results = []
    while not procs.join(timeout=0.05):  # raises if a rank fails
        if not results and not queue.empty():  # read while rank 0 may block on a full pipe
            results.append(queue.get())
    return results[0] if results else queue.get()


def _entry(rank: int, size: int, backend: str, port: int, fn: Callable[..., Any],
           args: tuple, queue: Any) -> None:
    from nanosched.kernels.common import bind_device

    device = torch.device("cuda", rank) if backend == "nccl" else None
    if device is not None:
        bind_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, device_id=device)
    try:
        result = fn(TensorParallel(rank, size), *args)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
