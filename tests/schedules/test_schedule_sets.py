"""Schedule sets (`nanosched.schedule/2`): the format, bucket -> key mapping, replay of an entry
on a bucket near its key, the engine choosing an entry per batch, and the set search."""

import json
import math
from dataclasses import replace

import pytest
import torch
from repo import DATA, ROOT
from runtime_helpers import ShuffledDevice, batch_logits, serve_all, tiny_llama

from nanosched.errors import ScheduleError
from nanosched.runtime.device import SerialDevice
from nanosched.runtime.requests import Request, SamplingParams
from nanosched.runtime.strategies import Sequential
from nanosched.runtime.strategies.replay import Replay, remap_rows
from nanosched.runtime.strategies.replay_set import ReplaySet
from nanosched.schedules.format import load_schedule
from nanosched.schedules.sets import (
    SET_FORMAT,
    ScheduleSet,
    SetEntry,
    check_set_compatible,
    entry_schedule,
    from_single,
    layer_times_us,
    load_schedule_set,
    save_schedule_set,
    set_key,
    set_keys,
)


@pytest.fixture(scope="module")
def single():
    return load_schedule(DATA / "tiny_llama_schedule.json")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny"))


def tiny_set(single, pipeline_keys=((128, 256),), drop=()):
    """A set for the tiny Llama at dense batch 256: the searched schedule at (128, 256),
    Sequential elsewhere; keys in `drop` left out (no entry)."""
    base = from_single(single)
    entries = []
    for d, t in set_keys(256):
        if (d, t) in drop:
            continue
        if (d, t) in pipeline_keys:
            entries.append(base.entries[0])
        else:
            entries.append(SetEntry(d, t, "sequential", 100.0, 100.0, "test"))
    return replace(base, entries=tuple(entries), source_format=SET_FORMAT, min_gain=1.0)


# ---- format ---------------------------------------------------------------------------------
def test_a_set_round_trips_and_a_single_schedule_loads_as_a_one_entry_set(single, tmp_path):
    sset = tiny_set(single)
    path = tmp_path / "set.json"
    save_schedule_set(sset, path)
    again = load_schedule_set(path)
    assert json.loads(path.read_text())["format"] == SET_FORMAT
    assert again.to_json() == sset.to_json()
    assert [e.key for e in again.pipelines] == [(128, 256)]
    one = load_schedule_set(DATA / "tiny_llama_schedule.json")
    assert one.source_format == "nanosched.schedule/1" and len(one.entries) == 1
    assert one.entries[0].key == (single.batch.num_decode, single.batch.dense_batch)
    assert one.entry(0, 256) is None  # another shape: no entry, the engine's fallback runs it


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(format="nanosched.schedule/9"), "nanosched search"),
    (lambda d: d["entries"][0].update(num_decode=64), "multiples of 128"),
    (lambda d: d["entries"].append(d["entries"][0]), "a second entry"),
    (lambda d: d["entries"][0].update(kind="maybe"), "kind must be"),
    (lambda d: d["entries"][0].update(forward_us=0), "positive finite"),
    (lambda d: d["entries"][0].update(sequential_us="x"), "'sequential_us' must be a number"),
    (lambda d: d["entries"][-1].update(schedule=None), "holds a schedule"),
    (lambda d: d.update(dense_batch=200), "dense_batch"),
    (lambda d: d.update(quantum=64), "quantum"),
    (lambda d: d.update(extra=1), "unknown field"),
])
def test_broken_sets_are_refused_naming_the_field(single, tmp_path, edit, words):
    data = tiny_set(single).to_json()
    data["entries"].sort(key=lambda e: e["kind"] == "pipeline")  # the pipeline entry last
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match=words.replace("(", r"\(")):
        load_schedule_set(path)


def test_entry_schedule_names_the_pipelined_keys(single):
    sset = tiny_set(single)
    assert entry_schedule(sset).batch.dense_batch == 256
    assert entry_schedule(sset, "128,256") is sset.pipelines[0].schedule
    with pytest.raises(ScheduleError, match="pipelined keys: 128,256"):
        entry_schedule(sset, "0,256")
    with pytest.raises(ScheduleError, match="D,T"):
        entry_schedule(sset, "x")


