"""Replay of a searched schedule on a tiny Llama: equal to Sequential, on a reordering device."""


import pytest
import torch
from repo import DATA
from runtime_helpers import ShuffledDevice, batch_logits, tiny_llama

from nanosched.errors import ScheduleError
from nanosched.runtime.backend import Backend
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.device import SerialDevice
from nanosched.runtime.engine import Engine
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.opsched import run_program
from nanosched.runtime.requests import Request, SamplingParams
from nanosched.runtime.strategies import Sequential
from nanosched.runtime.strategies.replay import Replay
from nanosched.schedules.format import load_schedule

SHIPPED_H200 = DATA / "llama3-8b-tp1-h200-b2048-single.json"  # a searched /1 schedule


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def schedule():
    return load_schedule(DATA / "tiny_llama_schedule.json")


@pytest.mark.parametrize("n_decode", [0, 40, 128, 200])
def test_replay_equals_sequential_on_a_reordering_device(model, schedule, n_decode):
    """Whatever the batch's decode/prefill mix (the schedule assumed one), replay is exact."""
    expected = batch_logits(model, Sequential(), SerialDevice(), n_decode)
    for seed in range(3):
        replay = Replay(schedule, model.spec.num_layers)
        got = batch_logits(model, replay, ShuffledDevice(seed), n_decode)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_replay_uses_the_schedules_streams_and_merges(model, schedule):
    replay = Replay(schedule, model.spec.num_layers)
    assert {s.split("@")[0] for s in replay.streams} <= {s.name for s in schedule.streams}
    backend = Backend(SerialDevice())
    ws = model.new_workspace(max_tokens=256, num_pages=64)
    meta = ws.kv.plan([(0, 256, False)])
    run_program(model_program(model, ws, meta, [(0, 256, False)]), replay, backend)
    per_layer = len(schedule.nano_ops)
    # one launch per scheduled nano-op and layer (+ embedding + no-op fillers of attention)
    assert per_layer * model.spec.num_layers < backend.num_launches <= \
        (per_layer + 4) * model.spec.num_layers + 1


@pytest.mark.parametrize("graphs", ["off", "layout"])
def test_engine_replays_full_batches_and_falls_back_on_small_ones(model, schedule, graphs):
    def run(strategy):
        reqs = [Request(i, list(range(1 + i, 60 + i)), SamplingParams(max_tokens=12))
                for i in range(12)]
        eng = Engine(model, EngineConfig(dense_batch=256, num_pages=200, graphs=graphs,
                                         graph_align=16), strategy=strategy)
        for r in reqs:
            eng.add_request(r)
        eng.run_to_completion()
        return [r.output_ids for r in reqs], eng.stats

    expected, _ = run(Sequential())
    got, stats = run(Replay(schedule, model.spec.num_layers))
    assert got == expected
    assert 0 < stats.fallbacks < stats.iterations  # the first full batches replay, tails fall back


def test_collective_forms_other_than_all_reduce_are_refused(schedule):
    import dataclasses

    rs = dataclasses.replace(schedule, forms={"attn": "rs_ag"})
    with pytest.raises(ScheduleError, match="all-reduce \\('ar'\\) only"):
        Replay(rs, 2)


