"""The structures the search allocates: the decode/prompt split beside stage I's own."""

import pytest

from nanosched.autosearch import search
from nanosched.autosearch.opgraph import TokenMix, layer_graph
from nanosched.autosearch.request import resolve
from nanosched.autosearch.search import SearchConfig, boundary_cuts, run_search
from nanosched.autosearch.sets import key_config
from nanosched.models.spec import load_spec
from nanosched.workloads import fixed


def test_boundary_cuts_split_every_op_at_the_decode_rows():
    graph = layer_graph(load_spec("llama3-8b"), 1)
    cuts = boundary_cuts(graph, TokenMix(1024, 384, 1024))
    assert cuts == {o.name: (3,) for o in graph.ops}
    for mix in (TokenMix(1024, 0, 1024), TokenMix(1024, 1024, 1024), TokenMix(1024, 320, 1024)):
        assert boundary_cuts(graph, mix) is None  # not mixed, or off the 128-token grid


@pytest.fixture(scope="module")
def steady_h100() -> SearchConfig:
    spec = load_spec("llama3-8b")
    wl = fixed(1024, 512)
    choice = resolve(spec, None, None, "h100", wl, "1024")
    cfg = SearchConfig(spec, choice.tp, choice.profile, wl, choice.dense_batch,
                       time_limit_s=2.0, deterministic=True)
    return key_config(cfg, 384, 1024)


@pytest.mark.slow
def test_search_keeps_the_faster_structure(steady_h100, monkeypatch):
    """On the shipped H100 profile's steady state the decode/prompt split allocates faster than
    stage I's structure (whose interference-free optimum stage II cannot fill): both are
    allocated and the faster forward is kept."""
    both = run_search(steady_h100)
    assert [list(r) for r in both.ranges["kqv"]] == [[0, 384], [384, 1024]]
    monkeypatch.setattr(search, "boundary_cuts", lambda graph, mix: None)
    alone = run_search(steady_h100)
    assert both.prediction.iteration_us < alone.prediction.iteration_us


def test_stage_one_chooses_reduce_scatter_only_when_asked(monkeypatch):
    """At tp > 1 stage I is given the all-reduce form alone (what the runtime replays) unless
    the config allows both; an unknown or all-reduce-less choice is refused."""
    import dataclasses

    from search_fixtures import small_profile

    from nanosched.errors import ConfigError, ScheduleError
    from nanosched.schedules.validate import FORMS

    seen = []

    def record(prob, limits, progress):
        seen.append(prob.graph.groups())
        raise ScheduleError("recorded")

    monkeypatch.setattr(search, "solve_stage1", record)
    cfg = SearchConfig(load_spec("llama3-8b"), 2, small_profile(2, 256), fixed(512, 512), 256,
                       time_limit_s=1.0, deterministic=True)
    for forms in (cfg.forms, FORMS):
        with pytest.raises(ScheduleError, match="recorded"):
            run_search(dataclasses.replace(cfg, forms=forms))
    assert seen == [{"attn": ("ar",), "ffn": ("ar",)},
                    {"attn": ("ar", "rs_ag"), "ffn": ("ar", "rs_ag")}]
    for bad in ((), ("rs_ag",), ("ar", "broadcast")):
        with pytest.raises(ConfigError, match="collective forms must include 'ar'"):
            run_search(dataclasses.replace(cfg, forms=bad))
