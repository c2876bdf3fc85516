"""The profiling loop on a fake GPU: full tables, best rows, resume, busy/drift reports."""

import json
from pathlib import Path

import pytest

from nanosched.errors import ProfileError
from nanosched.kernels.impls import check_op_impl, family_of
from nanosched.models.ops import layer_ops
from nanosched.models.spec import load_spec
from nanosched.profiler.fake import FakeBackend
from nanosched.profiler.format import check_profile_for, load_profile
from nanosched.profiler.plan import ProfileSettings, kernel_tasks
from nanosched.profiler.runner import ProfileInterrupted, RunOptions, run_profile
from nanosched.profiler.state import partial_path
from nanosched.workloads import fixed

SPEC = load_spec("llama3-8b")


def settings(tp: int = 1, quick: bool = False, dense: int = 256) -> ProfileSettings:
    return ProfileSettings(SPEC, tp, fixed(1024, 512), dense, quick)


def run(tmp_path: Path, backend: FakeBackend, s: ProfileSettings, resume: bool = False,
        name: str = "p.json"):
    logs: list[str] = []
    prof = run_profile(s, backend, RunOptions(tmp_path / name, resume, progress=False,
                                              log=logs.append))
    return prof, logs


def test_every_op_token_sm_impl_row_is_present_and_best_is_marked(tmp_path):
    s = settings()
    backend = FakeBackend()
    prof, logs = run(tmp_path, backend, s)
    impls, _ = backend.implementations()
    # every op x tokens x SM allocation x implementation the plan asked for is in the table
    want = {t.key for t in kernel_tasks(s, 132, [(16, 116), (32, 100), (48, 84), (64, 68)],
                                        impls)}
    have = {(k.op, k.tokens, k.context, k.sms, k.mechanism, k.impl) for k in prof.kernels}
    assert want == have
    assert {k.sms for k in prof.kernels if k.op == "kqv"} == \
        {16, 32, 48, 64, 68, 84, 100, 116, 132}
    assert {k.impl for k in prof.kernels if k.op == "kqv"} == {
        "cublas", "cublaslt", "triton_persistent_128x128", "triton_persistent_128x256"}
    assert {k.context for k in prof.kernels if k.op == "attn_decode"} == {512, 1024, 1280, 1536}
    # row impls are the runtime's names, so a schedule naming one launches what was measured
    assert {k.impl for k in prof.kernels if k.op == "attn_decode"} == {
        "triton_pipelined", "triton_pipelined_2w", "triton_paged", "torch"}
    assert {k.impl for k in prof.kernels if k.op == "rope_append"} == {"triton", "torch"}
    # elementwise ops bounded to CTAs, as a schedule bounds them beside a GEMM (Triton only)
    assert {(k.sms, k.impl) for k in prof.kernels if k.op == "act" and
            k.mechanism == "cta_bound"} == {(c, "triton") for c in (8, 16, 32, 48, 64, 96, 128)}
    for k in prof.kernels:
        if family_of(k.op):
            assert check_op_impl(k.op, k.impl) == k.impl
    assert {p.other_impl for p in backend.pair_calls} == {"triton_pipelined"}
    assert {k.sms for k in prof.kernels if k.mechanism == "cta_bound"} == \
        {8, 16, 32, 48, 64, 96, 128}
    # exactly one best row per (op, tokens, context, sms), and it is the fastest
    groups: dict = {}
    for k in prof.kernels:
        groups.setdefault((k.op, k.tokens, k.context, k.sms), []).append(k)
    for rows in groups.values():
        best = [r for r in rows if r.best]
        assert len(best) == 1 and best[0].time_us == min(r.time_us for r in rows)
    assert prof.kernel_time_us("kqv", 256) == min(
        k.time_us for k in prof.kernels if (k.op, k.tokens, k.sms) == ("kqv", 256, 132))
    check_profile_for(load_profile(tmp_path / "p.json"), SPEC, 1, "Fake GPU 132")
    assert not partial_path(tmp_path / "p.json").exists()
    assert "took" in logs[-1]


