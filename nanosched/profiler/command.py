"""`nanosched profile`: from flags to a measured profile file (what the CLI calls).

The dense batch defaults to what the cost model says fits this GPU's memory for the workload,
capped at 2,048 tokens as `nanosched analyze` does; `--dense-batch` overrides it.
`--time-limit S` counts from the command's start (the backend's start included) and stops
before the piece that would end after it (profiler/budget.py), the partial file saved.
`nanosched profile forward FILE` measures the forward table of a finished profile (one taken
before profiles had it) on the GPU it was taken on, from its own kernel rows.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanosched.errors import ConfigError, ProfileError
from nanosched.fileio import check_output_file
from nanosched.hardware import GIB, GPUSpec
from nanosched.models import ops as optable
from nanosched.models.costmodel import DEFAULT_MAX_DENSE_BATCH, max_dense_batch
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.profiler.backend import ProfilerBackend, Unsupported
from nanosched.profiler.format import Profile, load_profile, save_profile
from nanosched.profiler.plan import ProfileSettings
from nanosched.profiler.runner import (
    FORWARD_NOTE,
    FORWARD_NOTE_PREFIX,
    RunOptions,
    forward_rows,
    run_profile,
)
from nanosched.workloads import Workload


@dataclass(frozen=True)
class ProfileConfig:
    gpu: int
    model: str
    tp: int
    workload: Workload
    out: Path | None = None
    quick: bool = False
    resume: bool = False
    dense_batch: int | None = None
    progress: bool = True
    fake: bool = False  # a simulated GPU (fake.FakeBackend): a dry run of the whole flow
    kv_dtype: str = "auto"  # the KV cache the attention rows read (auto | fp8)
    quantization: str = "none"  # the layer weights the GEMM rows run on (none | fp8)
    spec: ModelSpec | None = None  # the model's shapes when `model` names no registered one
    registry: Any = None  # the implementations measured (a frontend model's; default: impls)
    time_limit: float | None = None  # seconds from `started`: stop and save before it
    started: float = field(default_factory=time.monotonic)


def default_out(model: str, tp: int, quick: bool) -> Path:
    return Path(f"profile-{Path(model).stem}-tp{tp}{'-quick' if quick else ''}.json")


def dense_batch_for(spec: ModelSpec | str, tp: int, workload: Workload,
                    memory_bytes: int, quantization: str = "none") -> int:
    spec = load_spec(spec) if isinstance(spec, str) else spec
    gpu = GPUSpec("measured", "", 0, memory_bytes / GIB, 1.0, 1.0, 1.0)
    return min(max_dense_batch(spec, gpu, tp, workload, quantization=quantization),
               DEFAULT_MAX_DENSE_BATCH)


def make_backend(cfg: ProfileConfig) -> ProfilerBackend:
    if cfg.gpu < 0:
        raise ConfigError(f"--gpu must be a CUDA device index (0, 1, ...), got {cfg.gpu}")
    if cfg.fake:
        from nanosched.profiler.fake import FakeBackend

        return FakeBackend(registry=cfg.registry)
    try:
        from nanosched.profiler.gpu_backend import GPUBackend
    except ImportError as exc:
        raise ConfigError(f"--gpu needs torch with CUDA and triton: {exc}") from exc
    return GPUBackend(cfg.gpu, rep_ms=5.0 if cfg.quick else 10.0, registry=cfg.registry)


def resume_hint(cfg: ProfileConfig) -> str:
    argv = [a for a in sys.argv[1:] if a != "--resume"]
    return f"`nanosched {shlex.join(argv)} --resume`" if argv else "--resume"


def check_workload_fits(spec: ModelSpec, workload: Workload) -> None:
    """A workload whose mean prompt is longer than the model's positions would be profiled at
    prefill contexts the model cannot hold (capped there), and the search would then refuse
    the profile: refuse it here, before any measurement."""
    if workload.input_len > spec.max_position_embeddings:
        raise ConfigError(f"workload {workload.name}: prompts of {workload.input_len:g} tokens "
                          f"do not fit {spec.name}'s {spec.max_position_embeddings} positions: "
                          f"give --input-len (or --workload) that fits")


def profile_gpu(cfg: ProfileConfig, log: Callable[[str], None] = print) -> Profile:
    """Measure the profile `cfg` asks for and write it; returns it.

    The output path (and so its `.partial.json` beside it) is checked before the backend
    starts: a folder, a missing parent or an unwritable place fails now, not after the run."""
    spec = cfg.spec or load_spec(cfg.model)
    spec.check_tp(cfg.tp)
    if cfg.quantization == "fp8" and cfg.registry is not None:
        raise ConfigError("--quantization fp8 times nanosched's FP8 layer GEMMs; a --frontend "
                          "model's ops run as its own code does: profile it without "
                          "--quantization")
    check_workload_fits(spec, cfg.workload)
    if cfg.time_limit is not None and not cfg.time_limit > 0:
        raise ConfigError(f"--time-limit must be a positive number of seconds, got "
                          f"{cfg.time_limit:g}")
    check_output_file(cfg.out or default_out(cfg.model, cfg.tp, cfg.quick), "--out",
                      make_parent=False)
    backend = make_backend(cfg)
    identity = backend.identity("")
    dense = cfg.dense_batch or dense_batch_for(spec, cfg.tp, cfg.workload,
                                               identity.memory_bytes, cfg.quantization)
    settings = ProfileSettings(spec, cfg.tp, cfg.workload, dense, cfg.quick,
                               kv_dtype=cfg.kv_dtype, quantization=cfg.quantization)
    out = cfg.out or default_out(cfg.model, cfg.tp, cfg.quick)
    opts = RunOptions(out=out, resume=cfg.resume, progress=cfg.progress,
                      command="nanosched " + shlex.join(sys.argv[1:]), log=log,
                      resume_hint=resume_hint(cfg),
                      deadline=cfg.started + cfg.time_limit if cfg.time_limit else None)
    log(f"profiling {spec.name} tp {cfg.tp} on {identity.gpu_name} ({identity.num_sms} SMs): "
        f"dense batch {dense}, workload p={cfg.workload.input_len:g} "
        f"d={cfg.workload.output_len:g}{', quick grid' if cfg.quick else ''}"
        f"{', FP8 KV cache' if cfg.kv_dtype == 'fp8' else ''}"
        f"{', FP8 weights (W8A8)' if cfg.quantization == 'fp8' else ''} -> {out}")
    return run_profile(settings, backend, opts)


def add_forward(path: Path, gpu: int, workload: Workload, out: Path | None = None,
                fake: bool = False, progress: bool = True,
                log: Callable[[str], None] = print) -> Profile:
    """Measure the forward table of the profile at `path` and write it with the table (to
    `out`, else `path`, atomically). The layers run the profile's fastest rows on all SMs at
    `workload`'s mix; the GPU must be the one the profile was measured on."""
    from dataclasses import replace

    from tqdm import tqdm

    from nanosched.profiler.plan import KernelTask, layer_tasks

    target = out or path
    check_output_file(target, "--out", make_parent=False)
    prof = load_profile(path)
    backend = make_backend(ProfileConfig(gpu, prof.model.name, prof.tp, workload, fake=fake))
    try:
        here = backend.identity("").gpu_name
        if here != prof.identity.gpu_name:
            raise ProfileError(f"profile {path} was measured on {prof.identity.gpu_name!r}, "
                               f"this GPU is {here!r}: its forward table must be measured on "
                               f"the GPU its rows were")
        settings = ProfileSettings(prof.model, prof.tp, workload, prof.dense_batch,
                                   kv_dtype=prof.kv_dtype, quantization=prof.quantization)
        num_sms = prof.identity.num_sms
        full = {}
        for k in prof.kernels:
            key = (k.op, k.tokens, k.context)
            if k.sms == num_sms and k.mechanism == "full" and (
                    key not in full or k.time_us < full[key].time_us):
                full[key] = k
        contexts = sorted({c for op, _, c in full if op == optable.ATTN_DECODE}) or [0]
        tasks = layer_tasks(settings, num_sms, contexts,
                            lambda op, t, c: full[(op, t, c)].impl if (op, t, c) in full
                            else None)
        if not tasks:
            raise ProfileError(f"profile {path} has no full-GPU rows for a layer of the "
                               f"workload's mix (p={workload.input_len:g}, "
                               f"d={workload.output_len:g}); give the workload it was "
                               f"measured for (--input-len/--output-len or --workload)")
        window = (settings.pair_settle_ms + settings.pair_window_ms) / 1e3
        sizes = ", ".join(f"{t.tokens}{' decode' if t.num_decode == t.tokens else ''}"
                          for t in tasks)
        log(f"timing a Sequential layer of {prof.model.name} at {sizes} rows on {here}, each "
            f"looped {window:.1f} s so that the clock settles under the power cap")

        def row_us(k: KernelTask) -> float:
            return full[(k.op, k.tokens, k.context)].time_us

        rows = []
        for task in tqdm(tasks, unit="layer", disable=not progress, desc="forward"):
            try:
                rows += forward_rows(backend, settings, task, row_us)
            except Unsupported as exc:
                raise ProfileError(f"forward table of {path}: {exc}") from None
    finally:
        backend.close()
    notes = tuple(n for n in prof.notes if not n.startswith(FORWARD_NOTE_PREFIX)) + (
        FORWARD_NOTE,)
    fresh = replace(prof, forward=tuple(rows), notes=notes)
    save_profile(fresh, target)
    log(f"wrote {target}: forward table of {len(tasks)} layers")
    return fresh
