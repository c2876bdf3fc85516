"""bench/engine/replay_timeline.py's per-rank work (nanosched.benchmarks.timeline) on the CPU.

tp = 2: two gloo processes run Sequential, Replay(schedule) and TwoBatchOverlap on a tiny Llama
(eager and timeline only; graphs need CUDA) and agree; the tp = 2 schedule is refused at tp = 1.
tests/data/tiny_llama_tp2_schedule.json was searched for the tiny model at tp = 2 on a synthetic
H100 profile (run_search, deterministic, 1 s, workload fixed(64, 64), dense batch 256).
"""

from __future__ import annotations

import pytest
import torch
from repo import DATA, ROOT

from nanosched.benchmarks.timeline import STRATEGIES, TimelineConfig, predict, run, run_rank
from nanosched.errors import ScheduleError
from nanosched.models.parallel import TensorParallel
from nanosched.schedules.format import load_schedule

SCHEDULE = str(DATA / "tiny_llama_tp2_schedule.json")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny"  # the schedule's model is named "tiny"
    path.mkdir()
    (path / "config.json").write_text((DATA / "tiny_llama_config.json").read_text())
    return str(path)


@pytest.mark.slow
def test_tp2_on_two_gloo_ranks_runs_every_strategy_and_agrees(folder):
    """... Sequential also with the copy-engine all-reduce (host transport) beside gloo's."""
    torch.set_num_threads(1)
    cfg = TimelineConfig(SCHEDULE, model=folder, device="cpu", eager_reps=1,
                         networks=("nccl", "copy_engine_ctas8"))
    out = run(cfg, tp=2)
    assert out["rank"] == 0 and out["tp"] == 2 and out["layers"] == 2
    assert list(out["results"]) == ["sequential", "sequential[copy_engine_ctas8]",
                                    *STRATEGIES[1:]]
    assert out["results"]["sequential[copy_engine_ctas8]"]["network"] == "copy_engine_ctas8"
    assert len(out["per_rank"]) == 2
    for name, row in out["results"].items():
        assert row["eager_wall_ms"] > 0 and "graph_ms" not in row
        assert row["check"]["finite"]
        assert row["check"]["rel_l2_vs_sequential"] < 1e-5, name
        assert row["timeline"]["span_ms"] > 0
    busy = out["results"]["replay"]["timeline"]["busy_ms_per_stream"]
    assert {"compute", "memory", "network"} <= set(busy)  # the schedule's streams


def test_a_tp2_schedule_is_refused_at_tp1(folder):
    cfg = TimelineConfig(SCHEDULE, model=folder, device="cpu", eager_reps=1)
    with pytest.raises(ScheduleError, match="tp=2"):
        run_rank(TensorParallel(), cfg)


def test_prediction_has_the_replay_and_sequential_layer_times(folder):
    from nanosched.models.spec import load_spec

    sched = load_schedule(SCHEDULE)
    got = predict(sched, load_spec(folder), None)
    assert got["predicted_period_us"] == sched.prediction.period_us
    assert got["predicted_sequential_period_us"] == sched.prediction.sequential_period_us
    assert "simulated" not in got


def test_the_llama3_70b_tp2_bench_schedule_finds_its_profile_and_simulates():
    """The schedule bench/engine/replay_timeline.py replays on two H200s: its shipped profile is
    found by digest and the simulator prices it and Sequential at the bench's 8 layers."""
    from nanosched.benchmarks.timeline import find_profile, with_layers
    from nanosched.models.spec import load_spec

    path = ROOT / "bench/results/llama3-70b-tp2-h200-b896.schedule.json"
    sched = load_schedule(path)
    assert sched.tp == 2 and sched.model["name"] == "llama3-70b"
    assert set(sched.forms.values()) == {"ar"}  # what Replay runs
    profile, name = find_profile(sched)
    assert name == "llama3-70b-tp2-h200x2-quick"
    got = predict(sched, with_layers(load_spec("llama3-70b"), 8), profile)
    sim = got["simulated"]
    assert sim["layers"] == 8
    assert sim["sequential_period_us"] == pytest.approx(got["predicted_sequential_period_us"])
    assert 0.5 * got["predicted_period_us"] < sim["period_us"] < 1.5 * got["predicted_period_us"]
