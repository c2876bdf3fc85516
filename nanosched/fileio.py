"""File handling shared by every contract and command: atomic JSON writes (so a failure never
leaves half a file) with the user's umask, strict JSON (no Infinity or NaN), the checks of the
paths a command reads or writes (made before any work, each naming the flag), and the field
checks of objects read back into frozen dataclasses.

`check_fields` is the one typed gate of every contract file (schedules, profiles): a field must
have the JSON type its dataclass annotation names (`int` is an integer and not a bool, `float`
a finite number, `str` a string, `tuple[X, ...]` a list of X, `dict[str, X]` an object), so a
hand-edited `"share": "abc"`, `"tp": "1"`, `"deps": {}` or `Infinity` is refused with the file,
the field and what was expected, before anything computes with it. Bounds beyond the type
(positive, within a horizon) belong to each format's own validation."""

from __future__ import annotations

import functools
import json
import math
import os
import stat
import tempfile
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
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
    kind = special_kind(p)
    if kind is not None:  # reading a FIFO would wait for a writer forever
        raise ConfigError(f"{what} {path}: is {kind}, expected a regular file")
    if not p.is_file():
        raise ConfigError(f"{what} {path}: does not exist")
    return p


def check_output_file(path: str | os.PathLike[str], what: str,
                      suffixes: tuple[str, ...] | None = None, make_parent: bool = True
                      ) -> Path:
    """Refuse, before any work, an output path that cannot be written, naming `what` (the flag)
    and the path: an existing folder, anything else that is not a regular file (a device such
    as /dev/null, a FIFO, a socket: outputs are written by renaming a new file over the path,
    which would replace the device node), (with `suffixes`) another suffix, a parent that is a
    file, a missing parent (made when `make_parent`, else refused), a folder where a probe file
    cannot be made (read-only, no permission), an existing file that is not writable."""
    p = Path(path)
    if p.is_dir() or str(path).endswith(os.sep):
        raise ConfigError(f"{what} {path}: is a folder, expected a file name")
    _check_not_special(p, what)
    if suffixes is not None and p.suffix.lower() not in suffixes:
        raise ConfigError(f"{what} {path}: give a file ending in {', '.join(suffixes)} "
                          f"(the suffix picks the format)")
    parent = p.parent
    for up in (parent, *parent.parents):
        if up.exists():
            if not up.is_dir():
                raise ConfigError(f"{what} {path}: {up} is a file, not a folder")
            break
    if not parent.exists():
        if not make_parent:
            raise ConfigError(f"{what} {path}: folder {parent} does not exist")
        parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{p.name}.", suffix=".probe")
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot write in {parent} "
                          f"({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"{what} {path}: the file is not writable")
    return p


PACKAGE = Path(__file__).resolve().parent


