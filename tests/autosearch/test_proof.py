"""Whether a set's NO GAIN is proven (autosearch/proof.py): the resource ceiling bounds what
the search finds, the proof each sequential entry gets, `show` printing each, and set files
written before proofs load and show as they did."""

import json
from dataclasses import replace

import pytest
from repo import DATA, ROOT
from search_fixtures import no_pair_gain, small_profile, synthetic_set_config
from typer.testing import CliRunner

from nanosched.autosearch import proof
from nanosched.autosearch.proof import resource_ceiling, structure_gain, with_proof
from nanosched.autosearch.search import SearchConfig, run_search
from nanosched.autosearch.sets import SetSearchConfig, key_batch, key_config, search_set
from nanosched.cli import app
from nanosched.errors import ScheduleError
from nanosched.models.spec import load_spec
from nanosched.schedules.format import load_schedule
from nanosched.schedules.sets import (
    SET_FORMAT,
    ScheduleSet,
    SetEntry,
    from_single,
    layer_times_us,
    load_schedule_set,
    save_schedule_set,
)
from nanosched.schedules.show import proof_text
from nanosched.workloads import fixed


@pytest.fixture(scope="module")
def synthetic():
    return synthetic_set_config()


@pytest.fixture(scope="module")
def tiny():
    """A searched schedule whose stage I is optimal and stage II within 3.4% of its bound;
    stage II's bound is 0.66x of Sequential's period."""
    return load_schedule(DATA / "tiny_llama_schedule.json")


def with_gaps(sched, gap1, gap2):
    stages = {s.stage: s for s in sched.stages}
    return replace(sched, stages=(replace(stages["stage I"], gap=gap1),
                                  replace(stages["stage II"], gap=gap2)))


def sequential(d=128, t=256):
    return SetEntry(d, t, "sequential", 1000.0, 1000.0, "searched: 0.99x")


def test_no_pair_worth_more_than_alone_gives_a_ceiling_of_one(synthetic):
    """Every R->P point cut to P_compute + P_other <= 1: no mode does more than a unit of work
    per unit of time, so no pipeline can be predicted to beat Sequential."""
    flat = no_pair_gain(synthetic)
    for d, t in [(256, 512), (0, 512), (512, 512), (128, 256)]:
        assert resource_ceiling(flat, key_batch(flat, d, t)).gain <= 1 + 1e-9, (d, t)
    assert resource_ceiling(synthetic, key_batch(synthetic, 256, 512)).gain > 1.05


def test_the_lp_optimum_does_every_ops_work_in_modes_that_may_run(synthetic):
    """`solve_modes` (what bench/analysis/ceiling_modes.py prints) is the ceiling's optimum:
    its modes fill the period, do each op's least split row time, hold at most one op per
    stream, each under options that may run at once."""
    from bench.analysis.ceiling_modes import beside

    batch = key_batch(synthetic, 256, 512)
    top = resource_ceiling(synthetic, batch)
    ops = proof.form_ops(synthetic, batch, top.forms)
    tau, used = proof.solve_modes(ops)
    assert tau == pytest.approx(top.period_us)
    assert sum(m.us for m in used) == pytest.approx(tau, rel=1e-6)
    assert [m.us for m in used] == sorted((m.us for m in used), reverse=True)
    for o in ops:
        done = sum(m.us * opt.p for m in used
                   for op, opt in zip(m.ops, m.options, strict=True) if op == o.op)
        assert done >= o.work_us * (1 - 1e-6), o.op
        assert sum(beside(used)[o.op].values()) == pytest.approx(
            sum(m.us for m in used if o.op in m.ops)), o.op
    for m in used:
        assert len(set(m.ops)) == len(m.ops) and proof.fits(m.options), m
    assert any(len(m.ops) > 1 for m in used)  # the synthetic pairs pay: something overlaps


