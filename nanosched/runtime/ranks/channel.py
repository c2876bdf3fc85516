"""One writer, many readers over shared memory: how rank 0 sends the other tensor-parallel ranks
what each iteration runs.

As vLLM's `MessageQueue`: a ring of fixed slots in one shared-memory block, written by rank 0 and
read by every reader in order, a slot written again only once every reader read it. Waiting is
on process-shared POSIX semaphores in the block (ctypes), not spins, so an idle rank sleeps; a
message is pickled over as many slots as it needs. The block is unlinked once every reader
attached, so a rank that dies leaves nothing behind.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import ctypes
import errno
import pickle
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

HEADER = struct.Struct("<qq")  # payload bytes, 1 when the next slot continues the message
SEM_BYTES = 32  # sizeof(sem_t) on 64-bit Linux (glibc and musl)
WAIT_S = 0.5  # a blocked side wakes this often to check that its peers are alive
DEFAULT_SLOTS = 8
DEFAULT_SLOT_BYTES = 1 << 20  # an iteration at 2,048 decode rows takes ~18 KB


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "sem_timedwait"):
        raise OSError("the tensor-parallel channel needs POSIX semaphores (sem_timedwait): "
                      "run on Linux")
    return libc


class ShmSemaphore:
    """A process-shared semaphore at `offset` of a shared buffer (`value`: create it)."""

    def __init__(self, libc: Any, buf: memoryview, offset: int, value: int | None) -> None:
        self._libc = libc
        self._cell: Any = ctypes.c_char.from_buffer(buf, offset)  # pins the buffer
        self._ptr = ctypes.byref(self._cell)
        if value is not None and libc.sem_init(self._ptr, 1, value) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def release(self) -> None:
        self._libc.sem_post(self._ptr)

    def acquire(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds; False when it ran out."""
        deadline = time.time() + timeout
        ts = _Timespec(int(deadline), int(deadline % 1 * 1e9))
        while self._libc.sem_timedwait(self._ptr, ctypes.byref(ts)) != 0:
            err = ctypes.get_errno()
            if err == errno.ETIMEDOUT:
                return False
            if err != errno.EINTR:
                raise OSError(err, "sem_timedwait failed")
        return True

    def forget(self) -> None:
        """Drop the view of the buffer (before the block is closed)."""
        self._cell = self._ptr = None


@dataclass(frozen=True)
class ChannelHandle:
    """What a reader needs to attach (picklable)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int

    @property
    def ring_offset(self) -> int:
        return 2 * self.num_readers * SEM_BYTES

    @property
    def size(self) -> int:
        return self.ring_offset + self.num_slots * (HEADER.size + self.slot_bytes)

    def slot(self, index: int) -> int:
        """The offset of the slot that message slot number `index` uses."""
        return self.ring_offset + (index % self.num_slots) * (HEADER.size + self.slot_bytes)

    def semaphores(self, buf: memoryview, reader: int, create: bool) -> tuple[ShmSemaphore, ...]:
        """Reader `reader`'s (written, freed) pair, created with (0, num_slots) if `create`."""
        libc = _libc()
        base = 2 * reader * SEM_BYTES
        return (ShmSemaphore(libc, buf, base, 0 if create else None),
                ShmSemaphore(libc, buf, base + SEM_BYTES, self.num_slots if create else None))


def _wait(sem: ShmSemaphore, check: Callable[[], None] | None) -> None:
    """Acquire `sem`, calling `check` (which raises or exits when a peer is gone) between
    waits of `WAIT_S`."""
    while not sem.acquire(WAIT_S):
        if check is not None:
            check()


class ChannelWriter:
    """Rank 0's end: `send(obj)` to every reader, in order."""

    def __init__(self, num_readers: int, num_slots: int = DEFAULT_SLOTS,
                 slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        probe = ChannelHandle("", num_readers, num_slots, slot_bytes)
        self.shm = shared_memory.SharedMemory(create=True, size=probe.size)
        self.handle = ChannelHandle(self.shm.name, num_readers, num_slots, slot_bytes)
        pairs = [self.handle.semaphores(self.shm.buf, r, create=True)
                 for r in range(num_readers)]
        self.written = [w for w, _ in pairs]
        self.freed = [f for _, f in pairs]
        self.index = 0  # slots written so far
        self.check: Callable[[], None] | None = None  # raises when a reader is gone
        self.bytes_sent = 0
        self._linked = True

    def send(self, obj: Any) -> int:
        """Pickle `obj` into the ring (waiting while a reader is a whole ring behind); returns
        the message's size in bytes."""
        data = pickle.dumps(obj, protocol=5)
        h, view, buf = self.handle, memoryview(data), self.shm.buf
        for start in range(0, max(1, len(data)), h.slot_bytes):
            part = view[start:start + h.slot_bytes]
            for sem in self.freed:
                _wait(sem, self.check)
            offset = h.slot(self.index)
            HEADER.pack_into(buf, offset, len(part), start + h.slot_bytes < len(data))
            buf[offset + HEADER.size:offset + HEADER.size + len(part)] = part
            for sem in self.written:
                sem.release()
            self.index += 1
        self.bytes_sent += len(data)
        return len(data)

    def unlink(self) -> None:
        """Remove the block's name (every reader has attached; the mappings stay)."""
        if self._linked:
            self._linked = False
            self.shm.unlink()

    def close(self) -> None:
        """Unmap and remove the block (readers may still hold their mapping)."""
        for sem in self.written + self.freed:
            sem.forget()
        self.shm.close()
        self.unlink()


class ChannelReader:
    """A worker's end: `recv()` the next message."""

    def __init__(self, handle: ChannelHandle, reader: int) -> None:
        self.handle = handle
        self.shm = shared_memory.SharedMemory(name=handle.name)
        self.written, self.freed = handle.semaphores(self.shm.buf, reader, create=False)
        self.index = 0

    def recv(self, check: Callable[[], None] | None = None) -> Any:
        """The next message; `check` runs between waits (it exits when rank 0 is gone)."""
        h, buf, parts = self.handle, self.shm.buf, []
        while True:
            _wait(self.written, check)
            offset = h.slot(self.index)
            size, more = HEADER.unpack_from(buf, offset)
            parts.append(bytes(buf[offset + HEADER.size:offset + HEADER.size + size]))
            self.freed.release()
            self.index += 1
            if not more:
                return pickle.loads(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self.written.forget()
        self.freed.forget()
        self.shm.close()
