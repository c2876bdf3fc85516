"""Results computed once per test run, whichever pytest-xdist worker asks first.

A process's own cache (functools.cache) serves one worker; under `-n 2` a result that tests in
both workers need, such as a searched key (seconds of CP-SAT each), would be computed twice.
`computed_once` pickles it into a folder that the workers of one run share (the `shared_cache`
fixture of tests/conftest.py): the first worker computes it under an exclusive lock, the other
waits on the lock and reads the file. Only for deterministic results (a deterministic search,
a synthetic profile), since the reader gets the writer's result.
"""

from __future__ import annotations

import fcntl
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def computed_once(folder: Path | None, name: str, compute: Callable[[], T]) -> T:
    """compute(), or what a worker of this run stored under `name` in `folder` (None: compute)."""
    if folder is None:
        return compute()
    path = folder / f"{name}.pickle"
    with (folder / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = compute()
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(value))
        tmp.replace(path)  # a reader never sees half a file
        return value
