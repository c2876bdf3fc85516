"""The pipeline ceiling (bench/analysis/ceiling.py): an LP over row-group structures that bounds
what a pipeline of those structures can be predicted, set against the search and the bound."""


import pytest
from search_fixtures import no_pair_gain, searched_key, synthetic_set_config

from bench.analysis import ceiling
from bench.analysis.ceiling import compositions, pipeline_ceiling
from nanosched.autosearch.sets import key_batch, overlap_bound
from nanosched.autosearch.simulate import sequential_op_times
from nanosched.schedules.sets import layer_times_us


@pytest.fixture(scope="module")
def synthetic():
    return synthetic_set_config()


def test_compositions_cut_the_quanta_into_groups():
    assert compositions(0, 2, False) == [()]
    assert compositions(3, 2, False) == [(384,), (128, 256), (256, 128)]
    assert compositions(3, 3, True) == [(384,), (128, 256), (128, 128, 128)]
    assert all(sum(c) == 5 * 128 for c in compositions(5, 3, False))
    assert len(compositions(5, 3, False)) == 1 + 4 + 6


@pytest.mark.slow
def test_no_pair_worth_more_than_alone_means_no_gain(synthetic):
    """Every R->P point cut to P_compute + P_other <= 1: no mode does more than a unit of work
    per unit of time, so no structure beats Sequential."""
    flat = no_pair_gain(synthetic)
    for d, t in [(256, 512), (0, 512), (512, 512)]:
        top = pipeline_ceiling(flat, key_batch(flat, d, t))
        assert top.gain <= 1 + 1e-6, (d, t, top.best)
    assert pipeline_ceiling(synthetic, key_batch(synthetic, 256, 512)).gain > 1.05


@pytest.mark.slow
def test_the_ceiling_is_above_what_the_search_finds_and_below_the_bound(synthetic, shared_cache):
    for d, t in [(256, 512), (0, 512), (512, 512), (128, 384)]:
        batch = key_batch(synthetic, d, t)
        top = pipeline_ceiling(synthetic, batch)
        sched = searched_key(d, t, shared_cache)
        forward, sequential = layer_times_us(sched)
        assert sequential / forward <= top.gain + 1e-6, (d, t, top.best)
        # the bound prices ops in integer ticks: within a tick per op of it
        assert top.gain <= overlap_bound(synthetic, batch) * 1.01, (d, t)
        assert top.structures and top.best in top.structures


@pytest.mark.slow
def test_one_allocation_per_piece_lowers_the_ceiling(synthetic, monkeypatch):
    monkeypatch.setattr(ceiling, "MILP_SECONDS", 5.0)  # stopped there, it keeps its bound
    batch = key_batch(synthetic, 128, 384)
    seq = sum(sequential_op_times(synthetic.spec, 1, synthetic.profile, batch).values())
    mixed = ceiling.structure_ceiling(synthetic, batch, (128,), (256,), seq)
    one = ceiling.structure_ceiling(synthetic, batch, (128,), (256,), seq, one_option=True)
    assert one.gain <= mixed.gain + 1e-6
    assert one.gain > 1.0  # the synthetic pairs still pay with one allocation per piece