# ---- bucket -> key ----------------------------------------------------------------------------
@pytest.mark.parametrize("dense", [256, 1024, 2048])
def test_every_graph_bucket_has_a_key_that_keeps_its_parts(dense):
    keys = set(set_keys(dense))
    assert len(keys) == sum(t // 128 + 1 for t in range(128, dense + 1, 128))
    for t in range(32, dense + 1, 32):
        for d in range(0, t + 1, 32):
            k = set_key(d, t, dense)
            assert k in keys
            kd, kt = k
            assert abs(kt - t) <= 64 or kt == 128
            if kt >= 256:  # room for both parts: each part kept iff the bucket has it
                assert (kd == 0) == (d == 0) and (kd == kt) == (d == t)
    assert set_key(0, dense + 32, dense) is None


def test_remap_moves_boundaries_within_their_part(single):
    same = remap_rows(single, (128, 256))
    assert all(k == v for k, v in same.items())
    rows = remap_rows(single, (40, 224))
    assert rows[0] == 0 and rows[128] == 40 and rows[256] == 224
    with pytest.raises(ScheduleError, match="cannot replay"):
        remap_rows(single, (0, 256))  # no decode part where the schedule has one
    with pytest.raises(ScheduleError, match="cannot replay"):
        remap_rows(single, (256, 256))


@pytest.mark.parametrize("n_decode, total", [(40, 224), (96, 192), (160, 256), (32, 288)])
def test_an_entry_replayed_on_a_nearby_bucket_equals_sequential(model, single, n_decode, total):
    expected = batch_logits(model, Sequential(), SerialDevice(), n_decode, total)
    replay = Replay(single, model.spec.num_layers, rows=(n_decode, total))
    assert replay.accepts(type("P", (), {"num_tokens": total})())
    for seed in range(2):
        got = batch_logits(model, replay, ShuffledDevice(seed), n_decode, total)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def decode_only(single):
    """`single` as a schedule searched for a batch of decode tokens only: no `attn_prefill`."""
    gone = {n.id for n in single.nano_ops if n.op == "attn_prefill"}
    nanos = tuple(replace(n, deps=tuple(d for d in n.deps if d.id not in gone))
                  for n in single.nano_ops if n.id not in gone)
    ranges = {op: r for op, r in single.ranges.items() if op != "attn_prefill"}
    batch = replace(single.batch, num_decode=single.batch.dense_batch)
    return replace(single, nano_ops=nanos, ranges=ranges, batch=batch)


@pytest.mark.parametrize("rows", [(256, 256), (224, 224)])
def test_a_decode_only_schedule_replays_the_program_ops_it_does_not_name(model, single, rows):
    """The program of a decode-only batch still holds `attn_prefill` (over no rows); the replay
    runs it on the main stream instead of getting stuck before `o`."""
    expected = batch_logits(model, Sequential(), SerialDevice(), *rows)
    replay = Replay(decode_only(single), model.spec.num_layers, rows=rows)
    got = batch_logits(model, replay, ShuffledDevice(0), *rows)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---- the engine picks an entry per batch ------------------------------------------------------
def requests(n, prompt, out):
    return [Request(i, [(7 * i + j) % 90 + 1 for j in range(prompt)],
                    SamplingParams(max_tokens=out, ignore_eos=True)) for i in range(n)]


@pytest.mark.parametrize("drop", [(), ((0, 128), (128, 128))])
def test_the_engine_runs_each_batch_by_its_entry(model, single, drop):
    """Ramp, steady state and tail: pipelined where the set says so, sequential where it
    says so, the fallback only where it has no entry; tokens equal Sequential's."""
    sset = tiny_set(single, drop=drop)
    reqs = requests(12, 60, 24)
    kw = dict(dense_batch=256, graphs="layout", max_context=128)
    want, _ = serve_all(model, requests(12, 60, 24), 400, strategy=Sequential(), **kw)
    got, eng = serve_all(model, reqs, 400, strategy=ReplaySet(sset, model.spec.num_layers),
                         **kw)
    assert got == want
    s = eng.stats
    assert s.pipelined + s.sequential + s.fallbacks == s.iterations
    assert s.pipelined > 0 and s.sequential > 0
    no_entry = sum(n for (d, t), n in s.shapes.items() if sset.entry(d, t) is None)
    assert s.fallbacks == no_entry and (no_entry > 0) == bool(drop)


def test_a_single_schedule_file_replays_only_its_own_shape(model, single):
    sset = load_schedule_set(DATA / "tiny_llama_schedule.json")
    strat = ReplaySet(sset, model.spec.num_layers)
    prog = type("P", (), {"num_tokens": 256})()
    assert isinstance(strat.pick(prog, 128), Replay)
    assert isinstance(strat.pick(prog, 96), Replay)  # same key (nearest multiple of 128)
    assert strat.pick(prog, 0) is None and strat.pick(prog, 256) is None


# ---- the search -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def synthetic():
    from search_fixtures import synthetic_set_config

    return synthetic_set_config()


@pytest.mark.slow
def test_the_bound_is_above_what_the_search_finds(synthetic, shared_cache):
    from search_fixtures import searched_key

    from nanosched.autosearch.sets import key_batch, overlap_bound, sequential_forward_us

    for d, t in [(256, 512), (0, 512), (512, 512)]:
        bound = overlap_bound(synthetic, key_batch(synthetic, d, t))
        sched = searched_key(d, t, shared_cache)
        forward, sequential = layer_times_us(sched)
        assert sequential == pytest.approx(
            sequential_forward_us(synthetic, key_batch(synthetic, d, t)))
        found = sequential / forward
        assert found <= bound + 1e-9, (d, t, found, bound)


@pytest.mark.slow
def test_the_set_search_decides_every_key(synthetic):
    from nanosched.autosearch.sets import SetSearchConfig, search_set

    seen = []
    sset = search_set(SetSearchConfig(replace(synthetic, time_limit_s=8.0), min_gain=1.0),
                      on_key=lambda r, i, n: seen.append((r.how, i, n)))
    assert sorted(e.key for e in sset.entries) == sorted(set_keys(512))
    assert len(seen) == len(sset.entries) and seen[-1][1:] == (len(seen), len(seen))
    small = [e for e in sset.entries if e.num_tokens < 256]
    assert small and all(e.kind == "sequential" and "two" in e.reason for e in small)
    for e in sset.entries:
        assert math.isfinite(e.forward_us) and e.forward_us > 0
        if e.kind == "pipeline":
            assert e.speedup >= 1.0 and e.schedule.batch.num_decode == e.num_decode
    assert sset.search["searched"] + sset.search["bounded"] + sset.search["ceiling"] + \
        sset.search["small"] + sset.search["failed"] == len(sset.entries)
    again = ScheduleSet.from_json(json.loads(json.dumps(sset.to_json())))
    assert again.to_json() == sset.to_json()


def test_a_set_search_ends_near_its_time_limit_leaving_the_rest_unsearched(synthetic):
    """On wall time (not deterministic) a set given less time than its keys need searches the
    steady state's key first, then stops once the time left would not cover a key: the rest
    run Sequential, marked unsearched, and the summary says so."""
    import time

    from nanosched.autosearch.sets import SetSearchConfig, search_set
    from nanosched.schedules.show import set_summary_lines

    limit = 1.0
    t0 = time.perf_counter()
    sset = search_set(SetSearchConfig(replace(synthetic, time_limit_s=limit, deterministic=False),
                                      min_gain=1.0, bound=False))
    wall = time.perf_counter() - t0
    x = sset.search
    assert x["unsearched"] > 0 and x["searched"] >= 1
    assert x["searched"] + x["unsearched"] + x["small"] + x["failed"] == len(sset.entries)
    late = [e for e in sset.entries if e.reason.startswith("not searched")]
    assert len(late) == x["unsearched"] and all(e.kind == "sequential" for e in late)
    assert sset.full is not None and not sset.full.reason.startswith("not searched")
    assert wall < limit + 10.0  # one key past the limit at most (slack for a busy machine)
    assert any("not searched (the time limit ran out)" in line for line in set_summary_lines(sset))


def test_a_high_min_gain_makes_the_set_all_sequential_and_says_so(synthetic):
    from nanosched.autosearch.sets import SetSearchConfig, search_set
    from nanosched.schedules.show import set_summary_lines

    sset = search_set(SetSearchConfig(replace(synthetic, time_limit_s=4.0), min_gain=3.0,
                                      keys=((256, 512), (0, 256), (128, 128))))
    assert [e.kind for e in sset.entries] == ["sequential"] * 3
    assert sset.search["bounded"] == 2 and sset.search["small"] == 1
    assert any("NO GAIN" in line for line in set_summary_lines(sset))


# ---- verify: the set's pipelines against Sequential on the device ---------------------------
@pytest.mark.parametrize("min_gain, kept", [(0.0, True), (100.0, False)])
def test_verify_keeps_a_pipeline_only_where_it_measures_the_min_gain(model, single, min_gain,
                                                                      kept):
    from nanosched.benchmarks.verify import VerifyConfig, verify_set

    sset = replace(tiny_set(single), min_gain=min_gain)
    ws = model.new_workspace(max_tokens=256, num_pages=400)
    free = ws.kv.allocator.num_free
    lines = []
    out, rows = verify_set(model, ws, sset, 40, 64, VerifyConfig(0.0, 0.02, 1), "cpu",
                           lines.append)
    assert ws.kv.allocator.num_free == free  # the timed batch gave its pages back
    assert bool((ws.kv.k != 0).any())  # the decode rows attended to random context, not zeros
    assert len(rows) == 1 and rows[0]["kept"] is kept and lines
    e = out.entry(128, 256)
    before = sset.entry(128, 256)  # each measured time beside its prediction
    assert rows[0]["predicted_sequential_ms"] == pytest.approx(before.sequential_us / 1e3)
    assert rows[0]["predicted_pipeline_ms"] == pytest.approx(before.forward_us / 1e3)
    assert e.measured["sequential_ms"] > 0 and e.measured["pipeline_ms"] > 0
    assert e.kind == ("pipeline" if kept else "sequential")
    if not kept:
        assert "measured" in e.reason and e.forward_us == e.sequential_us
    again = ScheduleSet.from_json(json.loads(json.dumps(out.to_json())))
    assert again.entry(128, 256).measured == e.measured
    assert [x.kind for x in out.entries if x.key != (128, 256)] == \
        [x.kind for x in sset.entries if x.key != (128, 256)]


def test_verify_makes_an_entry_whose_replay_fails_sequential(model, single, monkeypatch):
    from nanosched.benchmarks import verify
    from nanosched.runtime.strategies.replay_set import ReplaySet as RS

    sset = replace(tiny_set(single), min_gain=0.0)
    bad_speedup = sset.entry(128, 256).speedup
    real = RS.pick

    def broken(self, program, num_decode):  # the (128, 256) entry cannot replay
        if program.num_tokens == 256 and num_decode == 128:
            raise ScheduleError("replay is stuck (test)")
        return real(self, program, num_decode)

    monkeypatch.setattr(RS, "pick", broken)
    ws = model.new_workspace(max_tokens=256, num_pages=400)
    free = ws.kv.allocator.num_free
    out, rows = verify.verify_set(model, ws, sset, 40, 64, verify.VerifyConfig(0.0, 0.02, 1),
                                  "cpu")
    assert ws.kv.allocator.num_free == free
    bad = out.entry(128, 256)
    assert bad.kind == "sequential" and "replay failed" in bad.reason
    assert rows == [{"num_decode": 128, "num_tokens": 256, "predicted_gain": bad_speedup,
                     "error": "replay is stuck (test)", "kept": False}]


@pytest.mark.parametrize("src", [
    ROOT / "bench" / "results" / "llama3-8b-tp1-h200-b2048.set.json",
    ROOT / "nanosched" / "schedules" / "shipped"
    / "llama3-70b-tp4-h100-in1024-out512-b1152.set.json",
])
def test_verify_on_a_set_without_pipelines_writes_it_unchanged(tmp_path, src):
    from typer.testing import CliRunner

    from nanosched.cli import app

    out = tmp_path / "v.json"
    r = CliRunner().invoke(app, ["verify", str(src), "--out", str(out), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "nothing to verify" in r.output
    assert json.loads(out.read_text())["entries"] == json.loads(src.read_text())["entries"]


def test_verify_refuses_a_tp_set_with_pipelines_and_names_bench(tmp_path):
    from typer.testing import CliRunner

    from nanosched.cli import app

    src = ROOT / "bench" / "results" / "llama3-70b-tp2-h200-b896.schedule.json"  # pipelined
    r = CliRunner().invoke(app, ["verify", str(src), "--out", str(tmp_path / "v.json"),
                                 "--device", "cpu"])
    assert r.exit_code == 2, r.output
    assert "tp = 2" in r.output and "nanosched bench --model llama3-70b --tp 2" in r.output


def test_a_set_with_a_form_the_runtime_cannot_replay_is_refused_even_forced():
    from nanosched.models.spec import load_spec

    src = ROOT / "bench" / "results" / "llama3-70b-tp2-h200-b896.schedule.json"  # pipelined
    sset, spec = load_schedule_set(src), load_spec("llama3-70b")
    assert check_set_compatible(sset, spec, 2, "cpu", force=True)  # the GPU differs: forced
    pipe = sset.pipelines[-1]
    bad = replace(pipe, schedule=replace(pipe.schedule, forms={"attn": "ar", "ffn": "rs_ag"}))
    rs = replace(sset, entries=tuple(bad if e is pipe else e for e in sset.entries))
    with pytest.raises(ScheduleError, match=f"entry D={pipe.num_decode} T={pipe.num_tokens}: "
                                            "collective form 'rs_ag' of group 'ffn' cannot be "
                                            "replayed"):
        check_set_compatible(rs, spec, 2, "cpu", force=True)


def test_the_set_predicts_a_bucket_between_its_keys(single):
    base = from_single(single)
    entries = tuple(SetEntry(d, t, "sequential", 1000.0 + d + 2 * t, 1000.0 + d + 2 * t, "x")
                    for d, t in set_keys(256))
    sset = replace(base, entries=entries, source_format=SET_FORMAT)
    for d, t in set_keys(256):
        assert sset.sequential_us(d, t) == pytest.approx(1000 + d + 2 * t)
    assert sset.sequential_us(64, 192) == pytest.approx(1000 + 64 + 2 * 192)  # linear inside
    assert sset.sequential_us(32, 32) == pytest.approx(1000 + 32 + 2 * 128)  # below a quantum
    pipe = replace(sset, entries=tuple(
        replace(e, kind="pipeline", forward_us=e.sequential_us / 1.25,
                schedule=base.entries[0].schedule) if e.key == (128, 256) else e
        for e in entries))
    assert pipe.predict_us(128, 256) == pytest.approx((1000 + 128 + 512) / 1.25)
    assert pipe.predict_us(0, 256) == pytest.approx(1000 + 512)
    assert base.sequential_us(0, 256) is None  # a single schedule: no grid to read


def test_between_keys_whose_contexts_differ_the_weight_is_the_decode_kv_tokens(single):
    """A key whose decode rows do not all fit at the workload's context was priced at a shorter
    one; a batch between it and the key below has the context that fits its own rows, so it
    sits nearer the upper key than its row count says (the decode attention follows KV
    tokens). Sets that record no contexts stay linear in D."""
    from nanosched.schedules.sets import fitting_context

    base = from_single(single)
    # a cache of 300,000 tokens: 128 and 192 rows of 1,280 fit, 256 do not
    notes = {"contexts": {"workload": 1280.0, "least": 512.0, "kv_capacity_tokens": 300_000.0}}
    ctx = {d: fitting_context(1280.0, 512.0, 300_000.0, d, 256) for d in (128, 192, 256)}
    assert ctx[128] == ctx[192] == 1280
    assert ctx[256] == pytest.approx(300_000 / 256) and ctx[256] < 1280
    entries = tuple(SetEntry(d, t, "sequential", 1000.0 + d, 1000.0 + d, "x",
                             decode_context=fitting_context(1280.0, 512.0, 300_000.0, d, t)
                             if d else None)
                    for d, t in set_keys(256))
    sset = replace(base, entries=entries, source_format=SET_FORMAT, search=notes)
    w = (192 * 1280 - 128 * 1280) / (256 * ctx[256] - 128 * 1280)
    assert 0.5 < w < 1
    assert sset.sequential_us(192, 256) == pytest.approx(1000 + 128 + w * 128)
    assert sset.sequential_us(128, 256) == pytest.approx(1128)  # a key: its own time
    plain = replace(sset, search=None,
                    entries=tuple(replace(e, decode_context=None) for e in entries))
    assert plain.sequential_us(192, 256) == pytest.approx(1192)  # linear in D
    # the contexts survive a round trip, and a bad one is refused
    again = ScheduleSet.from_json(json.loads(json.dumps(sset.to_json())))
    assert again.entries == sset.entries and again.search == sset.search
    bad = sset.to_json()
    bad["entries"][3]["decode_context"] = -1
    with pytest.raises(ScheduleError, match="decode_context"):
        ScheduleSet.from_json(bad)
    bad = sset.to_json()
    bad["search"]["contexts"]["workload"] = "long"
    with pytest.raises(ScheduleError, match="search.contexts"):
        ScheduleSet.from_json(bad)


def test_the_steady_state_is_the_searched_steady_key_not_the_best_pipeline(single):
    """`show` and `bench` report the workload's mix at the dense batch: a pipeline elsewhere at
    the dense batch, however good, is not the steady state."""
    sset = tiny_set(single)  # pipelines (128, 256) only
    assert sset.full.key == (128, 256)  # no search notes: the best pipeline at the dense batch
    noted = replace(sset, search={"steady_key": [256, 256]})
    assert noted.full.key == (256, 256) and noted.full.kind == "sequential"


def test_a_key_whose_decode_rows_do_not_fit_is_searched_at_the_context_that_fits(synthetic):
    from nanosched.autosearch.sets import key_batch, key_config
    from nanosched.models.costmodel import kv_capacity_tokens

    cap = kv_capacity_tokens(synthetic.spec, 1, synthetic.profile.identity.memory_bytes, 512)
    few, many = key_batch(synthetic, 128, 512), key_batch(synthetic, 512, 512)
    assert few.decode_context == 1280  # 128 x 1,280 tokens fit an H100's cache
    least = min(r.context for r in synthetic.profile.kernels if r.op == "attn_decode")
    assert many.decode_context == max(least, cap / 512) < 1280  # 512 x 1,280 tokens do not fit
    small = replace(synthetic, profile=replace(synthetic.profile, identity=replace(
        synthetic.profile.identity, memory_bytes=20 * 2**30)))  # ~2 GiB left for the cache
    tight = key_batch(small, 256, 512)
    room = kv_capacity_tokens(small.spec, 1, 20 * 2**30, 512) - 256
    assert tight.decode_context == pytest.approx(max(least, room / 256))
    assert tight.decode_context < 1280
    assert key_config(small, 256, 512).decode_context == tight.decode_context
    assert key_batch(small, 0, 512).decode_context == 1280  # no decode rows: nothing to fit
    # an FP8 cache holds about twice the tokens: 512 x 1,280 fit an H100's FP8 cache
    fp8 = replace(synthetic, profile=replace(synthetic.profile, kv_dtype="fp8"))
    cap8 = kv_capacity_tokens(synthetic.spec, 1, synthetic.profile.identity.memory_bytes, 512,
                              kv_dtype="fp8")
    assert cap8 > 1.8 * cap
    assert key_batch(fp8, 512, 512).decode_context == 1280 > many.decode_context


def test_the_bound_counts_per_shape_points():
    """A per-shape R->P point can sum above the folded table (the shipped H100 profile's do):
    the bound's P sum is the largest of any point the search can pick."""
    from nanosched.autosearch.request import resolve
    from nanosched.autosearch.search import SearchConfig
    from nanosched.autosearch.sets import max_p_sum
    from nanosched.models.spec import load_spec
    from nanosched.workloads import fixed

    spec, wl = load_spec("llama3-8b"), fixed(1024, 512)
    prof = resolve(spec, None, None, "h100", wl, "1024").profile
    cfg = SearchConfig(spec, 1, prof, wl, 1024)
    folded = max(p.p_compute + p.p_other for pts in prof.rp.values() for p in pts)
    shaped = max(p.p_compute + p.p_other for pts in prof.rp_shapes.values() for p in pts)
    assert shaped > folded
    assert max_p_sum(cfg) == shaped
