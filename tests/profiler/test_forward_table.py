"""The forward table: a Sequential layer looped until the clock settled, each op's time in it
against its row (F), measured by the profiler (fake GPU), added to a finished profile by
`profile forward`, and priced by the search: an op alone on the whole GPU at F x row."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from search_fixtures import small_profile
from test_impl_registry import TINY, call
from test_profile_format import tiny_profile
from typer.testing import CliRunner

from nanosched.autosearch.check import check_schedule
from nanosched.autosearch.durations import Mechanism, alloc_options
from nanosched.autosearch.search import SearchConfig, run_search
from nanosched.autosearch.simulate import sequential_baseline, sequential_op_times, simulate
from nanosched.cli import app
from nanosched.errors import ProfileError
from nanosched.models.ops import layer_ops
from nanosched.models.spec import load_spec
from nanosched.profiler import impl_registry
from nanosched.profiler.fake import FakeBackend
from nanosched.profiler.format import ForwardRow, Profile, load_profile, save_profile
from nanosched.profiler.plan import ProfileSettings, layer_sizes, layer_tasks
from nanosched.profiler.runner import FORWARD_NOTE, RunOptions, run_profile
from nanosched.profiler.state import RunState, load_state, save_state
from nanosched.workloads import fixed

SPEC = load_spec("llama3-8b")


def run_cli(*args: str):
    return CliRunner().invoke(app, list(args))


def row(op: str, t: int, factor: float, **kw) -> ForwardRow:
    return ForwardRow(op, t, t // 4, t, "cublas", 10.0, 10.0 * factor, **kw)


def test_settled_factor_interpolates_clamps_and_is_one_without_rows(tmp_path):
    prof = replace(tiny_profile(), forward=(row("kqv", 128, 1.1), row("kqv", 256, 1.2)))
    assert prof.settled_factor("kqv", 192) == pytest.approx(1.15)
    assert prof.settled_factor("kqv", 128) == pytest.approx(1.1)
    assert prof.settled_factor("kqv", 64) == pytest.approx(1.1)  # the nearest size outside
    assert prof.settled_factor("kqv", 1024) == pytest.approx(1.2)
    assert prof.settled_factor("attn_decode", 192) == 1.0  # no row of the op
    assert prof.settled_time_us("kqv", 128, 256) == pytest.approx(10.0 * 1.2)
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    # a profile without the table writes no field: older profiles keep their digest
    assert "forward" not in tiny_profile().to_json()
    assert prof.digest() != tiny_profile().digest()
    bad = prof.to_json()
    bad["forward"][0]["time_us"] = 0
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"forward\[0\] \(kqv, 128 tokens\): times must be"):
        load_profile(path)


def test_layer_tasks_lay_out_the_workloads_steady_mix():
    s = ProfileSettings(SPEC, 1, fixed(1024, 512), 1024)
    assert layer_sizes(s) == [(256, True), (512, False), (1024, False)]
    assert layer_sizes(ProfileSettings(SPEC, 1, fixed(1024, 512), 2048)) == [
        (512, True), (1024, False), (2048, False)]
    tasks = layer_tasks(s, 132, s.decode_contexts(), lambda op, t, c: "best")
    tail, big = tasks[0], tasks[2]
    assert (tail.tokens, tail.num_decode) == (256, 256)  # the tail: decode rows only
    assert [k.op for k in tail.ops] == [op.name for op in layer_ops(SPEC, 1)
                                        if op.name != "attn_prefill"]
    assert (big.tokens, big.num_decode) == (1024, 384)  # a third, on the 128 grid
    ops = {k.op: k for k in big.ops}
    assert [k.op for k in big.ops] == [op.name for op in layer_ops(SPEC, 1)]
    assert (ops["attn_decode"].tokens, ops["attn_decode"].context) == (384, 1280)  # p + d / 2
    assert (ops["attn_prefill"].tokens, ops["attn_prefill"].context) == (640, 1024)
    assert {(k.sms, k.mechanism, k.impl) for k in big.ops} == {(132, "full", "best")}
    # a quick grid's nearest context; network ops are not in a one-GPU layer
    quick = ProfileSettings(load_spec("llama3-70b"), 8, fixed(1024, 512), 256, quick=True)
    t8 = layer_tasks(quick, 132, quick.decode_contexts(), lambda op, t, c: "best")
    assert all(k.op not in ("ar_attn", "ar_ffn") for task in t8 for k in task.ops)
    assert t8[1].num_decode == 0 and "attn_decode" not in {k.op for k in t8[1].ops}
    assert {k.context for k in t8[2].ops if k.op == "attn_decode"} == {1536}
    # a layer with an op that has no row is left out
    assert [t.tokens for t in layer_tasks(s, 132, s.decode_contexts(),
                                          lambda op, t, c: None if t == 512 else "x")] == [
        256, 1024]


def test_profile_measures_the_forward_table_and_keeps_it_across_a_resume(tmp_path):
    s = ProfileSettings(SPEC, 1, fixed(1024, 512), 256, quick=True)
    backend = FakeBackend()
    prof = run_profile(s, backend, RunOptions(tmp_path / "p.json", progress=False,
                                              log=lambda _: None))
    assert {(r.batch_tokens, r.num_decode) for r in prof.forward} == {
        (128, 128), (128, 0), (256, 128)}  # the tail, then the steady mix at half and all
    assert len(backend.layer_calls) == 3 and FORWARD_NOTE in prof.notes
    for r in prof.forward:
        assert r.row_us == prof.kernel_time_us(r.op, r.tokens, None, r.context or None)
        assert (r.settle_ms, r.window_ms) == (300.0, 1000.0)
    assert prof.settled_factor("ug", 256) == pytest.approx(1.08, rel=1e-4)  # fake.LAYER_SLOWDOWN
    assert prof.settled_factor("act", 256) == pytest.approx(0.85, rel=1e-4)  # fake.LAYER_L2
    assert prof.settled_factor("ug", 128) == pytest.approx(1.04, rel=1e-4)
    assert {r.clock_mhz for r in prof.forward if r.batch_tokens == 256} == {1500.0}
    # the partial file keeps the measured layers, so a resumed run does not time them again
    state = RunState(settings=s.to_json(), identity=backend.identity(""))
    state.forward[("layer", 256, 0)] = [r for r in prof.forward if r.batch_tokens == 256]
    save_state(state, tmp_path / "x.partial.json")
    again = load_state(tmp_path / "x.partial.json", s, backend.identity(""))
    assert again.forward == state.forward


def _profile_without_forward(tmp_path: Path, gpu: str = "Fake GPU 132") -> tuple[Profile, Path]:
    s = ProfileSettings(SPEC, 1, fixed(1024, 512), 256, quick=True)
    prof = run_profile(s, FakeBackend(), RunOptions(tmp_path / "full.json", progress=False,
                                                    log=lambda _: None))
    notes = tuple(n for n in prof.notes if n != FORWARD_NOTE) + ("forward table: an older one",)
    bare = replace(prof, forward=(), notes=notes, identity=replace(prof.identity, gpu_name=gpu))
    path = tmp_path / "old.json"
    save_profile(bare, path)
    return prof, path


def test_profile_forward_adds_the_table_to_a_finished_profile(tmp_path):
    measured, old = _profile_without_forward(tmp_path)
    res = run_cli("profile", "forward", str(old), "--fake-gpu", "--no-progress",
                  "--out", str(tmp_path / "new.json"))
    assert res.exit_code == 0, res.output
    assert "at 128 decode, 128, 256 rows" in res.output
    assert "forward table of 3 layers" in res.output
    new = load_profile(tmp_path / "new.json")
    assert new.forward == measured.forward and new.notes.count(FORWARD_NOTE) == 1
    assert "forward table: an older one" not in new.notes  # its note replaces an older one
    assert new.kernels == measured.kernels
    assert not load_profile(old).forward  # --out leaves FILE as it was
    res = run_cli("profile", "forward", str(old), "--fake-gpu", "--no-progress")
    assert res.exit_code == 0 and load_profile(old).forward == measured.forward
    res = run_cli("profile", "show", str(old))
    assert "forward: a Sequential layer looped" in res.output
    assert "layer of 256 rows (128 decode)" in res.output
    # the tail and the mix of one size are two layers, each summed on its own
    assert "layer of 128 rows (128 decode)" in res.output
    assert "layer of 128 rows (0 decode)" in res.output


def test_profile_forward_refuses_another_gpu(tmp_path):
    _, old = _profile_without_forward(tmp_path, gpu="NVIDIA H200")
    res = run_cli("profile", "forward", str(old), "--fake-gpu", "--no-progress")
    assert res.exit_code == 2
    assert "measured on 'NVIDIA H200', this GPU is 'Fake GPU 132'" in res.output


def _settled(prof: Profile, t: int, factor: float) -> Profile:
    ops = [op.name for op in layer_ops(SPEC, 1)]
    return replace(prof, forward=tuple(row(op, t, factor) for op in ops))


@pytest.mark.slow
def test_search_prices_ops_alone_on_the_whole_gpu_at_the_settled_factor():
    base = small_profile()
    prof = _settled(base, 768, 1.1)
    full = [o for o in alloc_options(prof, "compute", "ug", 384, 768)
            if o.mechanism == Mechanism.FULL]
    assert [o.p for o in full] == [pytest.approx(1 / 1.1)]
    paired = [o for o in alloc_options(prof, "compute", "ug", 384, 768)
              if o.mechanism != Mechanism.FULL]
    assert paired == [o for o in alloc_options(base, "compute", "ug", 384, 768)
                      if o.mechanism != Mechanism.FULL]  # pairs keep P against the rows
    cfg = SearchConfig(SPEC, 1, prof, fixed(512, 512), 768, time_limit_s=3.5, num_workers=2,
                       deterministic=True)
    sched = run_search(cfg)
    check_schedule(sched, prof)
    assert sequential_baseline(SPEC, 1, prof, sched.batch)[0] == pytest.approx(
        1.1 * sequential_baseline(SPEC, 1, base, sched.batch)[0])
    raw = sequential_op_times(SPEC, 1, prof, sched.batch, settled=False)
    assert raw == sequential_op_times(SPEC, 1, base, sched.batch)
    assert sched.prediction.sequential_period_us == pytest.approx(1.1 * sum(raw.values()))
    for n in sched.nano_ops:
        if n.alloc.mechanism == "full":
            assert n.alloc.p == pytest.approx(1 / 1.1)
    assert simulate(sched, prof).period_us > 0
    bare = replace(sched, profile_digest=base.digest())  # as if searched on the bare rows
    with pytest.raises(Exception, match="is not a point of the profile's R->P table"):
        check_schedule(bare, base)  # its whole-GPU nano-ops are priced at F = 1.1


def test_a_layers_ops_read_the_op_before_its_output():
    """`layer_kernels`: each op's input is the output of the op before it (the first op reads
    the last op's), so the layer's ops find in L2 what a forward's find."""
    ws = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32)
    gemms = ("kqv", "o", "ug", "d")
    calls = [(call(TINY, op.name, ws), "cublas" if op.name in gemms else "torch")
             for op in layer_ops(TINY)]
    kernels = impl_registry.layer_kernels(calls)
    assert len(kernels) == len(calls)
    for kern in kernels:
        kern.fn()
    assert ws.tensor("x_kqv", (32, 64)).data_ptr() == ws.cache["y_norm"].data_ptr()
    assert ws.tensor("x_d", (32, 96)).data_ptr() == ws.cache["act_out"].data_ptr()
    assert ws.tensor("x_o", (32, 64)).data_ptr() == ws.cache["y_decode"].data_ptr()
    kernels[0].fn()  # kqv again, on what the norm at the end of the layer wrote
    torch.testing.assert_close(ws.cache["y_kqv"][:24],
                               ws.cache["y_norm"][:24] @ ws.cache["w_kqv"].T)
