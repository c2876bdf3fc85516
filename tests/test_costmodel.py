"""NanoFlow's cost model (§3) against the paper's Table 2 and Eq. 5.

Table 2 prices LLaMA-2-70B on 8 x A100-80GB (312 TFLOP/s, 2,000 GB/s, 600 GB/s NVLink, one
direction used for the network) at dense batch 2048. Its attention rows fix the workload: decode
attention's 3,665.9 GFLOP and 462.2 GB follow from 1,365 decode tokens with context 1,024, i.e.
input 512 / output 1,024 (the §6.4 decode-heavy workload).
"""

import pytest

from nanosched.errors import ConfigError
from nanosched.hardware import get_gpu
from nanosched.models.costmodel import analyze, batch_mix, optimal_tokens_per_s_per_gpu
from nanosched.models.spec import load_spec
from nanosched.workloads import fixed

# op: (GFLOP, mem GB, est. T_comp ms, est. T_mem ms) from NanoFlow Table 2
TABLE2_GEMMS = {
    "kqv": (27487.8, 19.5, 11.01, 1.22),
    "o": (21990.2, 16.1, 8.81, 1.01),
    "ug": (153931.6, 96.6, 61.67, 6.04),
    "d": (76965.8, 49.7, 30.84, 3.11),
}


@pytest.fixture(scope="module")
def table2():
    a = analyze(load_spec("llama2-70b"), get_gpu("a100"), 8, fixed(512, 1024), 2048)
    return {op.name: op for op in a.ops}, a


def rel(x: float, y: float) -> float:
    return abs(x - y) / abs(y)


@pytest.mark.parametrize("name", sorted(TABLE2_GEMMS))
def test_table2_gemm_rows(table2, name):
    ops, _ = table2
    gflop, mem_gb, t_comp_ms, t_mem_ms = TABLE2_GEMMS[name]
    op = ops[name]
    assert rel(op.flops / 1e9, gflop) < 1e-3
    assert rel(op.t_compute_s * 1e3, t_comp_ms) < 1e-3
    # Table 2 prints bytes to 0.1 GB and memory times to 0.01 ms, the times computed from the
    # rounded bytes (D: 49.7 GB / 16 TB/s = 3.11 ms; unrounded 49.66 GB gives 3.104 ms), so
    # 0.1% is below the paper's own precision here: compare within its last printed digit.
    assert op.mem_bytes / 1e9 == pytest.approx(mem_gb, abs=0.05)
    assert op.t_mem_s * 1e3 == pytest.approx(t_mem_ms, abs=0.01)
    assert op.bottleneck == "compute"


def test_table2_decode_attention_and_network(table2):
    ops, _ = table2
    dec = ops["attn_decode"]
    assert rel(dec.flops / 1e9, 3665.9) < 1e-3
    assert rel(dec.mem_bytes / 1e9, 462.2) < 1e-3
    assert round(dec.t_mem_s * 1e3, 2) == pytest.approx(28.89, abs=0.011)
    assert dec.bottleneck == "memory"
    net = ops["ar_attn"], ops["ar_ffn"]
    assert rel(sum(o.net_bytes for o in net) / 1e9, 75.2) < 1e-3
    assert rel(sum(o.flops for o in net) / 1e9, 18.8) < 2e-3
    assert rel(sum(o.t_net_s for o in net) * 1e3, 31.33) < 1e-3
    assert rel(sum(o.t_mem_s for o in net) * 1e3, 4.70) < 1e-3


def test_table2_totals_over_its_rows(table2):
    ops, a = table2
    rows = ["kqv", "o", "ug", "d", "attn_decode", "attn_prefill", "ar_attn", "ar_ffn"]
    assert a.bottleneck == "compute"
    # Table 2's total T_comp is 114.17 ms, including prefill attention at 0.37 ms where our
    # causal count gives 0.18 ms (see test_paper_figures_the_formulas_do_not_give).
    t_comp = sum(ops[r].t_compute_s for r in rows) * 1e3
    assert t_comp == pytest.approx(114.17 - 0.37 + 0.18, abs=0.05)