def test_counting_nano_ops_gives_a_ceiling_no_higher_than_the_lp(synthetic):
    """--nano-ops (bench/analysis/ceiling_modes.py) only adds rows to the LP: its period is
    at least the LP's, and with whole nano-ops, each at one option, strictly more here."""
    from bench.analysis.ceiling_modes import nano_op_period

    for d, t in [(256, 512), (128, 256)]:
        batch = key_batch(synthetic, d, t)
        top = resource_ceiling(synthetic, batch)
        period, how = nano_op_period(synthetic, batch, top.forms, 10.0)
        assert how == "optimal"
        assert top.period_us * (1 + 1e-4) < period, (d, t)


@pytest.mark.slow
def test_the_ceiling_is_above_what_the_search_finds_and_the_grouped_ceiling(synthetic):
    """The search's pipelines (ops cut anywhere) stay under the ceiling; the LP over row-group
    structures (every op cut at the same rows) is a restriction of it, so it is no higher."""
    from bench.analysis.ceiling import pipeline_ceiling
    from bench.analysis.ceiling_modes import nano_op_period

    for d, t in [(256, 512), (0, 384)]:
        batch = key_batch(synthetic, d, t)
        ceiling = resource_ceiling(synthetic, batch)
        top = ceiling.gain
        sched = run_search(replace(key_config(synthetic, d, t), time_limit_s=1.0))
        forward, seq = layer_times_us(sched)
        assert seq / forward <= top + 1e-9, (d, t)
        # each op's nano-ops counted (bench/analysis/ceiling_modes.py --nano-ops) still bounds
        # what the search finds, whatever forms it took
        counted = ceiling.sequential_us / nano_op_period(synthetic, batch, sched.forms, 10.0)[0]
        assert seq / forward <= counted + 1e-9, (d, t)
        grouped = pipeline_ceiling(synthetic, key_batch(synthetic, d, t), equal_only=True)
        assert grouped.gain <= top + 1e-6, (d, t)


def random_allocations(sched, profile, seed):
    """`sched` with every nano-op at a random option of its size (and no resource
    dependencies: the replay places them as soon as they fit and may run together)."""
    import random

    from nanosched.autosearch.durations import FULL_SHARE, alloc_options, op_context
    from nanosched.schedules.format import Alloc

    rng, b = random.Random(seed), sched.batch
    ops = []
    for n in sched.nano_ops:
        ctx = op_context(n.op, b.decode_context, b.prompt_len)
        o = rng.choice(alloc_options(profile, n.resource, n.op, n.end - n.start,
                                     b.dense_batch, ctx))
        alloc = Alloc(o.share / FULL_SHARE, o.p, o.mechanism.value, o.units, o.impl, o.point,
                      o.side.value if o.side else "")
        ops.append(replace(n, alloc=alloc,
                           deps=tuple(d for d in n.deps if d.kind != "resource")))
    return replace(sched, nano_ops=tuple(ops))


@pytest.mark.slow
def test_the_ceilings_bound_the_search_pipelines_at_random_allocations(synthetic):
    """The LP ceiling and the one with nano-ops counted bound the replayed forward of the
    search's structures under any allocation, not only the solver's."""
    from bench.analysis.ceiling_modes import nano_op_period
    from nanosched.autosearch.simulate import sequential_baseline, simulate

    d, t = 256, 512
    batch = key_batch(synthetic, d, t)
    ceiling = resource_ceiling(synthetic, batch)
    sched = run_search(replace(key_config(synthetic, d, t), time_limit_s=1.0))
    counted = ceiling.sequential_us / nano_op_period(synthetic, batch, sched.forms, 10.0)[0]
    layers = synthetic.spec.num_layers
    seq = sequential_baseline(synthetic.spec, 1, synthetic.profile, sched.batch)[0] * layers
    gains = []
    for seed in range(20):
        sim = simulate(random_allocations(sched, synthetic.profile, seed), synthetic.profile)
        gains.append(seq / (sim.iteration_us - sim.lm_head_us))
    assert max(gains) <= counted + 1e-9 <= ceiling.gain + 2e-9
    assert len(set(gains)) > 1  # the allocations differ


