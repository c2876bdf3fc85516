"""The transports of the copy-engine all-reduce (`ce_allreduce.py`): where its steps run.

A transport maps buffers on every rank (`share` -> `Region`), forks and joins streams, writes
and waits flags, and copies bytes. `CudaTransport` does it on a GPU per process with the
driver's IPC handles, `cuMemcpyAsync` and stream memory operations; `HostTransport` on CPU
processes with POSIX shared memory, `memmove` and spinning waits, at the moment each step is
issued, so that the all-reduce's slot, chunk, sub-chunk and flag logic runs in CPU tests over
gloo in the order the GPU's streams are given it.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

HOST_WAIT_TIMEOUT_S = 60.0


@dataclass
class Region:
    """A registered buffer: its local address and size, and each rank's address of it as seen
    from this process (index = rank; the local one at this rank)."""

    ptr: int
    nbytes: int
    peer_ptrs: list[int]

    def holds(self, ptr: int, nbytes: int) -> bool:
        return self.ptr <= ptr and ptr + nbytes <= self.ptr + self.nbytes


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

    def streams(self, peers: list[int]) -> tuple[None, list[None], list[None]]:
        return None, [None] * len(peers), [None] * len(peers)

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
    over NVLink) on a pull and a push stream per peer (so pulls and pushes of different
    sub-chunks overlap), flags by `cuStreamWriteValue32` / `cuStreamWaitValue32` (EQ 1, then a
    write of 0)."""

    def __init__(self, device: torch.device, num_peers: int) -> None:
        from cuda.bindings import driver as drv

        self.drv, self.device = drv, device
        self._pulls = [torch.cuda.Stream(device) for _ in range(num_peers)]
        self._pushes = [torch.cuda.Stream(device) for _ in range(num_peers)]
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

    def streams(self, peers: list[int]) -> tuple[Any, list[Any], list[Any]]:
        """The caller's stream, and a pull and a push copy stream per peer."""
        n = len(peers)
        return torch.cuda.current_stream(self.device), self._pulls[:n], self._pushes[:n]

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
