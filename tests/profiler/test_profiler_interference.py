"""Pareto filtering, R->P derivation with a known answer, and NCCL's ring formulas."""

import pytest

from nanosched.errors import ProfileError
from nanosched.profiler.format import PairRow, RPPoint
from nanosched.profiler.interference import derive_rp, pareto, r_of
from nanosched.profiler.network_model import busbw_gbs, fit_ring, ring_time_us


def pair(op, tokens, mech, impl, c_sms, o_sms, p_c, p_o):
    """A pair whose kernels ran at P = p_c and p_o (alone 100 us each)."""
    return PairRow(op, "attn_decode", "memory", tokens, mech, impl, c_sms, o_sms, 100.0, 100.0,
                   100.0 / p_c, 100.0 / p_o, context=1024)


def pt(p_c, p_o, r=0.5):
    return RPPoint(r, p_o, p_c, "green_ctx", 100, 32)


def test_pareto_keeps_only_undominated_points():
    a, b, c, d = pt(0.9, 0.2), pt(0.7, 0.6), pt(0.6, 0.5), pt(0.5, 0.9)
    assert pareto([a, b, c, d]) == [d, b, a]  # equal R: higher P_other first
    assert pareto([a, a]) == [a]  # equal points: one kept


def test_r_is_the_share_given_to_the_other_kernel():
    assert r_of(pair("ug", 512, "green_ctx", "cublas", 100, 32, 0.7, 0.5), 132) == \
        pytest.approx(32 / 132)
    assert r_of(pair("ug", 512, "cta_bound", "cublas", 132, 16, 0.9, 0.3), 132) == \
        pytest.approx(16 / 132)
    # nothing bounds it: NanoFlow's GEMM-centric proxy, 1 - P_compute
    assert r_of(pair("ug", 512, "stream_priority", "cublas", 132, 132, 0.8, 0.2), 132) == \
        pytest.approx(0.2)


def test_rp_table_known_answer():
    pairs = []
    for tokens, wobble in ((512, 0.0), (1024, 0.02)):
        pairs += [
            pair("ug", tokens, "green_ctx", "cublas", 100, 32, 0.60, 0.50 + wobble),
            pair("ug", tokens, "green_ctx", "triton", 100, 32, 0.72, 0.50 + wobble),
            pair("ug", tokens, "cta_bound", "triton", 116, 16, 0.85, 0.30 - wobble),
            pair("ug", tokens, "stream_priority", "cublas", 132, 132, 0.88, 0.10),
            pair("ug", tokens, "cta_bound", "cublas", 132, 64, 0.50, 0.45),  # dominated
        ]
    table = derive_rp(pairs, 132)
    assert table.num_shapes == 2
    got = [(round(p.r, 4), round(p.p_other, 4), round(p.p_compute, 4), p.mechanism,
            p.compute_impl) for p in table.points]
    assert got == [
        (0.12, 0.1, 0.88, "stream_priority", "cublas"),
        (round(16 / 132, 4), 0.29, 0.85, "cta_bound", "triton"),
        (round(32 / 132, 4), 0.51, 0.72, "green_ctx", "triton"),
    ]
    spread = {p.mechanism: p.std_rel for p in table.points}
    assert spread["green_ctx"] == pytest.approx(0.01 / 0.51)
    assert table.fit == pytest.approx(0.01 / 0.29) and table.fits
    assert {(p.compute_op, p.tokens) for p in table.per_shape} == {("ug", 512), ("ug", 1024)}


def test_rp_table_that_does_not_fit_across_shapes():
    pairs = [pair("kqv", 256, "green_ctx", "cublas", 100, 32, 0.7, 0.2),
             pair("kqv", 2048, "green_ctx", "cublas", 100, 32, 0.7, 0.6)]
    table = derive_rp(pairs, 132)
    assert table.fit == pytest.approx(0.5) and not table.fits


def test_ring_formulas_and_fit_round_trip():
    sizes = [2 ** 20 * k for k in (1, 4, 16, 64)]
    times = [ring_time_us("all_reduce", s, 2, 200.0, 7.0, hop_us=2.0) for s in sizes]
    assert times[0] == pytest.approx(2 ** 20 / 200e3 + 7 + 2 * 2.0)
    bw, lat = fit_ring("all_reduce", 2, sizes, times, hop_us=2.0)
    assert bw == pytest.approx(200.0) and lat == pytest.approx(7.0)
    # 8 GPUs: 2 (N-1)/N of the bytes, the fixed latency once, 2 (N-1) hops
    assert ring_time_us("all_reduce", 2 ** 26, 8, bw, lat, hop_us=2.0) == pytest.approx(
        1.75 * 2 ** 26 / 200e3 + 7.0 + 14 * 2.0)
    assert ring_time_us("reduce_scatter", 2 ** 26, 8, bw, lat, hop_us=2.0) == pytest.approx(
        0.875 * 2 ** 26 / 200e3 + 7.0 + 7 * 2.0)
    # an intercept smaller than the hops it must hold leaves no fixed latency, never a negative
    assert fit_ring("all_reduce", 2, sizes, [s / 200e3 + 1.0 for s in sizes])[1] == 0.0
    assert busbw_gbs("all_reduce", 2 ** 30, 2, 2 ** 30 / 200e3) == pytest.approx(200.0)
    with pytest.raises(ProfileError, match="do not grow with size"):
        fit_ring("all_gather", 2, [1e6, 2e6], [50.0, 40.0])
    with pytest.raises(ProfileError, match="at least 2 GPUs"):
        ring_time_us("all_reduce", 1e6, 1, 200.0, 7.0)


