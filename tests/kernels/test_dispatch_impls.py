"""Implementation names and launch dicts: dispatch honours `impl`, refuses bad names and keys,
and what the runtime's LaunchConfig hands each op is accepted by every op of a model.

Triton runs in the interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU) in
fp32 at tiny shapes; the torch path is the reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from nanosched.errors import ConfigError
from nanosched.kernels import dispatch as K
from nanosched.kernels import impls
from nanosched.models.model import CausalLM
from nanosched.models.spec import ModelSpec
from nanosched.models.weights import init_random
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.program import DEFAULT_LAUNCH, LaunchConfig

needs_interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                     reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")
TORCH = K.KernelOptions("torch")
LLAMA = ModelSpec("tiny", "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=96, vocab_size=50, max_position_embeddings=64)
MIXTRAL = ModelSpec("tiny-moe", "mixtral", hidden_size=64, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=50,
                    max_position_embeddings=64, num_experts=4, num_experts_per_tok=2)


def test_names_parse_and_bad_names_are_refused_with_the_known_ones():
    assert impls.parse_gemm("triton_persistent_64x256") == impls.GemmImpl("triton_persistent",
                                                                          64, 256)
    assert impls.parse_gemm("cublaslt") == impls.GemmImpl("cublaslt")
    with pytest.raises(ConfigError, match=r"'triton_persistent_100x128' is unknown; known: "
                                          r"cublas, cublaslt, triton_narrow, "
                                          r"triton_persistent_<BM>x<BN>"):
        impls.parse_gemm("triton_persistent_100x128")
    with pytest.raises(ConfigError, match=r"'triton' is unknown for op 'kqv'; known: cublas"):
        impls.check_op_impl("kqv", "triton")
    with pytest.raises(ConfigError, match=r"'cublas' is unknown for op 'act'; known: triton, "
                                          r"torch"):
        impls.check_op_impl("act", "cublas")
    with pytest.raises(ConfigError, match=r"op 'rope' has no implementations"):
        impls.check_op_impl("rope", "torch")
    with pytest.raises(ConfigError, match=r"'torch' is unknown for op 'ar_ffn'; known: nccl"):
        impls.check_op_impl("ar_ffn", "torch")
    assert impls.check_op_impl("ar_attn", "nccl_ctas8") == "nccl_ctas8"
    assert impls.network_impl("copy_engine_ctas16", 4) == ("copy_engine", 16)
    assert impls.network_impl("copy_engine", 4) == ("copy_engine", 4)
    assert impls.network_impl(None) == ("nccl", None)
    with pytest.raises(ConfigError, match=r"network implementation 'nccl_ctas0' is unknown"):
        impls.network_impl("nccl_ctas0")
    assert impls.grid_bound(None, 5, 3) == 15
    assert impls.grid_bound(7, 5, 3) == 7 and impls.grid_bound(None, None, 3) is None
    with pytest.raises(ConfigError, match=r"decode implementation 'triton_fast' is not one of"):
        K.KernelOptions(decode_impl="triton_fast")


def test_dispatch_rejects_wrong_impls_and_launch_keys():
    x, w, out = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    with pytest.raises(ConfigError, match=r"implementation 'triton_paged' is unknown for gemm"):
        K.linear(x, w, None, out, TORCH, {"impl": "triton_paged"})
    with pytest.raises(ConfigError, match=r"launch key\(s\) \['block_m'\] not allowed"):
        K.linear(x, w, None, out, TORCH, {"num_sms": 4, "block_m": 64})
    with pytest.raises(ConfigError, match=r"launch num_sms=0 must be a positive integer"):
        K.linear(x, w, None, out, TORCH, {"num_sms": 0})
    with pytest.raises(ConfigError, match=r"'cublas' is unknown for prefill; known: triton, "
                                          r"torch"):
        K.prefill_attention(x, x, x, x, [], 1.0, out, TORCH, {"impl": "cublas"})
    with pytest.raises(ConfigError, match=r"gemm implementation 'cutlass' is not one of"):
        K.KernelOptions(gemm="cutlass")
    assert K.KernelOptions(gemm="triton").gemm_impl == "triton_persistent_128x128"
    assert K.KernelOptions(gemm="cublaslt").gemm_impl == "cublaslt"


@needs_interpret
def test_linear_honours_impl():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(37, 40, generator=gen), torch.randn(50, 40, generator=gen), None
    want = x @ w.T
    for launch in ({"impl": "cublas"}, {"impl": "cublaslt", "num_sms": 2},
                   {"impl": "triton_persistent_16x32", "num_sms": 3, "max_ctas": 9},
                   {"impl": "triton_persistent_32x16"}):
        out = torch.full_like(want, float("nan"))
        K.linear(x, w, b, out, TORCH, launch)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=str(launch))


@needs_interpret
def test_decode_attention_honours_impl_and_its_bounds():
    gen = torch.Generator().manual_seed(1)
    pages, page, hkv, d = 15, 16, 2, 16
    kc, vc = (torch.randn(pages, page, hkv, d, generator=gen) for _ in range(2))
    lens = torch.tensor([5, 40, 70], dtype=torch.int32)
    tables = torch.randperm(pages, generator=gen).view(3, 5).int()  # 5 pages hold 70 tokens
    q = torch.randn(3, 4 * hkv, d, generator=gen)
    want = torch.empty_like(q)
    K.decode_attention(q, kc, vc, tables, lens, 70, d ** -0.5, want, TORCH, {"impl": "torch"})
    for launch in ({"impl": "triton_paged", "max_ctas": 2, "num_splits": 3},
                   {"impl": "triton_paged", "num_sms": 1}, {"impl": "triton_paged"},
                   {"impl": "triton_pipelined", "max_ctas": 3, "num_splits": 2},
                   {"impl": "triton_pipelined", "num_sms": 1}):
        got = torch.full_like(q, float("nan"))
        K.decode_attention(q, kc, vc, tables, lens, 70, d ** -0.5, got, TORCH, launch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(launch))


@needs_interpret
def test_elementwise_ops_honour_impl_over_the_options():
    gen = torch.Generator().manual_seed(2)
    x, r = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    weight = torch.rand(48, generator=gen) + 0.5
    outs = []
    for impl in ("torch", "triton"):
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        K.rms_norm_add(x, r, weight, 1e-6, out, res_out, TORCH, {"impl": impl, "num_sms": 8})
        act = torch.empty(5, 24)
        K.silu_mul(x, act, TORCH, {"impl": impl})
        outs.append((out, res_out, act))
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)



def test_elementwise_bound_is_max_ctas_else_programs_per_sm():
    args = impls.read_launch
    per_sm = impls.ELEMENTWISE_CTAS_PER_SM
    assert set(per_sm) == {"rms_norm_add", "silu_mul", "rope_append"}
    for kernel, k in per_sm.items():
        assert impls.elementwise_ctas(args(None), kernel) is None  # one program per item
        assert impls.elementwise_ctas(args({"impl": "triton", "num_sms": 16}), kernel) == 16 * k
        assert impls.elementwise_ctas(args({"num_sms": 16, "partition": True}), kernel) == 16 * k
        assert impls.elementwise_ctas(args({"num_sms": 16, "max_ctas": 3}), kernel) == 3
    with pytest.raises(ConfigError, match=r"launch max_ctas=0 must be a positive integer"):
        K.silu_mul(torch.randn(2, 8), torch.empty(2, 4), TORCH, {"impl": "triton", "max_ctas": 0})


def elementwise_grids(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Programs of every elementwise Triton launch from here on, per kernel."""
    from nanosched.kernels import elementwise

    grids: dict[str, list[int]] = {}
    for name in ("_rms_norm_add_kernel", "_silu_mul_kernel", "_rope_append_kernel"):
        kernel, log = getattr(elementwise, name), grids.setdefault(name, [])

        class Launcher:
            def __getitem__(self, grid, kernel=kernel, log=log):
                log.append(grid[0])
                return kernel[grid]

        monkeypatch.setattr(elementwise, name, Launcher())
    return grids


