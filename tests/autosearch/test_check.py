"""check_schedule() rejects a violation of every constraint class, naming it and the nano-op."""

import dataclasses

import pytest
from search_fixtures import search_small_schedule, small_profile, small_schedule

from nanosched.autosearch.check import check_schedule
from nanosched.autosearch.simulate import lm_head_us, replay, sequential_baseline, simulate
from nanosched.errors import ScheduleError
from nanosched.models.spec import load_spec
from nanosched.schedules.format import Dep, Schedule
from nanosched.schedules.validate import validate_structure


def _with(s: Schedule, id_: str, **changes) -> Schedule:
    ops = tuple(dataclasses.replace(n, **changes) if n.id == id_ else n for n in s.nano_ops)
    return dataclasses.replace(s, nano_ops=ops)


def _overlapping_pair(s: Schedule):
    """Two nano-ops of different classes (not `other`) that run at once (layers l, l + 1)."""
    period = s.prediction.solver_period_us
    for x in s.nano_ops:
        for y in s.nano_ops:
            for k in (-1, 0, 1):
                a, b = y.start_us + k * period, y.end_us + k * period
                if x.resource < y.resource and "other" not in (x.resource, y.resource) \
                        and x.start_us < b and a < x.end_us:
                    return x, y
    raise AssertionError("the searched schedule overlaps nothing")


@pytest.mark.slow
def test_search_results_pass_for_tp1_and_tp2():
    check_schedule(search_small_schedule(), small_profile())
    s2 = search_small_schedule(2, 256)
    check_schedule(s2, small_profile(2, 256))
    assert {n.resource for n in s2.nano_ops} >= {"compute", "memory", "network"}


def test_profile_mismatch():
    with pytest.raises(ScheduleError, match="'profile' violated.*made from profile"):
        check_schedule(small_schedule(), small_profile(2, 256))


def test_structure():
    s = small_schedule()
    bad = dataclasses.replace(s, ranges={**s.ranges, "ug": ((0, 128), (64, 256))})
    with pytest.raises(ScheduleError, match=r"'structure' violated.*ranges\[ug\]"):
        check_schedule(bad, small_profile())


def test_missing_data_and_periodic_dependencies():
    s = small_schedule()
    o = next(n for n in s.nano_ops if n.op == "o")
    bad = _with(s, o.id, deps=tuple(d for d in o.deps if d.kind != "data"))
    with pytest.raises(ScheduleError, match=f"'dependencies' violated at {o.id}: missing data"):
        check_schedule(bad, small_profile())
    kqv = next(n for n in s.nano_ops if n.op == "kqv")
    bad = _with(s, kqv.id, deps=tuple(d for d in kqv.deps if d.shift == 0))
    with pytest.raises(ScheduleError, match=f"at {kqv.id}: missing periodic cross-layer"):
        check_schedule(bad, small_profile())


def test_dependency_times():
    s = small_schedule()
    act = next(n for n in s.nano_ops if n.op == "act" and n.layer_offset == 0)
    with pytest.raises(ScheduleError, match=f"'dependencies' violated at {act.id}: starts"):
        check_schedule(_with(s, act.id, start_us=0.0), small_profile())


def test_issue_order():
    s = small_schedule()
    chain = sorted((n for n in s.nano_ops if n.stream == "compute"), key=lambda n: n.order)
    for a, b in zip(chain, chain[1:], strict=False):
        bad = _with(_with(s, a.id, order=b.order), b.id, order=a.order)
        try:
            validate_structure(bad)
        except ScheduleError:
            continue  # the swap would deadlock: not this constraint
        with pytest.raises(ScheduleError, match=f"'issue order' violated at {a.id}: issued "
                                                f"after {b.id}"):
            check_schedule(bad, small_profile())
        return
    raise AssertionError("no swappable pair")


