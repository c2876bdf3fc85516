"""File handling shared by every contract: atomic JSON writes, so a failure never leaves half a
file, and the field checks of objects read back into frozen dataclasses."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | os.PathLike[str], data: Any, indent: int | None = 1) -> None:
    """Write JSON to a temporary file beside `path`, then rename it over `path`."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=indent)
            f.write("\n")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_fields(cls: type, data: Any, where: str, error: type[Exception]) -> None:
    """Raise `error` naming `where` unless `data` is an object with exactly the fields `cls`
    takes: no unknown field, every field without a default present."""
    if not isinstance(data, dict):
        raise error(f"{where}: expected an object, got {data!r}")
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise error(f"{where}: unknown field(s) {sorted(unknown)}")
    missing = {f.name for f in fields(cls)
               if f.default is MISSING and f.default_factory is MISSING} - set(data)
    if missing:
        raise error(f"{where}: missing field(s) {sorted(missing)}")