def test_paper_figures_the_formulas_do_not_give(table2):
    """Figures of the paper that its formulas and stated inputs do not reproduce, and why."""
    ops, _ = table2
    pf = ops["attn_prefill"]
    # 1. Prefill attention: Table 2 says 916.3 GFLOP = 4 Hq d L n_p p, the full p x p score
    #    matrix. Causal attention (what flash kernels compute) needs half: 4 Hq d L n_p (p+1)/2.
    assert rel(pf.flops / 1e9 * 2 * 512 / 513, 916.3) < 1e-3
    # 2. Prefill attention bytes: Q, K, V and O of the prefill tokens give 2.01 GB; Table 2
    #    prints 2.1 GB. What else the paper counts is not stated.
    assert pf.mem_bytes / 1e9 == pytest.approx(2.013, abs=1e-3)
    # 3. Optimal throughput: §3.5 states 280 TFLOP/s and P = 70 B, and Eq. 5 gives 2,000
    #    tokens/s/GPU, not the paper's 1,857 (which would need 260 TFLOP/s, or P = 75.4 B).
    spec = load_spec("llama2-70b")
    assert spec.num_params() == pytest.approx(68.98e9, rel=1e-3)
    assert 280e3 * 1e9 / (2 * 70e9) == pytest.approx(2000)
    assert optimal_tokens_per_s_per_gpu(spec, 280e3) == pytest.approx(2029.7, abs=0.1)


def test_max_dense_batch_matches_paper_for_70b_on_8_a100(table2):
    # §4.1.1: "2048 for 8 x A100 serving LLaMA-2 70B".
    _, a = table2
    assert a.max_dense_batch == 2048


def test_batch_mix_and_t_r():
    mix = batch_mix(fixed(1024, 512), 2048)
    assert mix.num_decode == pytest.approx(2048 / 3)
    assert mix.decode_context == 1280
    a = analyze(load_spec("llama3-8b"), get_gpu("h100"), 1, fixed(1024, 512), 1024)
    # Eq. 4 directly: (Compute / MemBW) (MemSize / P) / (2 B)
    p = load_spec("llama3-8b").num_params()
    expected = (989e12 / 3352e9) * (80 * 2**30 / p) / (2 * 1024)
    assert a.t_r == pytest.approx(expected, rel=1e-9)


def test_moe_counts_active_params_for_the_optimum():
    spec = load_spec("mixtral-8x7b")
    assert spec.num_params() == pytest.approx(46.70e9, rel=1e-3)
    assert spec.num_params(active=True) == pytest.approx(12.88e9, rel=1e-3)
    a = analyze(spec, get_gpu("h100"), 2, fixed(1024, 512), 1024)
    names = [op.name for op in a.ops]
    assert "experts_ug" in names and "ug" not in names and "ar_ffn" in names


def test_model_too_big_is_reported():
    with pytest.raises(ConfigError, match="does not fit 1 x a100-40g"):
        analyze(load_spec("llama3-70b"), get_gpu("a100-40g"), 1, fixed(1024, 512))


def test_dense_batch_must_be_positive():
    with pytest.raises(ConfigError, match="--dense-batch"):
        analyze(load_spec("llama3-8b"), get_gpu("h100"), 1, fixed(1024, 512), 0)


def test_choose_tp_is_the_smallest_that_holds_the_batch():
    from nanosched.models.costmodel import choose_tp, max_dense_batch

    spec, gpu, wl = load_spec("llama3-70b"), get_gpu("h100"), fixed(1024, 512)
    assert max_dense_batch(spec, gpu, 4, wl) < 2048 <= max_dense_batch(spec, gpu, 8, wl)
    assert choose_tp(spec, gpu, wl) == 8
    assert choose_tp(spec, gpu, wl, dense_batch=1024) == 4
    assert choose_tp(load_spec("llama3-8b"), get_gpu("h200"), wl) == 1
    with pytest.raises(ConfigError, match="no tp in .* fits a 100000-token dense batch"):
        choose_tp(spec, get_gpu("a100-40g"), wl, dense_batch=100000)


def test_measured_gpu_keeps_the_prior_but_takes_measurements():
    from nanosched.hardware import measured_gpu, prior_for

    assert prior_for("NVIDIA H200").name == "h200"
    assert prior_for("NVIDIA A100-SXM4-40GB").name in ("a100-40g", "a100")
    assert prior_for("Some TPU") is None
    g = measured_gpu("NVIDIA H200", 150109880320, 775.0, 4186.0)
    assert g.name == "h200" and g.mem_gib == pytest.approx(139.8, abs=0.1)
    assert g.compute_gflops == 775e3 and g.mem_bw_gbs == 4186.0 and g.num_sms == 132