@needs_interpret
def test_elementwise_launch_bounds_reach_the_kernels(monkeypatch):
    """max_ctas, else num_sms x the kernel's programs per SM, bound the grid; the result is the
    torch reference's whatever the bound."""
    gen = torch.Generator().manual_seed(5)
    x, r = torch.randn(9, 48, generator=gen), torch.randn(9, 48, generator=gen)
    weight = torch.rand(48, generator=gen) + 0.5
    want = [torch.empty_like(x), torch.empty_like(x), torch.empty(9, 24)]
    K.rms_norm_add(x, r, weight, 1e-6, want[0], want[1], TORCH, {"impl": "torch"})
    K.silu_mul(x, want[2], TORCH, {"impl": "torch"})
    grids = elementwise_grids(monkeypatch)
    launches = [{"impl": "triton", "max_ctas": 3}, {"impl": "triton", "num_sms": 1},
                {"impl": "triton", "num_sms": 1, "partition": True}, {"impl": "triton"},
                {"impl": "triton", "num_sms": 1, "max_ctas": 2}]
    for launch in launches:
        got = [torch.empty_like(x), torch.empty_like(x), torch.empty(9, 24)]
        K.rms_norm_add(x, r, weight, 1e-6, got[0], got[1], TORCH, launch)
        K.silu_mul(x, got[2], TORCH, launch)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=str(launch))
    per_sm = impls.ELEMENTWISE_CTAS_PER_SM
    assert grids["_rms_norm_add_kernel"] == [3, per_sm["rms_norm_add"], per_sm["rms_norm_add"],
                                             9, 2]
    assert grids["_silu_mul_kernel"] == [3, per_sm["silu_mul"], per_sm["silu_mul"], 9, 2]


