"""`nanosched search` as data: `SearchRequest` (its flags, checked once by `check`) and
`resolve`, which turns a request's profile, tp and dense batch into a `Choice`.

Profile: `--profile FILE` or a shipped NAME, else the closest shipped profile
(profiler/catalog.py `pick_shipped_profile`), else a synthetic one for `--gpu`, announced
loudly. A profile of another GPU than the one asked for is never picked; without `--gpu` the
GPU assumed is `DEFAULT_GPU`, and another GPU's profile is used only with a message that says
so. Only profiles of the requested `--kv-cache-dtype` are picked or accepted (FP8 needs a
measured one), and only of the requested `--quantization` (without a measured fp8 one the
synthetic profile prices FP8 GEMMs).
tp: `--tp`, else the profile's, else the smallest power of two that leaves room for the dense
batch's KV cache. Dense batch: `auto` is the largest multiple of 128 that fits
(costmodel.max_dense_batch), capped at 2048 and at the profile's largest batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from nanosched.autosearch.sets import MIN_GAIN
from nanosched.constants import DEFAULT_GPU
from nanosched.errors import ConfigError, ProfileError
from nanosched.hardware import get_gpu, measured_gpu
from nanosched.models import ops as optable
from nanosched.models.costmodel import (
    DEFAULT_MAX_DENSE_BATCH,
    TOKEN_QUANTUM,
    choose_tp,
    fp8_gemm,
    max_dense_batch,
)
from nanosched.models.spec import ModelSpec
from nanosched.profiler.catalog import load_named_profile, pick_shipped_profile
from nanosched.profiler.format import RP_CLASSES, Profile, check_profile_for
from nanosched.workloads import Workload

BUCKETS = ("all", "dense")
# solver work of the whole search, in CP-SAT deterministic seconds (the same verdict on a busy
# or an idle machine)
DEFAULT_TIME_LIMIT = {"all": 120.0, "dense": 20.0}


@dataclass(frozen=True)
class SearchRequest:
    """What `nanosched search` was asked, flag by flag (None: the default the flag names).

    `buckets`: "all" (every batch shape) or "dense" (the steady state's only); `allow_rs_ag`
    lets stage I choose reduce-scatter + all-gather (the runtime replays all-reduce only);
    `allow_unsettled` searches a profile whose pairs were timed in bursts; `command` is the
    command line recorded in the set."""

    model: str | None = None
    tp: int | None = None
    profile: str | None = None
    gpu: str | None = None
    workload: str | None = None
    input_len: float | None = None
    output_len: float | None = None
    dense_batch: str = "auto"
    time_limit: float | None = None
    workers: int = 2
    max_nano_ops: int = 4
    max_period_us: float | None = None
    out: str | None = None
    command: str = ""
    allow_unsettled: bool = False
    allow_rs_ag: bool = False
    kv_dtype: str = "auto"
    quantization: str = "none"  # the layer weights the schedule runs on (none | fp8)
    buckets: str = "all"
    min_gain: float | None = None

    @property
    def limit_s(self) -> float:
        """The whole search's solver work (CP-SAT deterministic seconds): `time_limit`, else
        the default for `buckets`."""
        return DEFAULT_TIME_LIMIT[self.buckets] if self.time_limit is None else self.time_limit

    @property
    def gain(self) -> float:
        return MIN_GAIN if self.min_gain is None else self.min_gain

    def check(self) -> None:
        """Refuse a flag out of range, naming it (before anything is read or searched)."""
        if self.buckets not in BUCKETS:
            raise ConfigError(f"--buckets must be one of {', '.join(BUCKETS)}, got "
                              f"{self.buckets!r}")
        if not self.gain >= 1.0:
            raise ConfigError(f"--min-gain must be at least 1.0, got {self.gain}")
        if not 0 < self.limit_s < math.inf:
            raise ConfigError(f"--time-limit must be a finite number of seconds > 0, got "
                              f"{self.limit_s}")
        if self.workers < 1 or self.max_nano_ops < 2:
            raise ConfigError("--workers must be >= 1 and --max-nano-ops >= 2; "
                              f"got {self.workers}, {self.max_nano_ops}")
        if self.max_period_us is not None and not 0 < self.max_period_us < math.inf:
            raise ConfigError(f"--max-period-us must be a finite number of microseconds > 0, "
                              f"got {self.max_period_us}")


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


def check_rp_tables(prof: Profile, where: str) -> None:
    """Refuse a profile without R->P points for a class its layer overlaps (memory; network
    at tp > 1): the search would have nothing to price overlap with and say NO GAIN for it."""
    for cls in RP_CLASSES[:1] if prof.tp == 1 else RP_CLASSES:
        if not prof.rp.get(cls):
            raise ProfileError(f"{where} has an empty R->P table for class {cls!r}: nothing "
                               f"to price overlap with; derive it from the profile's pairs "
                               f"(`nanosched profile rederive`) or measure them again")


def resolve(spec: ModelSpec, tp: int | None, profile_arg: str | None, gpu_name: str | None,
            workload: Workload, dense_batch: str, folder: Path | None = None,
            kv_dtype: str = "auto", quantization: str = "none") -> Choice:
    """Decide tp, profile (None means: build a synthetic one) and dense batch."""
    gpu = get_gpu(gpu_name or DEFAULT_GPU)
    fp8_gemm(optable.KQV, quantization)  # an unknown --quantization is refused here
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
        prof, why = pick_shipped_profile(spec, tp, gpu_name or DEFAULT_GPU, folder, kv_dtype,
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
