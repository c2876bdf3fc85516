"""The profiles shipped with the package (`nanosched/profiler/profiles/`): listed, picked for a
request, and loaded by name.

`pick_shipped_profile` returns the shipped profile closest to a request: same model, KV cache
dtype and weight quantization required, then same tp, then same GPU, then the largest measured
batch, then the fullest grid (most co-run pairs); it ranks the files by their headers and reads
only the one it picks whole.
A profile of another GPU than the one asked for is returned only when that GPU was assumed, with
a reason that says so. `load_named_profile` reads `--profile FILE` or a shipped NAME. Installed
profiles and their headers are read once per process (profiles are immutable).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from nanosched.errors import ConfigError, NanoschedError
from nanosched.hardware import prior_for
from nanosched.models.spec import ModelSpec
from nanosched.profiler.format import Profile, load_profile

T = TypeVar("T")

SHIPPED = Path(__file__).resolve().parent / "profiles"
_PACKAGE_DATA = SHIPPED  # the installed profiles, whatever SHIPPED is pointed at


def shipped_profiles(folder: Path | None = None) -> dict[str, Path]:
    folder = folder or SHIPPED
    return {p.stem: p for p in sorted(folder.glob("*.json"))} if folder.is_dir() else {}


def _read(path: Path) -> Profile | None:
    try:
        return _load(path)
    except (NanoschedError, json.JSONDecodeError):
        return None


def _stamp(path: Path) -> tuple[int, int] | None:
    """(mtime, size) of a profile installed with the package, else None (not cached)."""
    if path.parent != _PACKAGE_DATA:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _once_if_installed(read: Callable[[Path], T]) -> Callable[[Path], T]:
    """`read`, its result kept per process for a profile installed with the package (every
    search ranks them all and reads the one it picks: 0.1-0.3 s each) and read again only if the
    file changed; any other path is read every time. Profiles are immutable, so callers may share
    one."""
    cached = functools.lru_cache(maxsize=32)(lambda path, _stamp: read(path))

    def get(path: Path) -> T:
        stamp = _stamp(path)
        return read(path) if stamp is None else cached(path, stamp)
    get.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return get


# `load_profile` is looked up at each call, so that a test may wrap it
_load = _once_if_installed(lambda path: load_profile(path))


@dataclass(frozen=True)
class _Head:
    """What `pick_shipped_profile` ranks a profile by, read without building its rows."""

    model: str
    tp: int
    gpu_name: str
    kv_dtype: str
    dense_batch: int
    pairs: int  # co-run pairs measured: a full grid has more than a --quick one
    quantization: str = "none"


def _read_head(path: Path) -> _Head | None:
    try:
        d = json.loads(path.read_bytes())
        return _Head(d["model"]["name"], d["tp"], d["identity"]["gpu_name"],
                     d.get("kv_dtype") or "auto", d["dense_batch"], len(d.get("pairs") or ()),
                     d.get("quantization") or "none")
    except (OSError, ValueError, KeyError, TypeError):
        return None


_head = _once_if_installed(_read_head)


def gpu_key(name: str) -> str:
    """The prior a GPU or device name stands for ("NVIDIA H100 80GB HBM3" -> "h100")."""
    prior = prior_for(name)
    return prior.name if prior is not None else name.lower()


def pick_shipped_profile(spec: ModelSpec, tp: int | None, gpu: str | None,
                 folder: Path | None = None, kv_dtype: str = "auto",
                 assumed: bool = False, quantization: str = "none"
                 ) -> tuple[Profile | None, str]:
    """The shipped profile closest to the request, with the reason; (None, why) if none fits.

    A profile measured on another GPU than `gpu` is returned only when `gpu` was `assumed`
    (not asked for), and the reason says so; else (None, the GPUs that have one)."""
    paths = shipped_profiles(folder)
    found = [(name, head) for name, path in paths.items()
             if (head := _head(path)) is not None and head.model == spec.name
             and head.kv_dtype == kv_dtype and head.quantization == quantization]
    if not found:
        kv = "" if kv_dtype == "auto" else f" with a {kv_dtype} KV cache"
        kv += "" if quantization == "none" else f" with {quantization} weights"
        return None, f"no shipped profile for {spec.name}{kv}"

    def same_gpu(head: _Head) -> bool:
        return gpu is None or gpu_key(head.gpu_name) == gpu_key(gpu)

    def rank(item: tuple[str, _Head]) -> tuple[bool, bool, int, int]:
        head = item[1]
        return (tp is None or head.tp == tp, same_gpu(head), head.dense_batch, head.pairs)

    name, head = max(found, key=rank)
    if tp is not None and head.tp != tp:
        tps = sorted({h.tp for _, h in found})
        return None, f"shipped profiles for {spec.name} are for tp {tps}, not {tp}"
    prof = _read(paths[name])  # only the one picked is read whole
    if prof is None:
        return None, f"shipped profile {name!r} does not load (a damaged install?)"
    if not same_gpu(head):
        gpus = ", ".join(sorted({h.gpu_name for _, h in found}))
        if not assumed:
            return None, (f"no shipped profile for {spec.name} on {gpu} (shipped ones are "
                          f"measured on {gpus}: pass --gpu {gpu_key(prof.identity.gpu_name)} "
                          f"or --profile {name} to search on one)")
        return prof, (f"shipped profile {name!r}: same model{' and tp' if tp else ''}, "
                      f"measured on {prof.identity.gpu_name}, NOT the {gpu} assumed without "
                      f"--gpu: the schedule is for that GPU (tp {prof.tp}, batches up to "
                      f"{prof.dense_batch}); pass --gpu {gpu} for a synthetic {gpu} profile")
    why = (f"shipped profile {name!r}: same model{' and tp' if tp else ''}"
           f"{', same GPU' if gpu else ''} ({prof.identity.gpu_name}, "
           f"tp {prof.tp}, batches up to {prof.dense_batch})")
    return prof, why


def load_named_profile(arg: str, folder: Path | None = None) -> Profile:
    """`--profile FILE` or the name of a shipped profile."""
    path = Path(arg)
    if path.suffix == ".json" or path.exists():
        return load_profile(path)
    names = shipped_profiles(folder)
    if arg not in names:
        raise ConfigError(f"--profile {arg!r} is neither a file nor a shipped profile; shipped: "
                          f"{', '.join(names) or 'none'}")
    return _load(names[arg])