def test_fit_caps_a_latency_bound_bandwidth_at_the_link():
    # the two-H200 all-reduce of [T, 8192] bf16, T = 128..768, measured flat at 58-62 us
    sizes = [t * 8192 * 2 for t in (128, 256, 384, 512, 640, 768)]
    times = [61.2, 58.4, 58.2, 59.0, 57.8, 61.7]
    free_bw, _ = fit_ring("all_reduce", 2, sizes, times)
    assert free_bw > 450  # what the uncapped fit believes: more than the link carries
    bw, lat = fit_ring("all_reduce", 2, sizes, times, 450.0)
    assert bw == pytest.approx(450.0) and 0 < lat < 60  # the fixed part of 58-62 us
    # a 64 MiB all-reduce on 8 GPUs now costs at least the link's time for its bytes
    big = 64 * 2 ** 20
    assert ring_time_us("all_reduce", big, 8, bw, lat) >= 1.75 * big / 450e3
    # times that even fall with size (noise around a flat latency) take the link's bandwidth
    bw, lat = fit_ring("all_gather", 2, [1e6, 2e6], [50.0, 40.0], 450.0)
    assert bw == pytest.approx(450.0) and lat > 0


def test_pairs_run_the_attention_kernel_fastest_at_their_placement_and_points_name_it():
    """A partition's pair runs the attention implementation fastest alone on its SMs; the R->P
    point and the search's allocation option carry that name, so the replay launches it."""
    import dataclasses

    from nanosched.autosearch.durations import alloc_options
    from nanosched.models.spec import load_spec
    from nanosched.profiler.plan import ImplInfo, ProfileSettings, memory_pair_tasks
    from nanosched.workloads import fixed

    settings = ProfileSettings(load_spec("llama3-8b"), 1, fixed(1024, 512), 256, quick=True)
    gemm = {op: [ImplInfo("cublas", ("full", "green_ctx"))] for op in ("kqv", "o", "ug", "d")}

    def best_memory(tokens, context, sms, mechanism):
        return "triton_pipelined_2w" if sms == 32 else None  # faster only on 32 SMs

    tasks = memory_pair_tasks(settings, 132, [(32, 100), (64, 68)], gemm, "triton_pipelined",
                              lambda *a: "cublas", best_memory)
    by = {(t.mechanism, t.other_sms): t.other_impl for t in tasks}
    assert by[("green_ctx", 32)] == "triton_pipelined_2w"
    assert by[("green_ctx", 64)] == "triton_pipelined"
    assert by[("stream_priority", 132)] == "triton_pipelined"

    pair = PairRow("ug", "attn_decode", "memory", 256, "green_ctx", "cublas", 100, 32,
                   100.0, 50.0, 160.0, 120.0, context=768, other_impl="triton_pipelined_2w")
    table = derive_rp([pair, dataclasses.replace(pair, other_impl="", other_us=200.0)], 132)
    assert [p.other_impl for p in table.points] == ["triton_pipelined_2w"]  # the faster one
    from search_fixtures import small_profile

    prof = dataclasses.replace(small_profile(), rp={**small_profile().rp,
                                                    "memory": table.points})
    impls = {o.impl for o in alloc_options(prof, "memory") if o.mechanism == "green_ctx"}
    assert impls == {"triton_pipelined_2w"}


def test_p_is_normalised_to_the_kernel_rows():
    """t_row / P is the time the kernel took in the pair: P against the profile's row of that
    op and shape, not the pair's own (sustained, slower) alone time; the pair's own alone time
    where the profile has no row."""
    p = PairRow("ug", "attn_decode", "memory", 640, "green_ctx", "triton", 100, 32, 247.0,
                1103.0, 524.0, 1581.0, context=1280)
    rows = {("ug", 640, 0): 210.0, ("attn_decode", 640, 1280): 1110.0}
    table = derive_rp([p], 132, lambda op, tokens, ctx: rows.get((op, tokens, ctx)))
    (point,) = table.points
    assert 210.0 / point.p_compute == pytest.approx(524.0)
    assert 1110.0 / point.p_other == pytest.approx(1581.0)
    (bare,) = derive_rp([p], 132, lambda op, tokens, ctx: None).points
    assert (bare.p_compute, bare.p_other) == pytest.approx((247 / 524, 1103 / 1581))


@pytest.mark.parametrize("name", ["llama3-8b-tp1-h100", "llama3-8b-tp1-h200"])
def test_shipped_profiles_follow_the_derivation(name):
    """The shipped profiles' R->P tables are what `rederive_rp` gives from their pairs and
    rows, and a paired GEMM's row / P is its time in the pair (within the fold's spread)."""
    from nanosched.profiler.build import rederive_rp
    from nanosched.profiler.catalog import shipped_profiles
    from nanosched.profiler.format import load_profile

    prof = load_profile(shipped_profiles()[name])
    assert rederive_rp(prof) == prof
    for pt in prof.rp_shapes.get("memory", ()):
        pair = next(p for p in prof.pairs if (p.compute_op, p.tokens, p.context, p.mechanism,
                                              p.compute_impl, p.compute_sms, p.other_sms) ==
                    (pt.compute_op, pt.tokens, pt.context, pt.mechanism, pt.compute_impl,
                     pt.compute_sms, pt.other_sms))
        row = prof.kernel_time_us(pt.compute_op, pt.tokens)
        assert row / pt.p_compute == pytest.approx(pair.compute_us, rel=1e-6)