@pytest.mark.slow
def test_at_tp_2_the_ceiling_covers_both_collective_forms():
    cfg = SearchConfig(load_spec("llama3-8b"), 2, small_profile(2, 256), fixed(512, 512), 256,
                       time_limit_s=1.0, deterministic=True)
    batch = key_batch(cfg, 128, 256)
    top = resource_ceiling(cfg, batch)
    assert set(top.forms) == {"attn", "ffn"}
    works = proof.op_works(cfg, batch)
    assert {"rs_attn", "ag_attn", "rs_ffn", "ag_ffn"} <= set(works)  # rs_ag priced too
    rs_ag = proof.least_period_us([works[n] for n in works if not n.startswith("ar_")])
    assert top.gain >= top.sequential_us / rs_ag - 1e-9
    sched = run_search(cfg)
    forward, seq = layer_times_us(sched)
    assert seq / forward <= top.gain + 1e-9


def test_a_large_gap_under_a_ceiling_below_min_gain_is_proven(tiny):
    e = with_proof(sequential(), with_gaps(tiny, 0.0, 0.3), 1.02, 1.05)
    assert (e.proof, e.ceiling, e.stage1_gap, e.stage2_gap) == ("ceiling", 1.02, 0.0, 0.3)


def test_a_ceiling_above_min_gain_with_stage_i_open_is_unproven(tiny):
    assert with_proof(sequential(), with_gaps(tiny, 0.2, 0.01), 1.3, 1.05).proof == "unproven"
    failed = with_proof(sequential(), None, 1.3, 1.05)  # the search found nothing
    assert (failed.proof, failed.stage1_gap, failed.stage2_gap, failed.structure_bound) == \
        ("unproven", None, None, None)


def test_stage_ii_bound_proves_the_structure_whatever_its_gap(tiny):
    """The claim is that no allocation of the kept structure reaches min_gain: stage II's
    bound caps them all, and how far the allocation found is from it does not matter."""
    e = with_proof(sequential(), with_gaps(tiny, 0.0, 0.3), 1.3, 1.05)
    assert e.proof == "gap" and e.stage2_gap == 0.3
    assert e.structure_bound == pytest.approx(structure_gain(tiny)) and e.structure_bound < 1
    assert with_proof(sequential(), tiny, 1.3, 1.05).proof == "gap"
    # stage II's bound prices the structure at 0.66x: a min gain below that is not settled
    assert with_proof(sequential(), tiny, 1.3, 0.5).proof == "unproven"
    pipe = with_proof(replace(sequential(), kind="pipeline", forward_us=900.0), tiny, 1.3, 1.05)
    assert pipe.proof is None and pipe.ceiling == 1.3  # a pipeline has nothing to prove


def test_the_set_search_rules_keys_out_by_the_ceiling_without_a_solve(synthetic, monkeypatch):
    """(128, 256): the bound allows 1.077x, the ceiling only 0.994x."""
    def no_solve(*args, **kwargs):
        raise AssertionError("a key the ceiling rules out was searched")

    monkeypatch.setattr("nanosched.autosearch.sets.run_search", no_solve)
    seen = []
    sset = search_set(SetSearchConfig(synthetic, 1.05, ((128, 256), (0, 256), (0, 128))),
                      on_key=lambda r, i, n: seen.append(r.how))
    assert sorted(seen) == ["bounded", "ceiling", "small"]
    by = {e.key: e for e in sset.entries}
    assert by[(128, 256)].proof == "ceiling" and by[(128, 256)].ceiling < 1.05
    assert "ceiling: no pipeline can beat 0.99" in by[(128, 256)].reason
    assert (by[(0, 256)].proof, by[(0, 128)].proof) == ("bound", "small")
    assert sset.search["ceiling"] == 1 and sset.search["bounded"] == 1


