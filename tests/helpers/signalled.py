"""Helpers of the tests that stop a real command with a signal: start it as a terminal's
foreground job runs, and wait for what it prints before the signal is sent.

A shell's background job (`pytest ... &` in a script) starts with SIGINT ignored; the ignored
disposition is inherited through fork and exec, and Python keeps an ignored SIGINT ignored
instead of installing its KeyboardInterrupt handler, so Ctrl-C's signal would never reach the
command. `default_sigint` gives the command the default disposition, as a terminal's foreground
job has, so that such a test tests the command and not how pytest itself was started.
"""

from __future__ import annotations

import os
import select
import signal
import time
from typing import IO


def default_sigint() -> None:
    """`preexec_fn` of subprocess.Popen: SIGINT at its default disposition in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_until(pipe: IO[bytes], needle: bytes, timeout_s: float) -> bytes:
    """What the binary `pipe` delivered up to the chunk that holds `needle` (read from its file
    descriptor, so `Popen.communicate` reads the rest afterwards); fails at end of file, or
    when `needle` has not come within `timeout_s` seconds."""
    fd = pipe.fileno()
    seen = b""
    deadline = time.monotonic() + timeout_s
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} within {timeout_s:g} s: {seen!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 1 << 16)
            assert chunk, f"end of output before {needle!r}: {seen!r}"
            seen += chunk
    return seen
