"""bench/engine/graph_kernels.py's attribution of a forward's kernels to ops (kernel_trace)."""

import pytest

from bench.engine.kernel_trace import TracedKernel, attribute, kind_of

GEMM_A = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT"
GEMM_B = "nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_TNT"
LAYER = [  # one layer as the Sequential graph runs it, with a kernel time per op
    (GEMM_B, 63.0), ("_rope_append_kernel", 8.0), ("_decode_partial_kernel", 450.0),
    ("_decode_merge_kernel", 10.0), ("_prefill_kernel", 35.0), (GEMM_A, 47.0),
    ("_rms_norm_add_kernel", 9.0), (GEMM_A, 270.0), ("_silu_mul_kernel", 26.0),
    (GEMM_A, 132.0), ("_rms_norm_add_kernel", 8.5)]


def forward(layers: int, lm_head: bool = False, shuffle: bool = False) -> list[TracedKernel]:
    names = [("void at::native::vectorized_gather_kernel<16, long>", 0.1),
             ("_rms_norm_add_kernel", 8.0)] + LAYER * layers
    if lm_head:
        names.append(("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_TNN", 500.0))
    trace, t = [], 0.0
    for name, us in names:
        trace.append(TracedKernel(name, t, us))
        t += us + 1.0
    return trace[::-1] if shuffle else trace  # attribution orders by start


@pytest.mark.parametrize("lm_head", [False, True])
def test_each_kernel_lands_on_its_op(lm_head):
    att = attribute(forward(3, lm_head, shuffle=True), 3)
    assert not isinstance(att, str)
    assert len(att.per_layer) == 3
    assert att.median_us() == {"kqv": 63.0, "rope_append": 8.0, "attn_decode": 460.0,
                               "attn_prefill": 35.0, "o": 47.0, "add_norm_ffn": 9.0,
                               "ug": 270.0, "act": 26.0, "d": 132.0, "add_norm_attn": 8.5}
    assert att.embed_us == pytest.approx(8.1)
    assert att.lm_head_us == (500.0 if lm_head else 0.0)
    assert att.names["kqv"] == [GEMM_B] and att.names["ug"] == [GEMM_A]
    assert att.names["attn_decode"] == ["_decode_merge_kernel", "_decode_partial_kernel"]


def test_a_trace_that_is_not_the_model_is_refused_with_the_reason():
    trace = forward(3)
    msg = attribute(trace[:-3], 3)  # the last layer's d lost
    assert isinstance(msg, str) and "11 GEMM kernels" in msg and "expected 12" in msg
    assert isinstance(attribute(trace, 4), str)


def test_kernel_kinds():
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kind_of("_persistent_gemm_kernel") == "gemm"
    assert kind_of("decode_bulk") == "attn_decode"
    assert kind_of("_rows_fp8_kernel") == "rows_fp8"  # act or o's quantisation, by place


def test_the_fp8_row_kernel_is_act_after_ug_and_o_before_o():
    names = ["gemm_kqv", "rope", "decode", "_rows_fp8_kernel", "gemm_o", "rms_norm",
             "gemm_ug", "_rows_fp8_kernel", "gemm_d", "rms_norm"]
    trace = [TracedKernel(n, float(i), 1.0 + i) for i, n in enumerate(names)]
    att = attribute(trace, 1)
    assert not isinstance(att, str)
    assert att.per_layer[0]["o"] == 4.0 + 5.0 and att.per_layer[0]["act"] == 8.0
    assert kind_of("void at::native::elementwise_kernel<128, 4>") == "other"


def test_the_gaps_between_the_layers_kernels_leave_out_the_embedding_and_lm_head():
    """What a forward spends between its kernels (bench/engine/engine_ops.py): from the first
    layer's first GEMM to the last layer's last kernel, the LM head and embedding outside it."""
    from bench.engine.kernel_trace import layer_gaps

    idle, count = layer_gaps(forward(3, lm_head=True, shuffle=True), 3)
    assert count == 3 * len(LAYER)
    assert idle == pytest.approx(count - 1)  # 1 us between consecutive kernels
    assert layer_gaps([], 3) == (0.0, 0)
