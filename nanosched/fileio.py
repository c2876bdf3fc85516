"""File handling shared by every contract and command: atomic JSON writes (so a failure never
leaves half a file) with the user's umask, strict JSON (no Infinity or NaN), the checks of the
paths a command reads or writes (made before any work, each naming the flag), and the field
checks of objects read back into frozen dataclasses."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from nanosched.errors import ConfigError

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def finite_json(data: Any) -> Any:
    """`data` with every infinite or NaN float replaced by None, so `json.dumps(...,
    allow_nan=False)` accepts it and strict parsers read it (JSON has no Infinity or NaN)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_json(v) for v in data]
    return data


def check_input_file(path: str | os.PathLike[str], what: str) -> Path:
    """`path` as a Path if it is a readable file; else ConfigError naming `what` (a flag or
    an argument) and what is there instead."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} {path}: is a folder, expected a file")
    if not p.is_file():
        raise ConfigError(f"{what} {path}: does not exist")
    return p


def check_output_file(path: str | os.PathLike[str], what: str,
                      suffixes: tuple[str, ...] | None = None) -> Path:
    """Check an output path before any work: not a folder, a parent that is (or can be made) a
    folder, and (with `suffixes`) one of those suffixes; the parent folder is created."""
    p = Path(path)
    if p.is_dir() or str(path).endswith(os.sep):
        raise ConfigError(f"{what} {path}: is a folder, expected a file name")
    if suffixes is not None and p.suffix.lower() not in suffixes:
        raise ConfigError(f"{what} {path}: give a file ending in {', '.join(suffixes)} "
                          f"(the suffix picks the format)")
    parent = p.parent
    for up in (parent, *parent.parents):
        if up.exists():
            if not up.is_dir():
                raise ConfigError(f"{what} {path}: {up} is a file, not a folder")
            break
    parent.mkdir(parents=True, exist_ok=True)
    return p


def write_json_atomic(path: str | os.PathLike[str], data: Any, indent: int | None = 1) -> None:
    """Write JSON to a temporary file beside `path`, then rename it over `path`; the file gets
    the permissions `open()` would give it under the user's umask (mkstemp makes 0600)."""
    p = check_output_file(path, "output file")
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
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
