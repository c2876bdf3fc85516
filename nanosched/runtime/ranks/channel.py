"""One writer, many readers over shared memory: how rank 0 sends the other tensor-parallel ranks
what each iteration runs.

As vLLM's `MessageQueue` (distributed/device_communicators/shm_broadcast.py): a ring of fixed
slots in one shared-memory block, filled by the writer and read by every reader in the same
order; a slot is written again only once every reader has read it. Unlike vLLM's readers, which
spin on flags in the block, waiting here is on POSIX semaphores: per reader one that counts the
slots written for it and one that counts the slots it has handed back. So an idle rank sleeps
in the kernel and wakes when rank 0 posts (no CPU burnt between iterations, which matters where
several ranks share few cores), a full ring blocks the writer the same way, and the semaphore
operations order the slot's bytes between processes (sem_post / sem_wait are barriers).

A message is pickled (protocol 5) and spread over as many consecutive slots as it needs: each
slot's header holds its payload's length and whether the next slot continues it.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

HEADER = struct.Struct("<qq")  # payload bytes, 1 when the next slot continues the message
WAIT_S = 0.5  # a blocked side wakes this often to check that its peers are alive
DEFAULT_SLOTS = 8
DEFAULT_SLOT_BYTES = 1 << 20  # an iteration at 2,048 decode rows takes ~17 KB


@dataclass
class ChannelHandle:
    """What a reader needs to attach (picklable when a process is spawned with it)."""

    name: str
    num_slots: int
    slot_bytes: int
    written: list[Any]  # per reader: a semaphore counting slots written for it
    freed: list[Any]  # per reader: a semaphore counting slots it may be written again


def _wait(sem: Any, check: Callable[[], None] | None) -> None:
    """Acquire `sem`, calling `check` (which raises or exits when a peer is gone) between
    waits of `WAIT_S`."""
    while not sem.acquire(timeout=WAIT_S):
        if check is not None:
            check()


class ChannelWriter:
    """Rank 0's end: `send(obj)` to every reader, in order."""

    def __init__(self, num_readers: int, ctx: Any, num_slots: int = DEFAULT_SLOTS,
                 slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        self.shm = shared_memory.SharedMemory(create=True,
                                              size=num_slots * (HEADER.size + slot_bytes))
        self.handle = ChannelHandle(self.shm.name, num_slots, slot_bytes,
                                    [ctx.Semaphore(0) for _ in range(num_readers)],
                                    [ctx.Semaphore(num_slots) for _ in range(num_readers)])
        self.index = 0  # slots written so far
        self.check: Callable[[], None] | None = None  # raises when a reader is gone
        self.bytes_sent = 0

    def send(self, obj: Any) -> int:
        """Pickle `obj` into the ring (waiting while a reader is a whole ring behind); returns
        the message's size in bytes."""
        data = pickle.dumps(obj, protocol=5)
        h = self.handle
        view, buf = memoryview(data), self.shm.buf
        for start in range(0, max(1, len(data)), h.slot_bytes):
            part = view[start:start + h.slot_bytes]
            for sem in h.freed:
                _wait(sem, self.check)
            offset = (self.index % h.num_slots) * (HEADER.size + h.slot_bytes)
            HEADER.pack_into(buf, offset, len(part), start + h.slot_bytes < len(data))
            buf[offset + HEADER.size:offset + HEADER.size + len(part)] = part
            for sem in h.written:
                sem.release()
            self.index += 1
        self.bytes_sent += len(data)
        return len(data)

    def close(self) -> None:
        """Release and remove the shared memory (readers may still hold their mapping)."""
        self.shm.close()
        self.shm.unlink()


class ChannelReader:
    """A worker's end: `recv()` the next message."""

    def __init__(self, handle: ChannelHandle, reader: int) -> None:
        self.handle = handle
        self.shm = shared_memory.SharedMemory(name=handle.name)
        self.written, self.freed = handle.written[reader], handle.freed[reader]
        self.index = 0

    def recv(self, check: Callable[[], None] | None = None) -> Any:
        """The next message; `check` runs between waits (it exits when rank 0 is gone)."""
        h, buf, parts = self.handle, self.shm.buf, []
        while True:
            _wait(self.written, check)
            offset = (self.index % h.num_slots) * (HEADER.size + h.slot_bytes)
            size, more = HEADER.unpack_from(buf, offset)
            parts.append(bytes(buf[offset + HEADER.size:offset + HEADER.size + size]))
            self.freed.release()
            self.index += 1
            if not more:
                return pickle.loads(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self.shm.close()