def scheduled_op(op: str, mechanism: str, units: int):
    from nanosched.schedules.format import Alloc, NanoOp

    return NanoOp(f"{op}_0", op, "other", 0, 9, "memory", 0, 0, (),
                  Alloc(0.25, 0.5, mechanism, units, impl="triton"), 0.0, 1.0)


@needs_interpret
def test_a_schedules_allocation_bounds_the_elementwise_kernels_of_a_forward(monkeypatch):
    """A replayed nano-op's `cta_bound` CTAs, or green-context SMs, reach every elementwise
    kernel of the model's forward (rope_append, both norms, act), and the forward is unchanged."""
    from nanosched.runtime.strategies.replay import launch_config

    model = CausalLM(LLAMA)
    init_random(model, seed=3)
    want = run_forward(model, DEFAULT_LAUNCH)
    per_sm = impls.ELEMENTWISE_CTAS_PER_SM
    for mechanism, units, bound in (("cta_bound", 2, {k: 2 for k in per_sm}),
                                    ("green_ctx", 1, per_sm)):
        cfg = launch_config(scheduled_op("act", mechanism, units))
        grids = elementwise_grids(monkeypatch)
        got = run_forward(model, cfg)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=mechanism)
        for kernel, programs in bound.items():
            launched = grids[f"_{kernel}_kernel"]
            assert launched and max(launched) == programs, (mechanism, kernel, launched)