def test_bench_compare_on_the_cpu_reports_both_runs_and_the_ratio(tmp_path):
    from typer.testing import CliRunner

    from nanosched.cli import app

    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(DATA / "tiny_llama_config.json"), "--input-len", "64",
            "--output-len", "8", "--num-prompts", "12", "--schedule",
            str(DATA / "tiny_llama_schedule.json"), "--compare", "--json", str(out)]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "schedule is for 'synthetic-h100', running on 'cpu'" in \
        refused.output
    r = CliRunner().invoke(app, [*args, "--force"])
    assert r.exit_code == 0, r.output
    # 12 short requests: the ratio is flagged
    assert "warning: ratio schedule / mean(sequential, sequential-after) may be noise" in \
        r.output
    import json

    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"sequential", "schedule", "sequential-after"}
    ratio = data["ratios"]["schedule"]
    assert ratio["of"] == "schedule / mean(sequential, sequential-after)"
    tps = {k: v["results"]["tokens_per_s"] for k, v in data["runs"].items()}
    assert ratio["tokens_per_s"] == pytest.approx(
        tps["schedule"] / ((tps["sequential"] + tps["sequential-after"]) / 2))
    assert ratio["sequential_drift"] == pytest.approx(tps["sequential-after"] / tps["sequential"])
    run = data["runs"]["schedule"]
    assert 0 < run["pipelined_iterations"] and run["sequential_iterations"] == 0
    assert run["pipelined_iterations"] + run["no_entry_iterations"] == run["iterations"]
    assert run["set_entries"] == 1 and run["schedule_format"] == "nanosched.schedule/1"
    assert sum(row["iterations"] for row in run["shapes"]) <= run["iterations"]
    assert data["ratio"]["tokens_per_s"] > 0
    seq, sched = (data["runs"][k]["results"]["output_tokens"] for k in ("sequential", "schedule"))
    assert seq == sched == 12 * 8
    assert data["warmup_prompts"] == 8  # the CPU default for a small model (issue 45: was 0)

    # a warm-up serves untimed requests with each strategy first; the timed runs are unchanged
    warm = tmp_path / "warm.json"
    r = CliRunner().invoke(app, [*args[:-1], str(warm), "--force", "--warmup-prompts", "3"])
    assert r.exit_code == 0, r.output
    wdata = json.loads(warm.read_text())
    assert wdata["warmup_prompts"] == 3
    for k in ("sequential", "schedule"):
        assert wdata["runs"][k]["iterations"] == data["runs"][k]["iterations"]
        assert wdata["runs"][k]["results"]["output_tokens"] == 12 * 8
    bad = CliRunner().invoke(app, [*args, "--force", "--warmup-prompts", "-1"])
    assert bad.exit_code == 2 and "--warmup-prompts must be >= 0" in bad.output


def test_partition_sides_never_put_two_schedule_streams_on_one_side():
    """compute@gc64 beside memory@gc64 (the shipped H200 schedule): compute takes the complement
    of the 64/68 split instead of queueing behind the attention on the 64-SM side."""
    from nanosched.runtime.streams import partition_sides

    sides = partition_sides({"compute", "compute@gc64", "compute@gc68", "memory@gc64",
                             "memory@gc32", "memory"}, 132)
    assert sides == {"memory@gc64": (64, "small"), "memory@gc32": (32, "small"),
                     "compute@gc64": (64, "rest"), "compute@gc68": (64, "rest")}
    # alone, a stream gets exactly the side it asked for
    assert partition_sides({"compute@gc100", "memory@gc32"}, 132) == {
        "compute@gc100": (32, "rest"), "memory@gc32": (32, "small")}
    assert partition_sides({"compute@gc64"}, 132) == {"compute@gc64": (64, "small")}


def test_a_schedule_stream_split_over_cuda_streams_keeps_its_order():
    """Nano-ops of one schedule stream with different mechanisms run on different CUDA streams;
    each still waits for its predecessor in the schedule stream (no overtaking)."""
    from nanosched.runtime.strategies.replay import _Entry, _keep_lane_order

    es = [_Entry(0.0, 0, 0, "add_norm_ffn", 0, 8, "memory", None, (), "memory", 1),
          _Entry(5.0, 1, 1, "attn_decode", 0, 4, "memory@prio", None, (), "memory", 1),
          _Entry(9.0, 2, 1, "act", 0, 4, "memory@prio", None, (), "memory", 1),
          _Entry(1.0, 0, 1, "kqv", 0, 8, "compute", None, (), "compute", 1)]
    out = _keep_lane_order(es)
    assert out[1].waits == (("add_norm_ffn", 0, 0, 8),)  # crossed CUDA streams: waits
    assert out[2].waits == ()  # same CUDA stream: the stream itself orders it
    assert out[0].waits == () and out[3].waits == ()


def test_dispatch_order_is_each_streams_issue_order():
    """start_us already holds the layer offset: keying by (l + k) * period + start_us counted it
    twice and queued an offset nano-op behind the next layer's on the same CUDA stream."""
    sched = load_schedule(SHIPPED_H200)
    assert any(n.layer_offset for n in sched.nano_ops)
    replay = Replay(sched, 4)
    for lane in {n.stream for n in sched.nano_ops}:
        mine = [e for e in replay.entries if e.lane == lane]
        assert mine == sorted(mine, key=lambda e: (e.period, e.order))