def test_interrupted_run_resumes_measuring_only_missing_rows(tmp_path):
    s = settings(quick=True)
    whole, _ = run(tmp_path, FakeBackend(), s, name="whole.json")
    first = FakeBackend(interrupt_after=40)
    with pytest.raises(ProfileInterrupted, match=r"saved to .*p\.partial\.json; continue"):
        run(tmp_path, first, s)
    partial = partial_path(tmp_path / "p.json")
    assert len(json.loads(partial.read_text())["kernels"]) == 40
    second = FakeBackend()
    prof, logs = run(tmp_path, second, s, resume=True)
    assert "40 kernel rows" in logs[0]
    total = len(kernel_tasks(s, 132, [(32, 100)], second.implementations()[0]))
    assert len(second.calls) == total - 40
    assert not {t.key for t in first.calls} & {t.key for t in second.calls}
    assert prof.kernels == whole.kernels and prof.rp == whole.rp
    assert not partial.exists()


def test_resume_refuses_partial_of_another_gpu_or_model(tmp_path):
    s = settings(quick=True)
    with pytest.raises(ProfileInterrupted):
        run(tmp_path, FakeBackend(interrupt_after=5), s)
    with pytest.raises(ProfileError, match="measured on 'Fake GPU 132', this GPU is 'Other'"):
        run(tmp_path, FakeBackend(gpu_name="Other"), s, resume=True)
    other = ProfileSettings(load_spec("llama2-70b"), 8, fixed(1024, 512), 256, True)
    with pytest.raises(ProfileError, match="model='llama3-8b', this run has model='llama2-70b'"):
        run(tmp_path, FakeBackend(), other, resume=True)
    with pytest.raises(ProfileError, match="no partial profile"):
        run(tmp_path, FakeBackend(), s, resume=True, name="never.json")


def test_busy_gpu_drift_and_unsupported_rows_are_reported(tmp_path):
    backend = FakeBackend(busy_reasons=["1 other process(es) on GPU 0"], drift=0.2,
                          unsupported={"torch"})
    prof, logs = run(tmp_path, backend, settings(quick=False, dense=128))
    notes = " | ".join(prof.notes)
    assert "GPU busy: 1 other process(es)" in notes
    assert "+20% from 200.0 us" in notes
    assert "rows not measured: torch refuses" in notes
    assert not [k for k in prof.kernels if k.impl == "torch"]
    assert any("warning: GPU busy" in line for line in logs)


def test_network_rows_measured_on_two_gpus_and_modelled_beyond(tmp_path):
    two, _ = run(tmp_path, FakeBackend(gpus=2), settings(tp=2, quick=True), name="a.json")
    ops = {k.op for k in two.kernels}
    assert {"ar_attn", "ar_ffn", "rs_attn", "rs_ffn", "ag_attn", "ag_ffn"} <= ops
    assert not any(k.modelled for k in two.kernels)
    assert {k.impl for k in two.kernels if k.op == "ar_ffn"} == {
        "nccl", "nccl_ctas2", "nccl_ctas8", "copy_engine", "copy_engine_ctas8",
        "copy_engine_ctas16"}
    assert two.ceilings.allreduce_busbw_gbs == pytest.approx(230, rel=1e-6)
    assert "network" in two.rp
    net_pairs = [p for p in two.pairs if p.other_class == "network"]
    assert net_pairs and all(p.sustained and p.clock_mhz for p in net_pairs)
    ce = [p for p in net_pairs if p.other_impl.startswith("copy_engine")]
    # beside a GEMM told to leave the reduction's SMs only (cuBLAS cannot be told)
    assert ce and all(p.mechanism == "cta_bound" and p.compute_impl != "cublas" and
                      p.compute_sms == 132 - p.other_sms for p in ce)
    assert {p.other_impl for p in ce} == {"copy_engine_ctas8", "copy_engine_ctas16"}
    s8 = ProfileSettings(load_spec("llama3-70b"), 8, fixed(1024, 512), 256, True)
    eight, _ = run(tmp_path, FakeBackend(gpus=2), s8, name="b.json")
    net = [k for k in eight.kernels if k.op == "ar_attn"]
    assert net and all(k.modelled for k in net)
    assert eight.ceilings.allreduce_modelled
    assert eight.ceilings.allreduce_busbw_gbs == pytest.approx(230, rel=1e-6)
    assert any("modelled with NCCL's ring formulas from measurements on 2 GPUs" in n
               for n in eight.notes)
    assert {op.name for op in layer_ops(s8.model, 8)} <= {k.op for k in eight.kernels}
    assert not any(k.impl.startswith("copy_engine") for k in eight.kernels)
    assert any("copy-engine all-reduce not measured: it runs on all 8 GPUs" in n
               for n in eight.notes)
    none, _ = run(tmp_path, FakeBackend(gpus=2, copy_engine_reason="cuda is not installed"),
                  settings(tp=2, quick=True), name="c.json")
    assert not any(k.impl.startswith("copy_engine") for k in none.kernels)
    assert any("copy-engine all-reduce not measured: cuda is not installed" in n
               for n in none.notes)


