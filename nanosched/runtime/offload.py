"""KV offload to host memory: a preempted request's pages copied out, freed, and copied back.

`HostSwap` keeps, per swapped request, one host tensor per cache page tensor
(`KVCache.page_tensors()`, [L, n, ...] for its n written pages; FP8 ones as their bytes), so any
KV dtype and any scales move the same way. Host bytes in use never exceed `capacity_bytes`;
`fits` says whether a request would (the caller recomputes it instead when it does not).

More in docs/admission.md, module notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.kernels.common import host_to_device
from nanosched.models.kvcache import KVCache

# the GEMM rate the cost rule assumes when not told: a conservative bf16 rate on a Hopper GPU
# (bench passes the peak it measures), and a CPU's
DEFAULT_GPU_TFLOPS = 400.0
CPU_TFLOPS = 0.1


@dataclass(frozen=True)
class SwapCost:
    """What the swap-or-recompute rule needs: per token, the bytes of its KV on this GPU and the
    FLOPs of recomputing it (2 x active parameters / tp); per sequence of n tokens, causal
    attention adds 2 x layers x (local query heads x head dim) x n^2 FLOPs; the host link's
    bandwidth and the GEMM rate that recomputation runs at."""

    kv_bytes_per_token: int
    flops_per_token: float
    attn_flops_per_token2: float
    link_bytes_per_s: float
    flops_per_s: float

    def swap_s(self, tokens: int) -> float:
        """Seconds to copy `tokens` of KV out and back in over the host link."""
        return 2 * tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    def recompute_s(self, tokens: int) -> float:
        """Seconds of GEMM and attention to prefill `tokens` again."""
        flops = tokens * self.flops_per_token + tokens**2 * self.attn_flops_per_token2
        return flops / self.flops_per_s


def swap_cost(model: Any, kv: KVCache, link_gb_s: float,
              gemm_tflops: float | None = None) -> SwapCost:
    """The cost rule's figures for `model` (its spec and tp) and its cache."""
    spec, tp = model.spec, model.tp.size
    tflops = gemm_tflops or (DEFAULT_GPU_TFLOPS if kv.device.type == "cuda" else CPU_TFLOPS)
    return SwapCost(kv_bytes_per_token=kv.bytes_per_token,
                    flops_per_token=2 * spec.num_params(active=True) / tp,
                    attn_flops_per_token2=2 * spec.num_layers * spec.num_heads // tp *
                    spec.head_dim, link_bytes_per_s=link_gb_s * 1e9,
                    flops_per_s=tflops * 1e12)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or its bytes for an FP8 tensor (index_select / index_copy_ have no e4m3
    kernel on the CPU): a copy moves bytes either way."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def prefer_swap(tokens: int, cost: SwapCost) -> bool:
    """Swap when copying the request's KV out and back costs less time than recomputing it.

    Both sides are priced as if nothing overlapped them: the copies are charged twice the
    bytes over the host link, recomputation its FLOPs at the GEMM rate. The copies in fact run
    beside the forwards (only the swap-out's wait costs compute time), so the rule leans
    towards recompute. A request with nothing cached (`tokens` = 0) is recomputed.
    """
    return tokens > 0 and cost.swap_s(tokens) < cost.recompute_s(tokens)


@dataclass
class _Swapped:
    host: list[torch.Tensor]  # per page tensor [L, n, ...]: the request's n written pages
    length: int  # tokens of KV it holds
    nbytes: int


class HostSwap:
    """Host copies of swapped-out requests' KV pages (docs/admission.md)."""

    def __init__(self, kv: KVCache, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ConfigError(f"--swap-space must be >= 0, got {capacity_bytes} bytes")
        self.kv = kv
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.is_cuda = kv.device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(kv.device) if self.is_cuda else None
        self._held: dict[int, _Swapped] = {}
        self._arrivals: list[Any] = []  # swap-in copies the next forward must wait for

    def _bytes(self, length: int) -> int:
        pages = -(-length // self.kv.page_size)
        return pages * self.kv.page_size * self.kv.bytes_per_token

    def fits(self, length: int) -> bool:
        """Whether `length` more tokens of KV fit in the host budget."""
        return self.used_bytes + self._bytes(length) <= self.capacity_bytes

    def holds(self, request: int) -> bool:
        return request in self._held

    def length(self, request: int) -> int:
        """Tokens of KV held on the host for `request`."""
        return self._held[request].length

    def swap_out(self, request: int) -> None:
        """Copy `request`'s written pages to the host, then free its device pages."""
        kv = self.kv
        length = kv.length(request)
        pages = kv.tables.get(request, [])[: -(-length // kv.page_size)]
        tensors = [_raw(t) for t in kv.page_tensors()]
        host = [torch.empty((t.shape[0], len(pages), *t.shape[2:]), dtype=t.dtype,
                            pin_memory=self.is_cuda) for t in tensors]
        if self.is_cuda:
            compute = torch.cuda.current_stream(kv.device)
            with torch.cuda.stream(self._stream):
                self._stream.wait_stream(compute)
                index = host_to_device(pages, torch.int64, kv.device)
                for h, t in zip(host, tensors, strict=True):
                    h.copy_(t.index_select(1, index), non_blocking=True)
            compute.wait_stream(self._stream)  # freed pages are rewritten only after the copy
        else:
            index = torch.tensor(pages, dtype=torch.int64)
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t.index_select(1, index))
        kv.release(request)
        nbytes = self._bytes(length)
        self._held[request] = _Swapped(host, length, nbytes)
        self.used_bytes += nbytes

    def swap_in(self, request: int, min_tokens: int) -> None:
        """Allocate pages covering max(held tokens, `min_tokens`) and copy the request's KV back
        (on CUDA the copy is waited for by the forward after the next `begin_step()`)."""
        kv, s = self.kv, self._held.pop(request)
        self.used_bytes -= s.nbytes
        pages = kv.allocator.allocate(-(-max(s.length, min_tokens) // kv.page_size))
        kv.adopt(request, pages, s.length)
        n = s.host[0].shape[1]
        if self.is_cuda:
            compute = torch.cuda.current_stream(kv.device)
            with torch.cuda.stream(self._stream):
                self._stream.wait_stream(compute)
                index = host_to_device(pages[:n], torch.int64, kv.device)
                for h, t in zip(s.host, kv.page_tensors(), strict=True):
                    _raw(t).index_copy_(1, index, h.to(kv.device, non_blocking=True))
                done = torch.cuda.Event()
                done.record(self._stream)
            self._arrivals.append(done)
        else:
            index = torch.tensor(pages[:n], dtype=torch.int64)
            for h, t in zip(s.host, kv.page_tensors(), strict=True):
                _raw(t).index_copy_(1, index, h)

    def begin_step(self) -> None:
        """Make the compute stream wait for the swap-ins issued since the last call."""
        if self._arrivals:
            compute = torch.cuda.current_stream(self.kv.device)
            for event in self._arrivals:
                compute.wait_event(event)
            self._arrivals.clear()

    def drop(self, request: int) -> None:
        """Forget `request`'s host copy (it ended or was aborted while swapped out)."""
        s = self._held.pop(request, None)
        if s is not None:
            self.used_bytes -= s.nbytes
