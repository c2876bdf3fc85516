"""`nanosched profile`: from flags to a measured profile file (what cli.py calls).

The dense batch defaults to what the cost model says fits this GPU's memory for the workload,
capped at 2,048 tokens as `nanosched analyze` does; `--dense-batch` overrides it.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nanosched.costmodel import DEFAULT_MAX_DENSE_BATCH, max_dense_batch
from nanosched.errors import ConfigError
from nanosched.fileio import check_output_file
from nanosched.hardware import GIB, GPUSpec
from nanosched.models.spec import load_spec
from nanosched.profiler.backend import ProfilerBackend
from nanosched.profiler.format import Profile
from nanosched.profiler.plan import ProfileSettings
from nanosched.profiler.runner import RunOptions, run_profile
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


def default_out(model: str, tp: int, quick: bool) -> Path:
    return Path(f"profile-{Path(model).stem}-tp{tp}{'-quick' if quick else ''}.json")


def dense_batch_for(spec_name: str, tp: int, workload: Workload, memory_bytes: int) -> int:
    spec = load_spec(spec_name)
    gpu = GPUSpec("measured", "", 0, memory_bytes / GIB, 1.0, 1.0, 1.0)
    return min(max_dense_batch(spec, gpu, tp, workload), DEFAULT_MAX_DENSE_BATCH)


def make_backend(cfg: ProfileConfig) -> ProfilerBackend:
    if cfg.gpu < 0:
        raise ConfigError(f"--gpu must be a CUDA device index (0, 1, ...), got {cfg.gpu}")
    if cfg.fake:
        from nanosched.profiler.fake import FakeBackend

        return FakeBackend()
    try:
        from nanosched.profiler.gpu_backend import GPUBackend
    except ImportError as exc:
        raise ConfigError(f"--gpu needs torch with CUDA and triton: {exc}") from exc
    return GPUBackend(cfg.gpu, rep_ms=5.0 if cfg.quick else 10.0)


def resume_hint(cfg: ProfileConfig) -> str:
    argv = [a for a in sys.argv[1:] if a != "--resume"]
    return f"`nanosched {shlex.join(argv)} --resume`" if argv else "--resume"


def profile_gpu(cfg: ProfileConfig, log: Callable[[str], None] = print) -> Profile:
    """Measure the profile `cfg` asks for and write it; returns it.

    The output path (and so its `.partial.json` beside it) is checked before the backend
    starts: a folder, a missing parent or an unwritable place fails now, not after the run."""
    spec = load_spec(cfg.model)
    spec.check_tp(cfg.tp)
    check_output_file(cfg.out or default_out(cfg.model, cfg.tp, cfg.quick), "--out",
                      make_parent=False)
    backend = make_backend(cfg)
    identity = backend.identity("")
    dense = cfg.dense_batch or dense_batch_for(cfg.model, cfg.tp, cfg.workload,
                                               identity.memory_bytes)
    settings = ProfileSettings(spec, cfg.tp, cfg.workload, dense, cfg.quick,
                               kv_dtype=cfg.kv_dtype)
    out = cfg.out or default_out(cfg.model, cfg.tp, cfg.quick)
    opts = RunOptions(out=out, resume=cfg.resume, progress=cfg.progress,
                      command="nanosched " + shlex.join(sys.argv[1:]), log=log,
                      resume_hint=resume_hint(cfg))
    log(f"profiling {spec.name} tp {cfg.tp} on {identity.gpu_name} ({identity.num_sms} SMs): "
        f"dense batch {dense}, workload p={cfg.workload.input_len:g} "
        f"d={cfg.workload.output_len:g}{', quick grid' if cfg.quick else ''}"
        f"{', FP8 KV cache' if cfg.kv_dtype == 'fp8' else ''} -> {out}")
    return run_profile(settings, backend, opts)
