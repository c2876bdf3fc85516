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
