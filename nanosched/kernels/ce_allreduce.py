"""All-reduce on the copy engines: peer copies between IPC-mapped buffers, flags written and
waited by stream memory operations, and one small SM reduction.

Why: NCCL's all-reduce runs in SM kernels, and beside a GEMM each of them waits for the GEMM's
waves to drain (4xH100, beside the Llama-3-70B tp = 4 `ug` GEMM: NCCL keeps 0.12-0.24 of its
speed). Copies on the copy engines keep 0.92-0.94 while the GEMM keeps 0.9 (DESIGN.md, third
round). So here the only SM work on the path is the reduction of one chunk, bounded to
`max_ctas` programs; every signal between ranks is a stream memory operation
(`cuStreamWriteValue32` to a peer's flag, `cuStreamWaitValue32` on one's own), never a kernel.

The algorithm, for `x` (a contiguous tensor inside a registered buffer, at the same offset on
every rank) on rank r of N, its elements cut into N chunks c_0..c_{N-1} (16-byte aligned):
1. on the caller's stream S: tell every peer q that x_r is ready (write 1 to q's ready flag of
   this slot, source r);
2. on copy stream C_q per peer: wait for q's ready flag, reset it, copy x_q[c_r] (q's memory)
   into scratch row q (pull: our copy engine reads over NVLink);
3. on S: x_r[c_r] += sum of the scratch rows (the reduction, fp32 accumulate, `max_ctas`);
4. on C_q: copy x_r[c_r] into x_q[c_r] (push) and write 1 to q's done flag (source r);
5. on S: join the C_q, wait for every peer's done flag and reset it. x_r holds the sum.
Each chunk is reduced once, by its owner, and copied out: every rank ends bitwise equal.

Ordering. The memory operations' default write carries a fence, so a flag is seen only after
the copies before it on its stream. x_q[c_r] is overwritten only by r's own push, after r
pulled it, and q writes x again (the next layer) only after this all-reduce completed on q,
which needs r's done flag. The copy streams are shared by all calls in order, so a pull of call
k runs after the push of call k-1, which waited for k-1's reduction: one scratch suffices.
Flags are indexed by a slot that a per-process counter gives each call (modulo
`num_slots`); every rank issues its all-reduces in the same order (they run the same program),
so a call has the same slot everywhere. A slot's flags are reset by their reader before the
reader sends anything its writer must wait for before writing them again (the reset of a ready
flag precedes, on C_q, the done flag sent after the pull; the reset of a done flag precedes, on
S, the next ready), so back-to-back calls, CUDA-graph replays of the same call included, may
reuse a slot; only calls in flight at once need different slots, which holds while fewer than
`num_slots` all-reduces are issued per forward.

Everything is capturable in a CUDA graph: copies, memory operations and events on streams
forked from S and joined back into it.

Two transports run the same steps: `CudaTransport` (cuda-bindings' driver API: IPC handles,
`cuMemcpyAsync` with unified addressing, stream memory operations) and `HostTransport` (CPU
processes: shared memory, host copies and spinning waits), so that the slot, chunk and flag
logic is tested on the CPU over gloo.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nanosched.errors import ConfigError

ALIGN_BYTES = 16  # chunk boundaries: a copy engine moves 16-byte-aligned chunks fastest
NUM_SLOTS = 4096  # flags per (kind, source rank): more than the all-reduces of any forward
READY, DONE = 0, 1
HOST_WAIT_TIMEOUT_S = 60.0


def chunk_bounds(numel: int, itemsize: int, parts: int) -> list[int]:
    """Element offsets [b_0 = 0, ..., b_parts = numel] cutting `numel` elements into `parts`
    near-equal chunks whose starts are `ALIGN_BYTES`-aligned (given an aligned base)."""
    step = max(1, ALIGN_BYTES // itemsize)
    bounds = [min(numel, (numel * i // parts) // step * step) for i in range(parts)]
    return [*bounds, numel]


@dataclass
class Region:
    """A registered buffer: its local address and size, and each rank's address of it as seen
    from this process (index = rank; the local one at this rank)."""

    ptr: int
    nbytes: int
    peer_ptrs: list[int]

    def holds(self, ptr: int, nbytes: int) -> bool:
        return self.ptr <= ptr and ptr + nbytes <= self.ptr + self.nbytes


class Transport(Protocol):
    """The primitive steps, on streams (CUDA) or at once (host)."""

    def share(self, t: torch.Tensor, group: Any) -> Region: ...
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
    max_ctas) adds the rows into x_chunk in place.
    """

    rank: int
    size: int
    group: Any
    transport: Transport
    reduce: Any
    device: torch.device
    num_slots: int = NUM_SLOTS
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

    def all_reduce(self, x: torch.Tensor, max_ctas: int | None = None,
                   streams: tuple[Any, Any] | None = None) -> None:
        """Sum `x` over the group in place. `streams` = (S, [C_q per peer]) for the CUDA
        transport (default: the current stream and the transport's copy streams)."""
        region = self._region(x)
        if region is None or not x.is_contiguous():
            raise ConfigError("copy-engine all-reduce: the tensor is not a contiguous view of a "
                              "buffer from symmetric_zeros (allocate it there, or use nccl)")
        scratch = self._scratch[x.dtype]  # a region of x's dtype made it
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.num_slots
        r, size, item = self.rank, self.size, x.element_size()
        offset = x.data_ptr() - region.ptr
        bounds = chunk_bounds(x.numel(), item, size)
        lo, hi = bounds[r], bounds[r + 1]
        peers = [q for q in range(size) if q != r]
        s, copy_streams = streams or self.transport.streams(peers)
        flags = self._flags
        for q in peers:  # 1. x_r is ready
            self.transport.write_flag(s, self._flag(flags.peer_ptrs[q], READY, slot, r))
        for i, q in enumerate(peers):  # 2. pull x_q[c_r]
            c = copy_streams[i]
            self.transport.fork(s, c)
            self.transport.wait_flag(c, self._flag(flags.ptr, READY, slot, q))
            if hi > lo:
                self.transport.copy(c, scratch[i].data_ptr(),
                                    region.peer_ptrs[q] + offset + lo * item, (hi - lo) * item)
            self.transport.fork(c, s)
        flat = x.view(-1)
        if hi > lo:  # 3. reduce our chunk
            self.reduce(flat[lo:hi], scratch[:, : hi - lo], max_ctas)
        for i, q in enumerate(peers):  # 4. push it, then say so
            c = copy_streams[i]
            self.transport.fork(s, c)
            if hi > lo:
                self.transport.copy(c, region.peer_ptrs[q] + offset + lo * item,
                                    flat[lo:].data_ptr(), (hi - lo) * item)
            self.transport.write_flag(c, self._flag(flags.peer_ptrs[q], DONE, slot, r))
            self.transport.fork(c, s)
        for q in peers:  # 5. every chunk is here
            self.transport.wait_flag(s, self._flag(flags.ptr, DONE, slot, q))


