"""`nanosched search`: from a `SearchRequest` to a schedule set written to a file (what the CLI
calls, beside the profiler's profiler/command.py).

`search_command` checks the request, resolves the model, workload, profile, tp and dense batch
(autosearch/request.py), searches every batch shape (or only the steady state's) with live
progress through `echo`, and writes the set; it returns what the CLI reports. A measured profile
whose pairs were timed in bursts is refused (its R->P points overstate overlap under the power
cap) unless `allow_unsettled`. Ctrl-C stops the search with KeyboardInterrupt and writes
nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nanosched.autosearch.cpsat import Progress
from nanosched.autosearch.request import SearchRequest, resolve
from nanosched.autosearch.search import SearchConfig, batch_info, search_batch
from nanosched.autosearch.sets import SetSearchConfig, search_set
from nanosched.autosearch.synthetic import context_grid, synthetic_profile
from nanosched.constants import DEFAULT_GPU
from nanosched.errors import ConfigError, ProfileError
from nanosched.fileio import check_output_file
from nanosched.hardware import get_gpu
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.profiler.catalog import load_named_profile
from nanosched.schedules.format import REPLAYED_FORMS
from nanosched.schedules.sets import ScheduleSet, save_schedule_set
from nanosched.schedules.show import proof_text
from nanosched.schedules.validate import FORMS
from nanosched.workloads import Workload, resolve_workload


@dataclass(frozen=True)
class SearchOutcome:
    """What a search wrote: the set, its file, and whether its profile was synthetic."""

    sset: ScheduleSet
    path: str
    synthetic: bool
    dense_only: bool  # `--buckets dense`: the steady state's entry alone
    what: str = ""  # what was searched, in words
    work: float = 0.0  # the solver work it was given (CP-SAT deterministic seconds)
    wall_s: float = 0.0  # how long it took


def default_out(spec: ModelSpec, tp: int, gpu: str, workload: Workload, batch: int) -> str:
    """e.g. `llama3-70b_tp8_h100_in1024-out512_b2048.schedule.json`."""
    gpu_key = gpu.lower().removeprefix("synthetic-").replace(" ", "-")
    return f"{spec.name}_tp{tp}_{gpu_key}_{workload.name}_b{batch}.schedule.json"


def profile_model(profile: str | None) -> ModelSpec:
    """The model a measured profile was taken for (`search` without --model: a model the
    registry does not know, such as a frontend model's)."""
    if profile is None:
        raise ConfigError("nanosched search needs --model, or --profile FILE to take the model "
                          "it was measured for")
    return load_named_profile(profile, None).model


def search_command(req: SearchRequest, echo: Progress) -> SearchOutcome:
    """Resolve, search a schedule set with live progress, write it (module docstring)."""
    req.check()
    limit, gain = req.limit_s, req.gain
    if req.out is not None:
        check_output_file(req.out, "--out", make_parent=False)
    spec = load_spec(req.model) if req.model is not None else profile_model(req.profile)
    wl = resolve_workload(req.workload, req.input_len, req.output_len)
    choice = resolve(spec, req.tp, req.profile, req.gpu, wl, req.dense_batch,
                     kv_dtype=req.kv_dtype, quantization=req.quantization)
    for msg in choice.messages:
        echo(msg)
    prof = choice.profile
    measured = prof
    if prof is None:
        b = batch_info(wl, choice.dense_batch)
        prof = synthetic_profile(spec, get_gpu(req.gpu or DEFAULT_GPU), choice.tp,
                                 choice.dense_batch, context_grid(b.decode_context, b.prompt_len),
                                 req.quantization)
    cfg = SearchConfig(spec, choice.tp, prof, wl, choice.dense_batch, limit, req.workers,
                       req.max_nano_ops, req.max_period_us, req.command,
                       forms=FORMS if req.allow_rs_ag else REPLAYED_FORMS, deterministic=True)
    why = measured.unsettled() if measured is not None else None
    if why and not req.allow_unsettled:
        raise ProfileError(f"profile for {prof.model.name} on {prof.identity.gpu_name}: {why}, "
                           f"so its R->P points overstate what overlap gives on a serving GPU; "
                           f"re-measure it with `nanosched profile` (pairs are timed sustained), "
                           f"or pass --allow-unsettled to search on it anyway")
    if why:
        echo(f"WARNING: {why}; searching on it because of --allow-unsettled")
    path = req.out or default_out(spec, choice.tp, prof.identity.gpu_name, wl,
                                  choice.dense_batch)
    if req.out is None:
        check_output_file(path, "--out", make_parent=False)
    steady = search_batch(cfg)
    keys = ((steady.num_decode, steady.dense_batch),) if req.buckets == "dense" else None
    what = "the steady-state batch" if keys else "every batch shape (bounds first)"
    echo(f"searching {spec.name} tp={choice.tp}, dense batch {choice.dense_batch}, {what}, "
         f"solver work {limit:g} (CP-SAT deterministic time, about a second each on an idle "
         f"core: the verdict does not depend on the machine's load), {req.workers} workers")
    started = time.perf_counter()

    def on_decided(decided: list, to_search: int, n: int) -> None:
        if keys is not None:
            return
        how = [r.how for r in decided]
        echo(f"[{len(decided)}/{n}] decided without a search: {how.count('small')} too small "
             f"for two nano-batches, {how.count('bounded') + how.count('ceiling')} bounded "
             f"below {gain:.2f}x ({how.count('bounded')} by the bound, "
             f"{how.count('ceiling')} by the ceiling); "
             f"searching {to_search}, the steady state's D={steady.num_decode} "
             f"T={steady.dense_batch} first ({time.perf_counter() - started:.0f} s)")

    def on_key(r: object, i: int, n: int) -> None:
        e = r.entry  # type: ignore[attr-defined]
        if r.how in ("small", "bounded", "ceiling") and keys is None:  # type: ignore
            return
        elapsed = time.perf_counter() - started
        proof = proof_text(e, gain)
        echo(f"[{i}/{n}] D={e.num_decode} T={e.num_tokens}: {e.kind}, {e.reason}"
             f"{'; NO GAIN ' + proof if proof else ''} "
             f"({r.wall_s:.1f} s; {elapsed:.0f} s so far)")  # type: ignore[attr-defined]

    sset = search_set(SetSearchConfig(cfg, gain, keys, bound=keys is None),
                      echo if keys else None, on_key, on_decided)
    save_schedule_set(sset, path)
    return SearchOutcome(sset, path, choice.profile is None, keys is not None, what, limit,
                         time.perf_counter() - started)