def in_package(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is inside the installed nanosched package (its shipped profiles,
    schedules and tokenizers: data a command must not replace unless told to)."""
    return Path(path).resolve().is_relative_to(PACKAGE)


def special_kind(p: Path) -> str | None:
    """What `p` is when it exists and is neither a regular file nor a folder (links followed),
    else None."""
    try:
        mode = p.stat().st_mode
    except OSError:  # missing, or a dangling link: a new file is made there
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _check_not_special(p: Path, what: str) -> None:
    kind = special_kind(p)
    if kind is not None:
        raise ConfigError(f"{what} {p}: is {kind}, not a regular file; outputs are written to a "
                          f"new file renamed over the path, which would replace it: give the "
                          f"path of a regular file")


def write_json_atomic(path: str | os.PathLike[str], data: Any, indent: int | None = 1) -> None:
    """Write JSON to a temporary file beside `path`, then rename it over `path`; the file gets
    the permissions `open()` would give it under the user's umask (mkstemp makes 0600). A path
    that became a device, FIFO or socket since the command checked it is refused again right
    before the rename, so no special file is ever replaced."""
    p = check_output_file(path, "output file")
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=indent)
            f.write("\n")
        _check_not_special(p, "output file")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_fields(cls: type, data: Any, where: str, error: type[Exception]) -> None:
    """Raise `error` naming `where` unless `data` is an object with exactly the fields `cls`
    takes: no unknown field, every field without a default present, each of its annotated type
    (`type_problem`; nested dataclasses are left to the caller, which builds them)."""
    if not isinstance(data, dict):
        raise error(f"{where}: expected an object, got {_short(data)}")
    names, required = _field_names(cls)
    unknown = data.keys() - names
    if unknown:
        raise error(f"{where}: unknown field(s) {sorted(unknown)}")
    missing = required - data.keys()
    if missing:
        raise error(f"{where}: missing field(s) {sorted(missing)}")
    hints = _hints(cls)
    for name, value in data.items():
        why = type_problem(hints[name], value)
        if why:
            raise error(f"{where}: field {name!r} {why}")


def type_problem(hint: Any, value: Any) -> str | None:
    """Why the JSON `value` is not of the annotated type `hint` (None: it is).

    JSON lists stand for tuples; a dataclass value is only required to be an object (its
    fields are checked when it is built). Unknown annotations accept anything."""
    if hint is Any or hint is object:
        return None
    origin, args = _shape(hint)
    if origin in (typing.Union, types.UnionType):
        if any(type_problem(a, value) is None for a in args):
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1:
            return f"{type_problem(others[0], value)} (or null)"
        names = " or ".join(_name(a) for a in args)
        return f"must be {names}, got {_short(value)}"
    if hint is type(None):
        return None if value is None else f"must be null, got {_short(value)}"
    if hint is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {_short(value)}"
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return None
        return f"must be an integer, got {_short(value)}"
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"must be a number, got {_short(value)}"
        return None if math.isfinite(value) else f"must be a finite number, got {value!r}"
    if hint is str:
        return None if isinstance(value, str) else f"must be a string, got {_short(value)}"
    if isinstance(hint, type) and is_dataclass(hint):
        return None if isinstance(value, dict) else f"must be an object, got {_short(value)}"
    if origin is tuple or origin is list:
        if not isinstance(value, (list, tuple)):
            return f"must be a list, got {_short(value)}"
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                return f"must be a list of {len(args)} items, got {_short(value)}"
            elems = list(zip(args, value, strict=True))
        else:
            elems = [(args[0] if args else Any, v) for v in value]
        for i, (a, v) in enumerate(elems):
            why = type_problem(a, v)
            if why:
                return f"item {i} {why}"
        return None
    if origin is dict:
        if not isinstance(value, dict):
            return f"must be an object, got {_short(value)}"
        val = args[1] if len(args) == 2 else Any
        for k, v in value.items():
            why = type_problem(val, v)
            if why:
                return f"key {k!r} {why}"
        return None
    return None


@functools.cache
def _field_names(cls: type) -> tuple[frozenset[str], frozenset[str]]:
    """(every field of the dataclass `cls`, those without a default)."""
    fs = fields(cls)
    return (frozenset(f.name for f in fs),
            frozenset(f.name for f in fs
                      if f.default is MISSING and f.default_factory is MISSING))


@functools.cache
def _shape(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    return typing.get_origin(hint), typing.get_args(hint)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # slow (it evaluates the annotations): once per class


def _name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        hint, getattr(hint, "__name__", str(hint)))


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class DuplicateKey(ValueError):
    """A JSON object holding a key twice (the key)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def read_json(path: str | os.PathLike[str], what: str, error: type[Exception],
              hint: str = "") -> Any:
    """Parse the JSON file `path`; raise `error` naming `what` and the path when it is missing,
    not a regular file, unreadable, not UTF-8, not JSON, nested too deep to parse (the
    parser recurses: 100,000 nested brackets would otherwise end in a RecursionError), or
    holding an object with a key twice (JSON takes the last silently: a hand edit that added
    a field again would be half ignored)."""
    p = Path(path)
    name = f"{what} {p}"
    if not p.exists():
        raise error(f"{name} does not exist")
    if not p.is_file():
        raise error(f"{name} is not a file")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as exc:
        raise error(f"{name}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise error(f"{name}: not UTF-8 text (byte {exc.start}){hint}") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except DuplicateKey as exc:
        raise error(f"{name}: key {exc.args[0]!r} appears twice in one object (JSON would keep "
                    f"the last silently); keep one") from None
    except json.JSONDecodeError as exc:
        raise error(f"{name}: not valid JSON ({exc}){hint}") from None
    except RecursionError:
        raise error(f"{name}: JSON nested too deep") from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise error(f"{name}: a number too long to read ({exc})") from None