@needs_interpret
def test_prefill_attention_honours_impl_and_stays_torch_on_cpu(monkeypatch):
    from nanosched.kernels import prefill_attn
    from nanosched.kernels.common import PrefillSegments

    gen = torch.Generator().manual_seed(4)
    kc, vc = (torch.randn(6, 4, 1, 16, generator=gen) for _ in range(2))
    tables = torch.randperm(6, generator=gen).view(2, 3).int()  # 3 pages of 4 per segment
    segments = [(0, 7, 2), (7, 12, 0)]
    q = torch.randn(12, 2, 16, generator=gen)
    want = torch.empty_like(q)
    K.prefill_attention(q, kc, vc, tables, segments, 0.25, want, TORCH, {"impl": "torch"})
    cases = [(TORCH, {"impl": "triton", "num_sms": 2, "max_ctas": 3}, segments),
             (K.KernelOptions("triton"), None, segments),
             (TORCH, {"impl": "triton"}, PrefillSegments.build(segments, "cpu", 2)),
             (TORCH, None, PrefillSegments(PrefillSegments.build(segments, "cpu").table))]
    for opts, launch, segs in cases:
        got = torch.full_like(q, float("nan"))
        K.prefill_attention(q, kc, vc, tables, segs, 0.25, got, opts, launch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(launch))

    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton prefill kernel ran")

    monkeypatch.setattr(prefill_attn, "prefill_attention", no_triton)
    got = torch.full_like(q, float("nan"))
    K.prefill_attention(q, kc, vc, tables, segments, 0.25, got, K.KernelOptions(), None)
    torch.testing.assert_close(got, want)  # auto on CPU tensors: the torch reference
    with pytest.raises(ConfigError, match=r"'triton_paged' is unknown for prefill"):
        K.prefill_attention(q, kc, vc, tables, segments, 0.25, got, TORCH,
                            {"impl": "triton_paged"})


def test_grouped_programs_follow_the_launch_bounds():
    args = impls.read_launch
    assert impls.grouped_programs(args(None), 132) is None  # one program per tile
    assert impls.grouped_programs(args({"num_sms": 132}), 132) is None  # the whole GPU
    assert impls.grouped_programs(args({"num_sms": 100}), 132) == 100  # persistent
    assert impls.grouped_programs(args({"num_sms": 100, "partition": True}), 132) is None
    assert impls.grouped_programs(args({"num_sms": 100, "max_ctas": 16}), 132) == 16
    assert impls.grouped_programs(args({"num_sms": 132, "max_ctas": 200}), 132) == 200
    with pytest.raises(ConfigError, match=r"'cublas' is unknown for op 'experts_d'; known: "
                                          r"triton, triton_narrow, torch"):
        impls.check_op_impl("experts_d", "cublas")
    x, w, ids = torch.randn(4, 8), torch.randn(2, 6, 8), torch.tensor([0, 1, 1, 0])
    with pytest.raises(ConfigError, match=r"'cublas' is unknown for grouped"):
        K.grouped_linear(x, w, ids, None, torch.empty(4, 6), TORCH, {"impl": "cublas"})


@needs_interpret
def test_grouped_linear_honours_impl_and_its_bounds():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 40, generator=gen), torch.randn(3, 50, 40, generator=gen)
    ids = torch.tensor([2, 0, 2, 2, 0, 0, 2, 2, 0, 2, 2, 0, 2, 2, 0, 2, 2, 0])  # expert 1: none
    x_rows = torch.arange(9).repeat_interleave(2)
    want = torch.empty(18, 50)
    K.grouped_linear(x, w, ids, x_rows, want, TORCH, {"impl": "torch"})
    cases = [(TORCH, {"impl": "triton"}), (TORCH, {"impl": "triton", "num_sms": 2}),
             (TORCH, {"impl": "triton", "num_sms": 2, "max_ctas": 1}),
             (TORCH, {"impl": "triton", "num_sms": 2, "partition": True}),
             (K.KernelOptions("triton"), None)]
    for opts, launch in cases:
        got = torch.full_like(want, float("nan"))
        K.grouped_linear(x, w, ids, x_rows, got, opts, launch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(launch))

