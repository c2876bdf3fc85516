"""A small searched schedule shared by the schedule, checker and simulator tests."""

from __future__ import annotations

import functools

from nanosched.autosearch.search import SearchConfig, batch_info, run_search
from nanosched.autosearch.synthetic import context_grid, synthetic_profile
from nanosched.hardware import get_gpu
from nanosched.models.spec import load_spec
from nanosched.profiler.format import Profile
from nanosched.schedules.format import Schedule
from nanosched.workloads import fixed


@functools.cache
def small_profile(tp: int = 1, batch: int = 768) -> Profile:
    spec = load_spec("llama3-8b")
    b = batch_info(fixed(512, 512), batch)
    return synthetic_profile(spec, get_gpu("h100"), tp, batch,
                             context_grid(b.decode_context, b.prompt_len))


@functools.cache
def small_schedule(tp: int = 1, batch: int = 768) -> Schedule:
    """llama3-8b, half decode / half prefill tokens; deterministic, so reproducible.

    At 768 tokens (tp 1) the search overlaps decode attention with GEMMs; at 256 tokens
    (tp 2) it has network nano-ops. 3.5 deterministic seconds: stage I's tighter model
    reaches its optimum early, and stage II needs the rest to place the overlap it asks for.
    """
    cfg = SearchConfig(load_spec("llama3-8b"), tp, small_profile(tp, batch), fixed(512, 512),
                       batch, time_limit_s=3.5, num_workers=2, deterministic=True)
    return run_search(cfg)


def synthetic_set_config(time_limit_s: float = 6.0) -> SearchConfig:
    """The set searches' configuration: llama3-8b at 1024 / 512, dense batch 512, on a
    synthetic H100 profile; deterministic."""
    from nanosched.workloads import resolve_workload

    spec = load_spec("llama3-8b")
    wl = resolve_workload(None, 1024, 512)
    b = batch_info(wl, 512)
    prof = synthetic_profile(spec, get_gpu("h100"), 1, 512,
                             context_grid(b.decode_context, b.prompt_len))
    return SearchConfig(spec, 1, prof, wl, 512, time_limit_s=time_limit_s, deterministic=True)
