"""All-reduce on the copy engines: peer copies between IPC-mapped buffers, flags written and
waited by stream memory operations, and one small SM reduction, pipelined in sub-chunks.

Why: NCCL's all-reduce runs in SM kernels, and beside a GEMM each of them waits for the GEMM's
waves to drain (4xH100, beside the Llama-3-70B tp = 4 `ug` GEMM: NCCL keeps 0.12-0.24 of its
speed). Copies on the copy engines keep 0.92-0.94 while the GEMM keeps 0.9 (DESIGN.md, third
round). So here the only SM work on the path is the reduction of one chunk, bounded to
`max_ctas` programs; every signal between ranks is a stream memory operation
(`cuStreamWriteValue32` to a peer's flag, `cuStreamWaitValue32` on one's own), never a kernel.

More in docs/design.md, module notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from nanosched.errors import ConfigError
from nanosched.kernels.ce_transports import Region

ALIGN_BYTES = 16  # chunk boundaries: a copy engine moves 16-byte-aligned chunks fastest
NUM_SLOTS = 4096  # flags per (kind, source rank): more than the all-reduces of any forward
READY, DONE = 0, 1
# sub-chunks of an owned chunk: one per SUBCHUNK_BYTES, at least 1, at most MAX_SUBCHUNKS. Each
# added sub-chunk costs its copies' fixed cost, more than the overlap of pulls and pushes saves:
# on 4xH100 whole chunks were fastest at 2 and 8 MiB (8 MiB: 300 us whole, 337 / 375 / 438 us in
# 2 / 4 / 8), so a chunk is split only from 32 MiB on, beyond any layer's all-reduce at tp >= 4
# (`ce_allreduce-NVIDIA_H100_80GB_HBM3-4gpu-20261127T100335.json`; bench/kernels/ce_allreduce.py
# --subchunks sweeps it)
SUBCHUNK_BYTES = 16 << 20
MAX_SUBCHUNKS = 4


def chunk_bounds(numel: int, itemsize: int, parts: int) -> list[int]:
    """Element offsets [b_0 = 0, ..., b_parts = numel] cutting `numel` elements into `parts`
    near-equal chunks whose starts are `ALIGN_BYTES`-aligned (given an aligned base)."""
    step = max(1, ALIGN_BYTES // itemsize)
    bounds = [min(numel, (numel * i // parts) // step * step) for i in range(parts)]
    return [*bounds, numel]


def subchunks_for(nbytes: int) -> int:
    """How many sub-chunks an owned chunk of `nbytes` is pipelined in (module constants)."""
    return max(1, min(MAX_SUBCHUNKS, nbytes // SUBCHUNK_BYTES))


def sub_ranges(lo: int, hi: int, itemsize: int, parts: int) -> list[tuple[int, int]]:
    """The non-empty sub-chunks [a, b) of elements [lo, hi), starts aligned as `lo` is."""
    b = [lo + x for x in chunk_bounds(hi - lo, itemsize, parts)]
    return [(x, y) for x, y in zip(b, b[1:], strict=False) if y > x]


class Transport(Protocol):
    """The primitive steps, on streams (CUDA) or at once (host)."""

    def share(self, t: torch.Tensor, group: Any) -> Region: ...
    def streams(self, peers: list[int]) -> tuple[Any, list[Any], list[Any]]: ...
    def fork(self, src: Any, dst: Any) -> None: ...
    def write_flag(self, stream: Any, addr: int) -> None: ...
    def wait_flag(self, stream: Any, addr: int) -> None: ...
    def copy(self, stream: Any, dst: int, src: int, nbytes: int) -> None: ...


@dataclass
class CopyEngineAllReduce:
    """The all-reduce of one process group (see the module docstring).

    `symmetric_zeros` allocates a buffer that `all_reduce` can reduce in (every rank must
    allocate the same buffers in the same order: it exchanges addresses); `holds(x)` says
    whether x lies in one. `reduce` is the SM step: reduce(x_chunk [n], scratch [N-1, n],
    max_ctas) adds the rows into x_chunk in place. `num_subchunks`: the sub-chunk count of
    every call (None: `subchunks_for` the owned chunk's size). `one_stream`: every call's steps
    on the caller's stream alone (module docstring).
    """

    rank: int
    size: int
    group: Any
    transport: Transport
    reduce: Any
    device: torch.device
    num_slots: int = NUM_SLOTS
    num_subchunks: int | None = None
    one_stream: bool = False
    regions: list[Region] = field(default_factory=list)
    _flags: Region | None = None
    _scratch: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    _next_slot: int = 0

    def __post_init__(self) -> None:
        flags = self._alloc(torch.int32, 2 * self.num_slots * self.size)
        self._flags = self.transport.share(flags, self.group)
        self._keep = [flags]

    def _alloc(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        alloc = getattr(self.transport, "zeros", None)
        if alloc is not None:
            return alloc(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def symmetric_zeros(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed buffer of `shape` that all-reduces run in (collective: every rank calls)."""
        numel = 1
        for s in shape:
            numel *= s
        t = self._alloc(dtype, numel)
        self.regions.append(self.transport.share(t, self.group))
        self._keep.append(t)
        width = -(-numel // self.size) + ALIGN_BYTES  # a chunk's elements, at most
        old = self._scratch.get(dtype)
        if old is None or old.shape[1] < width:
            self._scratch[dtype] = torch.empty(self.size - 1, width, dtype=dtype,
                                               device=self.device)
        return t.view(shape)

    def holds(self, x: torch.Tensor) -> bool:
        return self._region(x) is not None

    def _region(self, x: torch.Tensor) -> Region | None:
        nbytes = x.numel() * x.element_size()
        return next((r for r in self.regions if r.holds(x.data_ptr(), nbytes)), None)

    def _flag(self, owner_ptr: int, kind: int, slot: int, src: int) -> int:
        return owner_ptr + 4 * ((kind * self.num_slots + slot) * self.size + src)

    def _take_slot(self) -> int:
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.num_slots
        return slot

    def all_reduce(self, x: torch.Tensor, max_ctas: int | None = None,
                   num_subchunks: int | None = None, one_stream: bool | None = None) -> None:
        """Sum `x` over the group in place, on the transport's streams (CUDA: forked from the
        current stream and joined back into it). `num_subchunks` and `one_stream` override the
        instance's (one stream: whole chunks, nothing forked)."""
        region = self._region(x)
        if region is None or not x.is_contiguous():
            raise ConfigError("copy-engine all-reduce: the tensor is not a contiguous view of a "
                              "buffer from symmetric_zeros (allocate it there, or use nccl)")
        parts = num_subchunks or self.num_subchunks
        if parts is not None and parts < 1:
            raise ConfigError(f"copy-engine all-reduce: num_subchunks must be >= 1, got {parts}")
        slot, r, item = self._take_slot(), self.rank, x.element_size()
        bounds = chunk_bounds(x.numel(), item, self.size)
        lo, hi = bounds[r], bounds[r + 1]
        subs = sub_ranges(lo, hi, item, parts or subchunks_for((hi - lo) * item))
        peers = [q for q in range(self.size) if q != r]
        s, pulls, pushes = self.transport.streams(peers)
        tr, flags, base = self.transport, self._flags, x.data_ptr() - region.ptr
        mine = [region.peer_ptrs[q] + base for q in peers]  # x_q, seen from here
        if self.one_stream if one_stream is None else one_stream:
            self._on_one_stream(x, s, slot, peers, mine, lo, hi, max_ctas)
            return
        for q in peers:  # 1. x_r is ready
            tr.write_flag(s, self._flag(flags.peer_ptrs[q], READY, slot, r))
        for i, q in enumerate(peers):  # 2. once q's x is ready, pull from it
            tr.fork(s, pulls[i])
            tr.wait_flag(pulls[i], self._flag(flags.ptr, READY, slot, q))
        scratch, flat = self._scratch[x.dtype], x.view(-1)
        for a, b in subs:
            for i in range(len(peers)):  # 2. pull s_j
                tr.copy(pulls[i], scratch[i, a - lo:].data_ptr(), mine[i] + a * item,
                        (b - a) * item)
                tr.fork(pulls[i], s)
            self.reduce(flat[a:b], scratch[:, a - lo:b - lo], max_ctas)  # 3.
            for i in range(len(peers)):  # 4. push s_j
                tr.fork(s, pushes[i])
                tr.copy(pushes[i], mine[i] + a * item, flat[a:].data_ptr(), (b - a) * item)
        for i, q in enumerate(peers):  # 5. (D_q forked from S after P_q joined it)
            if not subs:  # nothing to pull, reduce or push: order the reset before done
                tr.fork(pulls[i], s)
                tr.fork(s, pushes[i])
            tr.write_flag(pushes[i], self._flag(flags.peer_ptrs[q], DONE, slot, r))
            tr.fork(pushes[i], s)
        for q in peers:  # every chunk is here
            tr.wait_flag(s, self._flag(flags.ptr, DONE, slot, q))

    def _on_one_stream(self, x: torch.Tensor, s: Any, slot: int, peers: list[int],
                       mine: list[int], lo: int, hi: int, max_ctas: int | None) -> None:
        """The steps of `all_reduce` in order on S: each wait resets its flag on S before S
        writes anything the flag's writer waits for, as the side streams' joins ensure there."""
        tr, flags, r, item = self.transport, self._flags, self.rank, x.element_size()
        scratch, flat, nbytes = self._scratch[x.dtype], x.view(-1), (hi - lo) * item
        for q in peers:  # 1. x_r is ready
            tr.write_flag(s, self._flag(flags.peer_ptrs[q], READY, slot, r))
        for q in peers:
            tr.wait_flag(s, self._flag(flags.ptr, READY, slot, q))
        if nbytes:
            for i in range(len(peers)):  # 2. pull the owned chunk from every peer
                tr.copy(s, scratch[i].data_ptr(), mine[i] + lo * item, nbytes)
            self.reduce(flat[lo:hi], scratch[:, :hi - lo], max_ctas)  # 3.
            for i in range(len(peers)):  # 4. push it back
                tr.copy(s, mine[i] + lo * item, flat[lo:].data_ptr(), nbytes)
        for q in peers:  # 5.
            tr.write_flag(s, self._flag(flags.peer_ptrs[q], DONE, slot, r))
        for q in peers:
            tr.wait_flag(s, self._flag(flags.ptr, DONE, slot, q))


def reduce_reference(x: torch.Tensor, scratch: torch.Tensor, max_ctas: int | None = None) -> None:
    """x += the rows of scratch, in fp32 (the torch twin of the Triton reduction)."""
    x.copy_((x.float() + scratch.float().sum(0)).to(x.dtype))


def make_all_reduce(rank: int, size: int, group: Any, device: torch.device) -> CopyEngineAllReduce:
    """The copy-engine all-reduce of this rank: CUDA transport and the Triton reduction on a
    GPU, the host transport and the torch reduction on the CPU (tests over gloo)."""
    from nanosched.kernels.ce_transports import CudaTransport, HostTransport

    if device.type == "cuda":
        from nanosched.kernels.reduce_sum import reduce_rows

        return CopyEngineAllReduce(rank, size, group, CudaTransport(device, size - 1),
                                   reduce_rows, device)
    return CopyEngineAllReduce(rank, size, group, HostTransport(rank, size), reduce_reference,
                               device)