def reduce_reference(x: torch.Tensor, scratch: torch.Tensor, max_ctas: int | None = None) -> None:
    """x += the rows of scratch, in fp32 (the torch twin of the Triton reduction)."""
    x.copy_((x.float() + scratch.float().sum(0)).to(x.dtype))


def _gather(obj: Any, size: int, group: Any) -> list[Any]:
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


class HostTransport:
    """CPU processes: buffers in POSIX shared memory, each rank's mapped in every process (and
    unlinked once all have mapped it, so nothing outlives the processes); copies and flag writes
    happen at once, a wait spins until the flag is 1 (then resets it)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self._owned: dict[int, Any] = {}  # address -> the SharedMemory this process created
        self._views: list[torch.Tensor] = []  # keep the peers' mappings alive
        self._shms: list[Any] = []

    def _map(self, shm: Any, nbytes: int) -> torch.Tensor:
        self._shms.append(shm)
        return torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        from multiprocessing import shared_memory

        nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
        shm = shared_memory.SharedMemory(create=True, size=nbytes)
        t = self._map(shm, nbytes).view(dtype)[:numel]
        t.zero_()
        self._owned[t.data_ptr()] = shm
        return t

    def share(self, t: torch.Tensor, group: Any) -> Region:
        from multiprocessing import resource_tracker, shared_memory

        nbytes = t.numel() * t.element_size()
        ptrs = []
        for q, name in enumerate(_gather(self._owned[t.data_ptr()].name, self.size, group)):
            if q == self.rank:
                ptrs.append(t.data_ptr())
                continue
            shm = shared_memory.SharedMemory(name=name)
            resource_tracker.unregister(shm._name, "shared_memory")  # its owner unlinks it
            view = self._map(shm, nbytes)
            self._views.append(view)
            ptrs.append(view.data_ptr())
        dist.barrier(group)  # every rank has mapped every buffer: the names can go
        self._owned[t.data_ptr()].unlink()
        return Region(t.data_ptr(), nbytes, ptrs)

    def streams(self, peers: list[int]) -> tuple[None, list[None]]:
        return None, [None] * len(peers)

    def fork(self, src: Any, dst: Any) -> None:
        return None

    def write_flag(self, stream: Any, addr: int) -> None:
        ctypes.c_int32.from_address(addr).value = 1

    def wait_flag(self, stream: Any, addr: int) -> None:
        flag = ctypes.c_int32.from_address(addr)
        deadline = time.monotonic() + HOST_WAIT_TIMEOUT_S
        while flag.value != 1:
            if time.monotonic() > deadline:
                raise TimeoutError("copy-engine all-reduce (host): a peer never signalled")
            time.sleep(0)
        flag.value = 0

    def copy(self, stream: Any, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)


class CudaTransport:
    """One GPU per process: IPC handles of each registered allocation exchanged once, copies by
    `cuMemcpyAsync` (unified addressing: a copy from a peer's mapping runs on the copy engines
    over NVLink), flags by `cuStreamWriteValue32` / `cuStreamWaitValue32` (EQ 1, then a write
    of 0)."""

    def __init__(self, device: torch.device, num_peers: int) -> None:
        from cuda.bindings import driver as drv

        self.drv, self.device = drv, device
        self._copy_streams = [torch.cuda.Stream(device) for _ in range(num_peers)]
        self._opened: dict[bytes, int] = {}

    def _check(self, result: Any, what: str) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"copy-engine all-reduce: {what} failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    def share(self, t: torch.Tensor, group: Any) -> Region:
        drv = self.drv
        base, _ = self._check(drv.cuMemGetAddressRange(drv.CUdeviceptr(t.data_ptr())),
                              "cuMemGetAddressRange")
        handle = self._check(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle (is "
                             "PYTORCH_CUDA_ALLOC_CONF expandable_segments on? it must be off)")
        mine = (bytes(handle.reserved), t.data_ptr() - int(base))
        rank, nbytes = dist.get_rank(group), t.numel() * t.element_size()
        ptrs = []
        for q, (raw, offset) in enumerate(_gather(mine, dist.get_world_size(group), group)):
            if q == rank:
                ptrs.append(t.data_ptr())
                continue
            if raw not in self._opened:
                h = drv.CUipcMemHandle()
                h.reserved = raw
                flag = int(drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                self._opened[raw] = int(self._check(drv.cuIpcOpenMemHandle(h, flag),
                                                    "cuIpcOpenMemHandle"))
            ptrs.append(self._opened[raw] + offset)
        return Region(t.data_ptr(), nbytes, ptrs)

    def streams(self, peers: list[int]) -> tuple[Any, list[Any]]:
        return torch.cuda.current_stream(self.device), self._copy_streams[: len(peers)]

    def fork(self, src: Any, dst: Any) -> None:
        ev = torch.cuda.Event()
        ev.record(src)
        dst.wait_event(ev)

    def write_flag(self, stream: Any, addr: int) -> None:
        drv = self.drv
        self._check(drv.cuStreamWriteValue32(drv.CUstream(stream.cuda_stream),
                                             drv.CUdeviceptr(addr), 1, 0), "cuStreamWriteValue32")

    def wait_flag(self, stream: Any, addr: int) -> None:
        drv = self.drv
        eq = int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ)
        cu = drv.CUstream(stream.cuda_stream)
        self._check(drv.cuStreamWaitValue32(cu, drv.CUdeviceptr(addr), 1, eq),
                    "cuStreamWaitValue32")
        self._check(drv.cuStreamWriteValue32(cu, drv.CUdeviceptr(addr), 0, 0),
                    "cuStreamWriteValue32")

    def copy(self, stream: Any, dst: int, src: int, nbytes: int) -> None:
        drv = self.drv
        self._check(drv.cuMemcpyAsync(drv.CUdeviceptr(dst), drv.CUdeviceptr(src), nbytes,
                                      drv.CUstream(stream.cuda_stream)), "cuMemcpyAsync")

    def close(self) -> None:
        for ptr in self._opened.values():
            self.drv.cuIpcCloseMemHandle(self.drv.CUdeviceptr(ptr))
        self._opened.clear()


def make_all_reduce(rank: int, size: int, group: Any, device: torch.device) -> CopyEngineAllReduce:
    """The copy-engine all-reduce of this rank: CUDA transport and the Triton reduction on a
    GPU, the host transport and the torch reduction on the CPU (tests over gloo)."""
    if device.type == "cuda":
        from nanosched.kernels.reduce_sum import reduce_rows

        return CopyEngineAllReduce(rank, size, group, CudaTransport(device, size - 1),
                                   reduce_rows, device)
    return CopyEngineAllReduce(rank, size, group, HostTransport(rank, size), reduce_reference,
                               device)
