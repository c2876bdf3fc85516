"""The backend: launches nano-ops and orders streams with events only where data crosses them.

For every buffer the backend remembers the recent accesses (rows, stream, event, read or write).
A launch on stream S that reads rows R waits for the last writes to R made on other streams
(read after write); one that writes R also waits for other streams' reads and writes of R (write
after read / write). Accesses on the same stream are ordered by the stream itself and need no
event. An access fully covered by a later write on the same stream is forgotten: anything that
must follow it now follows that write. Every output goes straight into its rows of the
full-batch buffer, so merging nano-batches costs no copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanosched.runtime.device import Device
from nanosched.runtime.program import Access, overlaps


@dataclass
class _Touch:
    rows: tuple[int, int]
    stream: str
    event: Any
    is_write: bool


def _covers(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[0] and b[1] <= a[1]


class Backend:
    def __init__(self, device: Device) -> None:
        self.device = device
        self._touches: dict[str, list[_Touch]] = {}
        self.num_launches = 0
        # a device that keeps a per-launch timeline gets each launch's label (building the
        # label costs Python time, so only then)
        self.wants_labels = bool(getattr(device, "wants_labels", False))

    def reset(self) -> None:
        """Forget all accesses (between forwards, after `device.join()`)."""
        self._touches.clear()

    def launch(self, stream_name: str, fn: Callable[[], None],
               reads: list[tuple[Access, tuple[int, int]]],
               writes: list[tuple[Access, tuple[int, int]]],
               after: list[tuple[str, Any]] = (), label: str = "") -> Any:
        """Run `fn` on `stream_name` after the cross-stream accesses it conflicts with and after
        the (stream, event) launches in `after`; returns the event recorded behind it. `label`
        (what the launch runs) goes to devices that want labels."""
        stream = self.device.stream(stream_name)
        waits: list[Any] = [ev for name, ev in after if name != stream_name]
        for acc, rows in reads:
            waits += self._conflicts(acc.buffer, rows, stream_name, with_reads=False)
        for acc, rows in writes:
            waits += self._conflicts(acc.buffer, rows, stream_name, with_reads=True)
        seen: set[int] = set()
        for event in waits:
            if id(event) not in seen:
                seen.add(id(event))
                self.device.wait(stream, event)
        if self.wants_labels:
            self.device.launch(stream, fn, label)
        else:
            self.device.launch(stream, fn)
        self.num_launches += 1
        event = self.device.record(stream)
        for acc, rows in reads:
            self._touches.setdefault(acc.buffer, []).append(_Touch(rows, stream_name, event,
                                                                   False))
        for acc, rows in writes:
            self._forget_covered(acc.buffer, rows, stream_name)
            self._touches.setdefault(acc.buffer, []).append(_Touch(rows, stream_name, event,
                                                                   True))
        return event

    def _conflicts(self, buffer: str, rows: tuple[int, int], stream: str,
                   with_reads: bool) -> list[Any]:
        return [t.event for t in self._touches.get(buffer, ())
                if t.stream != stream and (t.is_write or with_reads) and overlaps(t.rows, rows)]

    def _forget_covered(self, buffer: str, rows: tuple[int, int], stream: str) -> None:
        """A write orders itself after every conflicting access, so covered ones can go."""
        touches = self._touches.get(buffer)
        if touches:
            self._touches[buffer] = [t for t in touches if not _covers(rows, t.rows)]