@pytest.mark.slow
def test_a_searched_key_records_its_ceiling_and_gaps(synthetic):
    """With the bounds off (`--buckets dense`) the key is searched; a min gain above the
    ceiling proves its NO GAIN whatever the gaps."""
    sset = search_set(SetSearchConfig(replace(synthetic, time_limit_s=1.0), 3.0,
                                      ((256, 512),), bound=False))
    (e,) = sset.entries
    assert e.kind == "sequential" and e.proof == "ceiling"
    assert e.ceiling == pytest.approx(resource_ceiling(synthetic,
                                                       key_batch(synthetic, 256, 512)).gain)
    assert e.stage1_gap is not None and e.stage2_gap is not None
    again = ScheduleSet.from_json(json.loads(json.dumps(sset.to_json())))
    assert again.entries[0] == e


def every_proof_set(tiny):
    base = from_single(tiny)
    entries = (replace(sequential(0, 128), proof="small"),
               replace(sequential(0, 256), proof="bound", reason="bound: 0.98x"),
               replace(sequential(128, 256), proof="ceiling", ceiling=1.02, stage1_gap=0.0,
                       stage2_gap=0.3),
               replace(sequential(256, 256), proof="gap", ceiling=1.3, stage1_gap=0.0,
                       stage2_gap=0.034, structure_bound=0.98),
               replace(sequential(128, 128), proof="unproven", ceiling=1.3, stage1_gap=0.1,
                       stage2_gap=0.2, structure_bound=1.1))
    return replace(base, entries=entries, min_gain=1.05, source_format=SET_FORMAT)


def test_show_prints_each_proof(tiny, tmp_path):
    path = tmp_path / "set.json"
    save_schedule_set(every_proof_set(tiny), path)
    r = CliRunner().invoke(app, ["show", str(path)])
    assert r.exit_code == 0, r.output
    for text in ("proven: no two nano-batches", "proven by the bound",
                 "proven: ceiling 1.020x < 1.05x",
                 "stands: stage II's bound 0.980x < 1.05x, stage I's gap 0.0% <= 5%",
                 "NOT proven: ceiling 1.300x >= 1.05x, stage II bound 1.100x, stage I/II gaps "
                 "10.0%/20.0%",
                 "NO GAIN proven at 4 of 5 sequential shapes: 1 too small, 1 by the bound, "
                 "1 by the ceiling, 1 by the kept structure's bound",
                 "NOT proven at 1: ceilings up to 1.300x (D=128, T=128)"):
        assert text in " ".join(r.output.split()), text


def test_a_gap_proof_of_an_older_set_shows_its_gaps(tiny):
    """Sets searched before stage II's bound was recorded proved it by both gaps."""
    old = replace(sequential(256, 256), proof="gap", ceiling=1.3, stage1_gap=0.0,
                  stage2_gap=0.034)
    assert proof_text(old, 1.05) == "stands: stage I/II gaps 0.0%/3.4% <= 5%"


def test_proof_fields_are_checked(tiny):
    data = every_proof_set(tiny).to_json()
    for field, bad in (("proof", "maybe"), ("ceiling", -1.0), ("stage2_gap", 1.5),
                       ("structure_bound", 0.0)):
        broken = json.loads(json.dumps(data))
        broken["entries"][2][field] = bad
        with pytest.raises(ScheduleError, match=f"entries\\[2\\].*{field}"):
            ScheduleSet.from_json(broken)


def test_a_set_written_before_proofs_loads_and_shows(tmp_path):
    src = ROOT / "bench" / "results" / "llama3-8b-tp1-h200-b2048.set.json"
    raw = json.loads(src.read_text())
    assert not any("proof" in e or "ceiling" in e for e in raw["entries"])
    sset = load_schedule_set(src)
    assert all(e.proof is None and e.ceiling is None for e in sset.entries)
    assert sset.to_json()["entries"] == raw["entries"]  # written back as it was read
    r = CliRunner().invoke(app, ["show", str(src)])
    assert r.exit_code == 0, r.output
    assert "NO GAIN proofs: not recorded" in r.output and "NOT proven" not in r.output