def test_launch_config_hands_each_op_only_what_applies():
    cfg = LaunchConfig(max_ctas=8, num_sms=2, impl="triton_persistent_16x32", num_splits=2)
    assert cfg.launch_dict("ug") == {"impl": "triton_persistent_16x32", "num_sms": 2,
                                     "max_ctas": 8, "num_splits": 2}
    assert cfg.launch_dict("act") == {"num_sms": 2, "max_ctas": 8, "num_splits": 2}
    per_op = LaunchConfig(impl={"act": "triton", "kqv": "cublaslt"})
    assert per_op.launch_dict("act") == {"impl": "triton"} and per_op.launch_dict("o") is None
    assert LaunchConfig(impl="torch").launch_dict("attn_decode") == {"impl": "torch"}
    assert DEFAULT_LAUNCH.launch_dict("kqv") is None
    with pytest.raises(ConfigError, match=r"implementation 'cuda_graph' is unknown; known: "
                                          r"gemm: cublas"):
        LaunchConfig(impl="cuda_graph")
    with pytest.raises(ConfigError, match=r"'triton' is unknown for op 'kqv'"):
        LaunchConfig(impl={"kqv": "triton"})


def run_forward(model: CausalLM, cfg: LaunchConfig) -> torch.Tensor:
    """One forward (1 decode + 8 prefill tokens) through the model's Program, every op under
    `cfg`; the final normed rows."""
    ws = model.new_workspace(16, 8)
    ws.kv.plan([(0, 6, False)])
    segments = [(0, 1, True), (1, 9, False)]
    meta = ws.kv.plan([(0, 1, True), (1, 8, False)])
    ws.kv.k.normal_(generator=torch.Generator().manual_seed(6))
    ws.kv.v.normal_(generator=torch.Generator().manual_seed(7))
    ws.token_ids[:9] = torch.arange(9) * 5
    program = model_program(model, ws, meta, segments)
    with torch.inference_mode():
        for op in program.ops:
            op.run(0, 9, cfg)
    return ws.normed[:9].clone()


@needs_interpret
@pytest.mark.parametrize("spec", [LLAMA, MIXTRAL])
def test_every_op_accepts_the_runtime_launch_dict(spec):
    model = CausalLM(spec)
    init_random(model, seed=3)
    want = run_forward(model, DEFAULT_LAUNCH)
    per_op = {"kqv": "cublaslt", "o": "triton_persistent_16x16", "ug": "cublas",
              "d": "triton_persistent_32x16", "attn_decode": "triton_paged",
              "rope_append": "triton", "add_norm_ffn": "triton", "add_norm_attn": "torch",
              "act": "triton", "attn_prefill": "torch", "experts_ug": "torch",
              "experts_d": "triton"}
    for cfg in (LaunchConfig(max_ctas=3, num_sms=2, impl="triton_persistent_16x32"),
                LaunchConfig(max_ctas=2, num_sms=3, impl="triton_paged", num_splits=2),
                LaunchConfig(num_sms=1, impl="triton"),
                LaunchConfig(max_ctas=5, num_sms=2, impl=per_op)):
        got = run_forward(model, cfg)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=str(cfg))


def test_sm_target_is_the_partition_itself_on_a_green_context():
    from nanosched.kernels import impls
    from nanosched.runtime.program import LaunchConfig

    whole = impls.read_launch(LaunchConfig(num_sms=100, impl="cublaslt").launch_dict("kqv"))
    assert impls.sm_target(whole) == 100
    part = impls.read_launch(LaunchConfig(num_sms=100, impl="cublaslt",
                                          partition=True).launch_dict("kqv"))
    assert part["partition"] is True and impls.sm_target(part) is None
    with pytest.raises(ConfigError, match="partition='yes' must be true or false"):
        impls.read_launch({"partition": "yes"})


def test_bind_device_gives_torch_an_index_for_a_bare_cuda_device(monkeypatch):
    """`--device cuda` has no index; torch.cuda.set_device refuses that (server thread bug)."""
    from nanosched.kernels.common import bind_device

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    bind_device(torch.device("cuda"))
    bind_device(torch.device("cuda", 1))
    bind_device(torch.device("cpu"))
    assert calls == [3, 1]


