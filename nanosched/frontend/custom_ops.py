"""The frontend's operators: the paged KV cache, attention and MoE experts of a traced model.

An unmodified model reaches the project's paged KV cache and kernels through the hooks its
library offers for this (HF transformers: the attention and experts interfaces, set by
`hf.use_nanosched`): those hooks call the `torch.ops.nanosched.*` operators below, which
TorchDynamo keeps as single nodes, so the partition can cut the graph at them.

More in docs/frontend.md, module notes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from nanosched.kernels import dispatch as K
from nanosched.kernels import reference as ref
from nanosched.kernels.dispatch import KernelOptions

Tensor = torch.Tensor


@dataclass
class SubgraphCall:
    """What the operators need to know about the subgraph call they run in."""

    kv: Any = None  # models.kvcache.KVCache
    meta: Any = None  # BatchMeta or BucketMeta of the whole batch
    start: int = 0
    end: int = 0
    launch: dict[str, Any] | None = None
    kernels: KernelOptions | None = None
    shift: int = 0  # added to the traced layer index (a traced layer bound to another)

    @property
    def active(self) -> bool:
        return self.kv is not None


CALL = SubgraphCall()


@contextmanager
def calling(kv: Any, meta: Any, start: int, end: int, launch: dict[str, Any] | None,
            kernels: KernelOptions, shift: int = 0) -> Iterator[None]:
    """Run a subgraph over rows [start, end) of the batch `meta` describes."""
    saved = (CALL.kv, CALL.meta, CALL.start, CALL.end, CALL.launch, CALL.kernels, CALL.shift)
    CALL.kv, CALL.meta, CALL.start, CALL.end = kv, meta, start, end
    CALL.launch, CALL.kernels, CALL.shift = launch, kernels, shift
    try:
        yield
    finally:
        (CALL.kv, CALL.meta, CALL.start, CALL.end, CALL.launch, CALL.kernels,
         CALL.shift) = saved


def _rows(x: Tensor) -> Tensor:
    """HF's [1, H, n, d] as [n, H, d] (a view)."""
    return x[0].transpose(0, 1)


@torch.library.custom_op("nanosched::kv_append", mutates_args="unknown")
def kv_append(key: Tensor, value: Tensor, layer: int) -> None:
    if not CALL.active:
        return
    r, kv = CALL.meta.slice(CALL.start, CALL.end), CALL.kv.layer(layer + CALL.shift)
    ref.append_kv(_rows(key), _rows(value), r.slot_mapping, kv.k, kv.v, **kv.scales)


@kv_append.register_fake
def _(key: Tensor, value: Tensor, layer: int) -> None:
    return None


@torch.library.custom_op("nanosched::attn_decode", mutates_args=("out",))
def attn_decode(query: Tensor, out: Tensor, layer: int, scale: float) -> None:
    if not CALL.active:
        return
    r = CALL.meta.slice(CALL.start, CALL.end)
    nd = r.num_decode
    if nd == 0:
        return
    tables, lens = r.decode_tables()
    kv = CALL.kv.layer(layer + CALL.shift)
    K.decode_attention(_rows(query)[:nd], kv.k, kv.v, tables, lens, r.max_decode_context, scale,
                       out[0, :nd], CALL.kernels, CALL.launch, **kv.scales)


@attn_decode.register_fake
def _(query: Tensor, out: Tensor, layer: int, scale: float) -> None:
    return None


@torch.library.custom_op("nanosched::attn_prefill", mutates_args=("out",))
def attn_prefill(query: Tensor, out: Tensor, layer: int, scale: float) -> None:
    if not CALL.active:
        return
    r = CALL.meta.slice(CALL.start, CALL.end)
    nd = r.num_decode
    if nd == CALL.end - CALL.start:
        return
    kv = CALL.kv.layer(layer + CALL.shift)
    K.prefill_attention(_rows(query)[nd:], kv.k, kv.v, r.prefill_block_tables(),
                        r.prefill_tensors(), scale, out[0, nd:], CALL.kernels, CALL.launch,
                        **kv.scales)


@attn_prefill.register_fake
def _(query: Tensor, out: Tensor, layer: int, scale: float) -> None:
    return None


@torch.library.custom_op("nanosched::experts_ug", mutates_args=("out",))
def experts_ug(x: Tensor, ids: Tensor, w: Tensor, out: Tensor) -> None:
    """out [n k, 2I] = x[t] @ w[ids[t, j]].T for each token t and choice j (token-major)."""
    if not CALL.active:
        return
    n, k = ids.shape
    x_rows = torch.arange(n, device=x.device).repeat_interleave(k)
    K.grouped_linear(x, w, ids.reshape(-1), x_rows, out, CALL.kernels, CALL.launch)


@experts_ug.register_fake
def _(x: Tensor, ids: Tensor, w: Tensor, out: Tensor) -> None:
    return None


@torch.library.custom_op("nanosched::experts_d", mutates_args=("out",))
def experts_d(act: Tensor, ids: Tensor, weights: Tensor, w: Tensor, out: Tensor) -> None:
    """out [n, D] = sum over j of weights[t, j] * act[t k + j] @ w[ids[t, j]].T."""
    if not CALL.active:
        return
    n, k = ids.shape
    rows = torch.empty((n * k, w.shape[1]), dtype=act.dtype, device=act.device)
    K.grouped_linear(act, w, ids.reshape(-1), None, rows, CALL.kernels, CALL.launch)
    weighted = rows.view(n, k, -1).float() * weights.view(n, k, 1).float()
    out.copy_(weighted.sum(dim=1))


@experts_d.register_fake
def _(act: Tensor, ids: Tensor, weights: Tensor, w: Tensor, out: Tensor) -> None:
    return None


KV_APPEND = torch.ops.nanosched.kv_append
ATTN_DECODE = torch.ops.nanosched.attn_decode
ATTN_PREFILL = torch.ops.nanosched.attn_prefill
EXPERTS_UG = torch.ops.nanosched.experts_ug
EXPERTS_D = torch.ops.nanosched.experts_d
LAYERED = (KV_APPEND, ATTN_DECODE, ATTN_PREFILL)  # operators whose int argument is the layer