def test_pairs_are_timed_sustained_against_sustained_alone_times_with_the_best_gemms(tmp_path):
    """Each pair shape gets one placement per way of sharing (streams, each partition, each
    CTA bound) with the GEMM fastest alone there; pairs and the alone times they are normalised
    to are both looped for the settle time and timed over the window, and say so."""
    s = settings()
    backend = FakeBackend()
    prof, _ = run(tmp_path, backend, s)
    shapes = s.pair_shapes()
    assert len(prof.pairs) == len(shapes) * (1 + 4 + 4)
    for pair in prof.pairs:
        assert pair.sustained and (pair.settle_ms, pair.window_ms) == (300.0, 1000.0)
        assert pair.clock_mhz == 1500.0 and pair.compute_alone_clock_mhz == 1500.0
        placed = [k for k in prof.kernels if (k.op, k.tokens, k.sms) == (
            pair.compute_op, pair.tokens, pair.compute_sms) and k.mechanism == (
            "green_ctx" if pair.mechanism == "green_ctx" else "full")]
        if pair.mechanism != "cta_bound":
            assert pair.compute_impl == min(placed, key=lambda k: k.time_us).impl
        fastest = min(k.time_us for k in prof.kernels if (k.op, k.tokens, k.sms, k.mechanism)
                      == (pair.compute_op, pair.tokens, 132, "full"))
        assert pair.compute_alone_us == pytest.approx(fastest * 1980 / 1500)  # sustained
    # one sustained alone time per (op, impl, shape), reused by every placement
    assert len(backend.sustained_calls) == len({(t.op, t.impl, t.tokens, t.context)
                                                for t in backend.sustained_calls})
    assert prof.unsettled() is None
    assert all(k.clock_mhz == 1980.0 for k in prof.kernels if not k.modelled)
    assert prof.throttled(1500.0) and not prof.throttled(1980.0)
    assert {p.clock_mhz for p in prof.rp["memory"]} == {1500.0}


def test_a_profile_with_burst_pairs_is_unsettled_and_says_why(tmp_path):
    from dataclasses import replace

    prof, _ = run(tmp_path, FakeBackend(), settings())
    burst = replace(prof, pairs=tuple(replace(p, settle_ms=0.0, window_ms=3.0)
                                      for p in prof.pairs))
    assert "timed in bursts (settle + window at most 3 ms)" in burst.unsettled()
    legacy = replace(prof, pairs=tuple(replace(p, settle_ms=0.0, window_ms=0.0)
                                       for p in prof.pairs))
    assert "no settle time or window recorded" in legacy.unsettled()