def test_the_default_decode_reads_an_fp8_cache_with_cuda_bulk_where_it_runs(monkeypatch):
    """`auto`: cuda_bulk for an FP8 cache when it can run the call, the Triton kernel for a bf16
    cache or where it cannot; a named implementation always wins; torch without Triton."""
    q, k, v = torch.zeros(2, 4, 8), torch.zeros(1, 16, 1, 8), torch.zeros(1, 16, 1, 8)
    scale = torch.ones(1, 16, 1)
    auto, named = K.KernelOptions("triton"), K.KernelOptions("triton", decode_impl="triton_paged")
    monkeypatch.setattr(K, "use_triton", lambda opts, x: True)
    monkeypatch.setattr(K, "_bulk_runs", lambda *a: True)
    assert K._default_decode(auto, q, k, v, scale, scale) == "cuda_bulk"
    assert K._default_decode(auto, q, k, v, None, None) == impls.DEFAULT_DECODE
    assert K._default_decode(named, q, k, v, scale, scale) == "triton_paged"
    monkeypatch.setattr(K, "_bulk_runs", lambda *a: False)
    assert K._default_decode(auto, q, k, v, scale, scale) == impls.DEFAULT_DECODE
    monkeypatch.setattr(K, "use_triton", lambda opts, x: False)
    assert K._default_decode(auto, q, k, v, scale, scale) == "torch"
    monkeypatch.undo()
    assert not K._bulk_runs(q, k, v, scale, scale)  # a CPU tensor: never the CUDA kernel


def test_a_cuda_bulk_that_cannot_be_built_here_is_warned_about_and_the_triton_kernel_runs(
        monkeypatch):
    """`auto` on an FP8 cache: a failed NVRTC build of cuda_bulk falls back to the Triton
    kernel with one warning that names the failure and the flag."""
    from nanosched.kernels import decode_attn_bulk as bulk

    q, k, v, scale = torch.zeros(2, 4, 8), torch.zeros(1, 16, 1, 8), torch.zeros(1, 16, 1, 8), \
        torch.ones(1, 16, 1)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
    monkeypatch.setattr(bulk, "missing_dependency", lambda: None)
    monkeypatch.setattr(bulk, "unsupported", lambda *a: None)
    monkeypatch.setattr(bulk, "build_error", lambda *a: None)
    assert K._bulk_runs(q, k, v, scale, scale)
    monkeypatch.setattr(bulk, "build_error", lambda *a: "CompileException: no sm_90a (test)")
    K._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match=r"could not be built here \(CompileException: no "
                                            r"sm_90a \(test\)\).*--decode-attention"):
        assert not K._bulk_runs(q, k, v, scale, scale)
    monkeypatch.setattr(bulk, "unsupported", lambda *a: "it needs 16-token pages")
    assert not K._bulk_runs(q, k, v, scale, scale)


def test_fp8_bias_epilogue_falls_back_to_an_add_where_cublaslt_refuses_it():
    from nanosched.kernels import dispatch

    calls = []
    out = torch.zeros(2, 3)
    bias = torch.tensor([1.0, 2.0, 3.0])

    def refusing(b):
        calls.append(b is not None)
        if b is not None:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling ...")
        out.fill_(10.0)

    key = (2, 3, 99991)
    dispatch._UNFUSED_BIAS.discard(key)
    dispatch.bias_epilogue_or_add(refusing, key, bias, out)
    assert calls == [True, False] and out[0].tolist() == [11.0, 12.0, 13.0]
    dispatch.bias_epilogue_or_add(refusing, key, bias, out)  # remembered: no second refusal
    assert calls == [True, False, False]
    dispatch._UNFUSED_BIAS.discard(key)

    def broken(b):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        dispatch.bias_epilogue_or_add(broken, key, bias, out)
    assert key not in dispatch._UNFUSED_BIAS
