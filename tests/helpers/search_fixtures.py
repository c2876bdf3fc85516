"""A small searched schedule shared by the schedule, checker and simulator tests."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

from repo import DATA
from run_cache import computed_once

from nanosched.autosearch.search import SearchConfig, batch_info, run_search
from nanosched.autosearch.synthetic import context_grid, synthetic_profile
from nanosched.hardware import get_gpu
from nanosched.models.spec import load_spec
from nanosched.profiler.format import Profile
from nanosched.schedules.format import Schedule, load_schedule, save_schedule
from nanosched.workloads import fixed


@functools.cache
def small_profile(tp: int = 1, batch: int = 768) -> Profile:
    spec = load_spec("llama3-8b")
    b = batch_info(fixed(512, 512), batch)
    return synthetic_profile(spec, get_gpu("h100"), tp, batch,
                             context_grid(b.decode_context, b.prompt_len))


def no_pair_gain(cfg: SearchConfig) -> SearchConfig:
    """`cfg` with every R->P point of its profile cut to P_compute + P_other <= 1: no mode does
    more than a unit of work per unit of time, so nothing can be predicted to beat Sequential."""
    prof = cfg.profile

    def cut(points):
        return tuple(replace(p, p_compute=min(p.p_compute, 1 - p.p_other)) for p in points)

    return replace(cfg, profile=replace(
        prof, rp={k: cut(v) for k, v in prof.rp.items()},
        rp_shapes={k: cut(v) for k, v in prof.rp_shapes.items()}))


SMALL_SCHEDULE = DATA / "small_schedule_llama3-8b_tp1_b768.json"


@functools.cache
def small_schedule() -> Schedule:
    """The searched schedule the checker, format and simulator tests alter (llama3-8b at 768
    tokens, half decode, half prefill, on `small_profile()`: stage II overlaps decode attention
    with GEMMs). Read from tests/data, where `python tests/helpers/search_fixtures.py` writes
    `search_small_schedule()` again; a search takes a minute on two cores, and
    tests/autosearch/test_check.py searches it afresh (marked slow). Its profile digest ties it
    to `small_profile()`: when the synthetic profile changes, `check_schedule` names the
    mismatch and the file must be written again."""
    return load_schedule(SMALL_SCHEDULE)


def search_small_schedule(tp: int = 1, batch: int = 768) -> Schedule:
    """llama3-8b, half decode / half prefill tokens; deterministic, so reproducible.

    At 768 tokens (tp 1) the search overlaps decode attention with GEMMs; at 256 tokens
    (tp 2) it has network nano-ops. 3.5 deterministic seconds: stage I's tighter model
    reaches its optimum early, and stage II needs the rest to place the overlap it asks for.
    """
    cfg = SearchConfig(load_spec("llama3-8b"), tp, small_profile(tp, batch), fixed(512, 512),
                       batch, time_limit_s=3.5, num_workers=2, deterministic=True)
    return run_search(cfg)


@functools.cache
def searched_key(num_decode: int, num_tokens: int, shared: Path | None = None) -> Schedule:
    """The search of one key of `synthetic_set_config()` given 2 deterministic seconds, shared
    by the tests that set its prediction against the bound and the ceiling (3-18 s of CPU a
    key): once per process, and once per run where `shared` is the `shared_cache` folder."""
    from dataclasses import replace

    from nanosched.autosearch.sets import key_config

    def search() -> Schedule:
        cfg = key_config(synthetic_set_config(), num_decode, num_tokens)
        return run_search(replace(cfg, time_limit_s=2.0))

    return computed_once(shared, f"searched-key-{num_decode}-{num_tokens}", search)


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


if __name__ == "__main__":  # write the stored small schedule again
    save_schedule(search_small_schedule(), SMALL_SCHEDULE)
    print(f"wrote {SMALL_SCHEDULE}")
