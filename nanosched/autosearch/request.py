"""Turn `nanosched search` flags into a SearchConfig: profile, tp and dense batch choices.

Profile: `--profile FILE` or the NAME of a shipped profile (`nanosched/profiler/profiles/`);
without one, the shipped profile closest to the request — same model required, then same tp,
then same GPU, then the largest measured batch, then the fullest grid (most co-run pairs) — and
failing that a synthetic profile for `--gpu`, announced loudly. A profile of another GPU than
the `--gpu` asked for is never picked (the search runs on a synthetic profile of the GPU asked
for, and says which shipped ones exist); without `--gpu` the GPU assumed is `DEFAULT_GPU`, and a
profile of another GPU is used only with a message that says so. A profile is measured on one KV
cache dtype (`kv_dtype`); only profiles of the requested `--kv-cache-dtype` are picked or
accepted, and FP8 needs a measured one (the synthetic profile models a cache in the model's
dtype). Likewise a profile is measured on one weight quantization (`quantization`, none or
fp8): only profiles of the requested `--quantization` are picked or accepted; without a
measured fp8 one the synthetic profile prices FP8 GEMMs (autosearch/synthetic.py).
tp: `--tp`, else the profile's, else the smallest power of two that leaves room for the
dense batch's KV cache (and its weights: `--quantization`'s).
Dense batch: `auto` is the largest multiple of 128 that fits (costmodel.max_dense_batch),
capped at 2048 and at the profile's largest batch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from nanosched.costmodel import (
    DEFAULT_MAX_DENSE_BATCH,
    TOKEN_QUANTUM,
    choose_tp,
    fp8_gemm,
    max_dense_batch,
)
from nanosched.errors import ConfigError, NanoschedError, ProfileError
from nanosched.hardware import get_gpu, measured_gpu, prior_for
from nanosched.models.spec import ModelSpec
from nanosched.profiler.format import RP_CLASSES, Profile, check_profile_for, load_profile
from nanosched.workloads import Workload

T = TypeVar("T")

SHIPPED = Path(__file__).resolve().parent.parent / "profiler" / "profiles"
_PACKAGE_DATA = SHIPPED  # the installed profiles, whatever SHIPPED is pointed at
DEFAULT_GPU = "h100"  # the GPU assumed without --gpu (the CLI passes the GPU present, if any)
SYNTHETIC_BANNER = ("*** SYNTHETIC PROFILE: no measured profile for this request; kernel times "
                    "are a roofline model and NanoFlow's Table 3, NOT measurements. Run "
                    "`nanosched profile` on the GPU and search again. ***")


@dataclass
class Choice:
    """What the request resolved to, and why (messages for the user)."""

    tp: int
    profile: Profile | None
    dense_batch: int
    messages: list[str] = field(default_factory=list)


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
    """What `pick_shipped` ranks a profile by, read without building its rows."""

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


def pick_shipped(spec: ModelSpec, tp: int | None, gpu: str | None,
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


def check_rp_tables(prof: Profile, where: str) -> None:
    """Refuse a profile without R->P points for a class its layer overlaps (memory; network
    at tp > 1): the search would have nothing to price overlap with and say NO GAIN for it."""
    for cls in RP_CLASSES[:1] if prof.tp == 1 else RP_CLASSES:
        if not prof.rp.get(cls):
            raise ProfileError(f"{where} has an empty R->P table for class {cls!r}: nothing "
                               f"to price overlap with; derive it from the profile's pairs "
                               f"(`nanosched profile rederive`) or measure them again")


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


def resolve(spec: ModelSpec, tp: int | None, profile_arg: str | None, gpu_name: str | None,
            workload: Workload, dense_batch: str, folder: Path | None = None,
            kv_dtype: str = "auto", quantization: str = "none") -> Choice:
    """Decide tp, profile (None means: build a synthetic one) and dense batch."""
    gpu = get_gpu(gpu_name or DEFAULT_GPU)
    fp8_gemm("kqv", quantization)  # an unknown --quantization is refused here
    msgs: list[str] = []
    if dense_batch != "auto" and not dense_batch.isdigit():
        raise ConfigError(f"--dense-batch must be a number of tokens or 'auto', got "
                          f"{dense_batch!r}")
    target = int(dense_batch) if dense_batch != "auto" else 1024
    if target < 2 * TOKEN_QUANTUM or target % TOKEN_QUANTUM:
        raise ConfigError(f"--dense-batch must be a multiple of {TOKEN_QUANTUM} of at least "
                          f"{2 * TOKEN_QUANTUM} (two nano-batches), got {target}")
    if profile_arg:
        prof: Profile | None = load_named_profile(profile_arg, folder)
        check_profile_for(prof, spec, tp or prof.tp, where=f"--profile {profile_arg}",
                          kv_dtype=kv_dtype, quantization=quantization)
        check_rp_tables(prof, f"--profile {profile_arg}")
        msgs.append(f"profile: {profile_arg} ({prof.identity.gpu_name}, tp {prof.tp})")
    else:
        prof, why = pick_shipped(spec, tp, gpu_name or DEFAULT_GPU, folder, kv_dtype,
                                 assumed=gpu_name is None, quantization=quantization)
        if prof is None and kv_dtype != "auto":
            more = "" if quantization == "none" else f" --quantization {quantization}"
            raise ConfigError(f"{why}: measure one with `nanosched profile --model {spec.name} "
                              f"--kv-cache-dtype {kv_dtype}{more}` and pass it with --profile")
        msgs.append(f"profile: {why}")
        if gpu_name is None:
            msgs.append(f"gpu: {DEFAULT_GPU} assumed (no --gpu given and no GPU here)")
    if tp is None:
        tp = prof.tp if prof else choose_tp(spec, gpu, workload, target, max_tp=8,
                                            quantization=quantization)
        msgs.append(f"tp: {tp} (" + ("the profile's" if prof else
                    f"smallest that fits a {target}-token batch's KV cache") + ")")
    spec.check_tp(tp)
    if prof is None:
        msgs.append(SYNTHETIC_BANNER)
        if quantization == "fp8":
            msgs.append("synthetic profile of FP8 weights (W8A8): the layer GEMMs priced on "
                        "e4m3 bytes at the FP8 GEMM's rate (autosearch/synthetic.py), NOT "
                        "measured: `nanosched profile --quantization fp8` measures them")
    elif gpu_name is None:  # size the batch for the profiled GPU, not a default prior
        gpu = measured_gpu(prof.identity.gpu_name, prof.identity.memory_bytes,
                           prof.ceilings.gemm_tflops_model, prof.ceilings.copy_gbs)
    if dense_batch == "auto":
        fit = max_dense_batch(spec, gpu, tp, workload, quantization=quantization)
        b = min(fit, DEFAULT_MAX_DENSE_BATCH, prof.dense_batch if prof else fit)
        b = b // TOKEN_QUANTUM * TOKEN_QUANTUM
        msgs.append(f"dense batch: {b} (auto: fits {fit} tokens, capped at "
                    f"{DEFAULT_MAX_DENSE_BATCH}{' and the profile' if prof else ''})")
    else:
        b = int(dense_batch)
    return Choice(tp, prof, b, msgs)