def test_stream_no_overlap():
    s = small_schedule()
    period = s.prediction.solver_period_us
    for x in s.nano_ops:
        waits = [n.start_us + d.shift * period for n in s.nano_ops for d in n.deps
                 if d.id == x.id]
        nxt = [n.start_us + k * period for n in s.nano_ops for k in (0, 1)
               if n.stream == x.stream and n.start_us + k * period >= x.end_us
               and (n.id, k) != (x.id, 0)]
        if nxt and min(nxt) < min(waits, default=float("inf")) - 1:
            longer = min(nxt) + 0.5 - x.start_us
            with pytest.raises(ScheduleError, match="'stream no-overlap' violated"):
                check_schedule(_with(s, x.id, duration_us=longer), small_profile())
            return
    raise AssertionError("no nano-op can be stretched into its stream successor")


def test_same_class_no_overlap():
    s = small_schedule()
    x, y = _overlapping_pair(s)
    streams = tuple(dataclasses.replace(st, resource="compute") for st in s.streams)
    ops = tuple(dataclasses.replace(n, resource="compute") if n.resource != "other" else n
                for n in s.nano_ops)
    with pytest.raises(ScheduleError, match="'same-class no-overlap' violated"):
        check_schedule(dataclasses.replace(s, streams=streams, nano_ops=ops), small_profile())


def test_gpu_capacity():
    s = small_schedule()
    x, y = _overlapping_pair(s)
    full = dataclasses.replace(x.alloc, share=1.0)
    bad = _with(_with(s, x.id, alloc=full), y.id, alloc=dataclasses.replace(y.alloc, share=1.0))
    with pytest.raises(ScheduleError, match="'GPU capacity' violated.*capacity exceeded"):
        check_schedule(bad, small_profile())


def test_durations_and_allocations():
    s = small_schedule()
    n = s.nano_ops[0]
    with pytest.raises(ScheduleError, match=f"'durations' violated at {n.id}: duration"):
        check_schedule(_with(s, n.id, duration_us=n.duration_us / 2), small_profile())
    odd = dataclasses.replace(n.alloc, p=0.77)
    with pytest.raises(ScheduleError, match="not a point of the profile's R->P table"):
        check_schedule(_with(s, n.id, alloc=odd), small_profile())


def test_simulator_and_sequential_baseline():
    s, prof = small_schedule(), small_profile()
    sim = simulate(s, prof, num_layers=6)
    assert sim.max_share <= 1 + 1e-9
    assert 0 < sim.period_us <= s.prediction.solver_period_us + 1e-6
    seq, it = sequential_baseline(load_spec("llama3-8b"), 1, prof, s.batch)
    ops = ["kqv", "rope_append", "attn_decode", "attn_prefill", "o", "add_norm_ffn", "ug",
           "act", "d", "add_norm_attn"]
    assert (s.batch.dense_batch, s.batch.num_decode) == (768, 384)
    want = sum(prof.kernel_time_us(op, 384 if op.startswith("attn") else 768, None,
                                   s.batch.decode_context if op == "attn_decode"
                                   else s.batch.prompt_len) for op in ops)
    assert seq == pytest.approx(want)
    # 384 decode + 384 / 512 finishing prompts = 384.75 sampled tokens -> 512-token row
    assert lm_head_us(prof, s.batch) == prof.kernel_time_us("lm_head", 512)
    assert it == pytest.approx(32 * want + lm_head_us(prof, s.batch))


def test_replay_reports_a_deadlock():
    s = small_schedule()
    s = dataclasses.replace(s, nano_ops=tuple(dataclasses.replace(n, layer_offset=0)
                                              for n in s.nano_ops))
    chain = sorted((n for n in s.nano_ops if n.stream == "compute"), key=lambda n: n.order)
    first, later = chain[0], chain[1]
    bad = _with(s, first.id, deps=(*first.deps, Dep(later.id, 0, "data")))
    with pytest.raises(ScheduleError, match="replay deadlocks"):
        replay(bad, {n.id: n.duration_us for n in s.nano_ops}, 3)
