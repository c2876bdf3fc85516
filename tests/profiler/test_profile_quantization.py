"""`nanosched profile --quantization fp8`: the profiler times the model's W8A8 GEMMs (and the
kernels that write their e4m3 inputs), the fake GPU prices them, the profile records the
quantization (absent for none, so older profiles keep their digest), resume and the
compatibility check hold it, `profile show` prints it."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nanosched.cli import app
from nanosched.errors import ConfigError, ProfileError
from nanosched.kernels import reference as ref
from nanosched.models.model import CausalLM
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.profiler import impl_registry
from nanosched.profiler.backend import Unsupported
from nanosched.profiler.fake import FP8_GEMM_SPEEDUP, FakeBackend
from nanosched.profiler.format import Profile, check_profile_for, load_profile
from nanosched.profiler.plan import FP8_GEMM_IMPLS, ProfileSettings
from nanosched.profiler.runner import ProfileInterrupted, RunOptions, run_profile
from nanosched.profiler.show import show_profile
from nanosched.workloads import fixed

TINY = ModelSpec("tiny", "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=96, vocab_size=100)
TINY_MOE = ModelSpec("tiny-moe", "mixtral", hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=100,
                     num_experts=4, num_experts_per_tok=2)
SPEC = load_spec("llama3-8b")
WEIGHTS = {"kqv": "w_qkv", "o": "w_o", "ug": "w_gate_up", "d": "w_down"}


def call(spec: ModelSpec, op: str, ws: impl_registry.ScratchSpace, quantization: str = "fp8"):
    return impl_registry.OpCall(spec, 1, op, 24, 40, 3, "full", 8, ws, max_tokens=32,
                                quantization=quantization)


def run(tmp_path: Path, backend: FakeBackend, quantization: str, resume: bool = False,
        name: str = "p.json") -> Profile:
    s = ProfileSettings(SPEC, 1, fixed(1024, 512), 1024, True, quantization=quantization)
    return run_profile(s, backend, RunOptions(tmp_path / name, resume, progress=False,
                                              log=lambda _: None))


@pytest.mark.parametrize("op", ["kqv", "o", "ug", "d"])
def test_fp8_gemm_rows_are_the_models_w8a8_gemm(op):
    ws = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32)
    impl_registry.get(op, "cublas").kernel(call(TINY, op, ws)).fn()
    c = ws.cache
    x8, xs, w8, w_scale = c["x8_" + op][:24], c["xs_" + op][:24], c["w8_" + op], c["ws_" + op]
    # the weight and its scales have the dtype and shape of the FP8 model's layer weight
    layer = CausalLM(TINY, quantization="fp8").layers[0]
    weight = getattr(layer, WEIGHTS[op])
    assert (w8.dtype, w8.shape) == (weight.dtype, weight.shape) == (torch.float8_e4m3fn,
                                                                    w8.shape)
    assert w_scale.shape == getattr(layer, WEIGHTS[op] + "_scale").shape
    assert x8.dtype == torch.float8_e4m3fn and bool((xs > 0).all())
    if op == "o":  # its input rows were quantised first, from the attention output
        q, s = ref.quantize_fp8(c["x_o"][:24])
        assert torch.equal(x8.float(), q.float()) and torch.equal(xs, s)
    want = torch.empty_like(c["y_" + op][:24])
    ref.linear_fp8(x8, xs, w8, w_scale, None, want)
    torch.testing.assert_close(c["y_" + op][:24], want)
    assert "w_" + op not in c  # no bf16 weight was timed
    # the persistent Triton GEMMs have no FP8 kernel: refused, not timed as something else
    with pytest.raises(Unsupported, match="no FP8 GEMM"):
        impl_registry.get(op, "triton_persistent_128x128").kernel(call(TINY, op, ws))


def test_fp8_norms_and_act_write_the_e4m3_inputs_of_the_gemms_after_them():
    ws = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32)
    for op in ("add_norm_attn", "add_norm_ffn", "act"):
        impl_registry.get(op, "torch").kernel(call(TINY, op, ws)).fn()
    assert ws.cache["y_norm8"].dtype == torch.float8_e4m3fn
    assert ws.cache["act_out8"].dtype == torch.float8_e4m3fn
    q, s = ref.quantize_fp8(torch.nn.functional.silu(ws.cache["gate_up"][:24, :96])
                            * ws.cache["gate_up"][:24, 96:])
    torch.testing.assert_close(ws.cache["act_out8"][:24].float() * ws.cache["act_scale"][:24,
                               None], q.float() * s[:, None])
    assert "y_norm" not in ws.cache and "act_out" not in ws.cache
    # unquantised rows, and a MoE's FFN norm (its router reads the rows in the model dtype;
    # experts_ug quantises them) write model-dtype rows; a MoE's act writes e4m3 rows
    plain = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32)
    impl_registry.get("add_norm_ffn", "torch").kernel(
        call(TINY, "add_norm_ffn", plain, "none")).fn()
    impl_registry.get("add_norm_ffn", "torch").kernel(call(TINY_MOE, "add_norm_ffn", ws)).fn()
    assert plain.cache["y_norm"].dtype == torch.float32 and "y_norm8" not in plain.cache
    assert ws.cache["y_norm"].dtype == torch.float32
    moe = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32)
    impl_registry.get("act", "torch").kernel(call(TINY_MOE, "act", moe)).fn()
    assert moe.cache["act_out8"].dtype == torch.float8_e4m3fn and "act_out" not in moe.cache


@pytest.mark.parametrize("op", ["experts_ug", "experts_d"])
def test_fp8_experts_rows_time_the_w8a8_grouped_gemm(op):
    """Under fp8 a MoE's grouped GEMM rows run the e4m3 experts (`experts_ug` with its normed
    rows quantised first and gathered per token, as models/moe.py runs it), computing the
    exact emulation; no model-dtype expert weight is timed."""
    ws = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32)
    kernel = impl_registry.get(op, "torch").kernel(call(TINY_MOE, op, ws))
    kernel.fn()
    c = ws.cache
    w8, w_scale = c["w8_" + op], c["ws_" + op]
    assert w8.dtype == torch.float8_e4m3fn and w8.shape[0] == TINY_MOE.num_experts
    assert "w_" + op not in c
    top, rows = TINY_MOE.num_experts_per_tok, 24 * TINY_MOE.num_experts_per_tok
    ids = torch.arange(rows) % TINY_MOE.num_experts
    want = torch.empty_like(c["y_" + op])
    if op == "experts_ug":
        q, s = ref.quantize_fp8(c["x_experts_ug"])
        assert torch.equal(c["x8_experts_ug"].float(), q.float())
        x_rows = torch.arange(24).repeat_interleave(top)
    else:
        x_rows = None
    ref.grouped_linear_fp8(c["x8_" + op], c["xs_" + op], w8, w_scale.view(w8.shape[:2]), ids,
                           x_rows, want)
    torch.testing.assert_close(c["y_" + op], want)


def test_fake_fp8_profile_prices_fp8_gemms_and_records_the_quantization(tmp_path):
    bf16 = run(tmp_path, FakeBackend(), "none", name="bf16.json")
    fp8 = run(tmp_path, FakeBackend(), "fp8", name="fp8.json")
    assert (bf16.quantization, fp8.quantization) == ("none", "fp8")
    assert load_profile(tmp_path / "fp8.json").quantization == "fp8"
    assert "quantization" not in json.loads((tmp_path / "bf16.json").read_text())
    for op in ("kqv", "ug", "d"):  # compute-bound at 1,024 rows: near the FP8 GEMM's rate
        ratio = bf16.kernel_time_us(op, 1024) / fp8.kernel_time_us(op, 1024)
        assert 1.5 < ratio <= FP8_GEMM_SPEEDUP, (op, ratio)
    # `o` carries its input's quantisation pass; attention is untouched
    assert 1.0 < bf16.kernel_time_us("o", 1024) / fp8.kernel_time_us("o", 1024) < 1.5
    assert fp8.kernel_time_us("attn_decode", 256, context=1024) == \
        bf16.kernel_time_us("attn_decode", 256, context=1024)
    gemm_impls = {k.impl for k in fp8.kernels if k.op in WEIGHTS}
    assert gemm_impls == set(FP8_GEMM_IMPLS)
    assert {p.compute_impl for p in fp8.pairs} <= set(FP8_GEMM_IMPLS) and fp8.pairs
    assert any("triton_persistent_128x128 not measured: no FP8 GEMM" in n for n in fp8.notes)
    assert fp8.ceilings.gemm_tflops_8192 == pytest.approx(
        FP8_GEMM_SPEEDUP * bf16.ceilings.gemm_tflops_8192)
    assert fp8.digest() != bf16.digest()


def test_profiles_without_the_field_load_as_none_and_keep_their_digest():
    from nanosched.profiler.catalog import SHIPPED

    path = SHIPPED / "llama3-8b-tp1-h100-fp8.json"  # an FP8 KV cache, unquantised weights
    data = json.loads(path.read_text())
    assert "quantization" not in data
    prof = Profile.from_json(data)
    assert prof.quantization == "none" and prof.to_json() == data
    with pytest.raises(ProfileError, match=r"measured on 'none' weights, not --quantization "
                                           r"fp8: pass --quantization none"):
        check_profile_for(prof, prof.model, 1, kv_dtype="fp8", quantization="fp8")
    check_profile_for(prof, prof.model, 1, kv_dtype="fp8", quantization="none")
    with pytest.raises(ProfileError, match="quantization must be one of"):
        Profile.from_json({**data, "quantization": "int4"})


def test_resume_refuses_a_partial_of_other_weights(tmp_path):
    with pytest.raises(ProfileInterrupted):
        run(tmp_path, FakeBackend(interrupt_after=5), "none")
    with pytest.raises(ProfileError, match="quantization='none', this run has "
                                           "quantization='fp8'"):
        run(tmp_path, FakeBackend(), "fp8", resume=True)
    # a partial written before the field existed is an unquantised run
    partial = tmp_path / "p.partial.json"
    data = json.loads(partial.read_text())
    del data["settings"]["quantization"]
    partial.write_text(json.dumps(data))
    assert run(tmp_path, FakeBackend(), "none", resume=True).quantization == "none"


def test_settings_refuse_an_unknown_quantization():
    with pytest.raises(ConfigError, match=r"--quantization 'auto' is not one of"):
        ProfileSettings(SPEC, 1, fixed(1024, 512), 256, quantization="auto")


def test_cli_profiles_fp8_on_the_fake_gpu_and_show_prints_it(tmp_path):
    out = tmp_path / "q.json"
    res = CliRunner().invoke(app, ["profile", "--fake-gpu", "--model", "llama3-8b", "--quick",
                                   "--dense-batch", "256", "--quantization", "fp8",
                                   "--no-progress", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "FP8 weights (W8A8)" in res.output
    prof = load_profile(out)
    assert prof.quantization == "fp8"
    lines: list[str] = []
    show_profile(prof, echo=lines.append)
    assert "FP8 weights (W8A8" in lines[0] and lines[1].startswith("ceilings: FP8 GEMM")
    bad = CliRunner().invoke(app, ["profile", "--fake-gpu", "--model", "llama3-8b",
                                   "--quantization", "int8", "--out", str(tmp_path / "x.json")])
    assert bad.exit_code == 2
    assert "--quantization must be one of none, fp8; got 'int8'" in bad.output


def test_an_fp8_layers_gemms_read_the_e4m3_rows_the_op_before_wrote():
    """The forward table's layer under fp8: kqv and ug read the norm's e4m3 rows and scales,
    d reads act's, o quantises the attention output (impl_registry.layer_kernels' aliases)."""
    from nanosched.models.ops import layer_ops

    ws = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32)
    calls = [(call(TINY, op.name, ws), "cublas" if op.name in WEIGHTS else "torch")
             for op in layer_ops(TINY)]
    kernels = impl_registry.layer_kernels(calls)
    for kern in kernels:
        kern.fn()
    c = ws.cache
    f8 = torch.float8_e4m3fn
    assert ws.tensor("x8_kqv", (32, 64), dtype=f8).data_ptr() == c["y_norm8"].data_ptr()
    assert ws.tensor("xs_ug", (32,), dtype=torch.float32).data_ptr() == \
        c["y_norm_scale"].data_ptr()
    assert ws.tensor("x8_d", (32, 96), dtype=f8).data_ptr() == c["act_out8"].data_ptr()
    assert ws.tensor("x_o", (32, 64)).data_ptr() == c["y_decode"].data_ptr()
    kernels[0].fn()  # kqv again, on the e4m3 rows the norm at the end of the layer wrote
    want = torch.empty_like(c["y_kqv"][:24])
    ref.linear_fp8(c["y_norm8"][:24], c["y_norm_scale"][:24], c["w8_kqv"], c["ws_kqv"], None,
                   want)
    torch.testing.assert_close(c["y_kqv"][:24], want)


def test_the_default_dense_batch_counts_the_e4m3_weights():
    from nanosched.profiler.command import dense_batch_for

    wl = fixed(1024, 512)
    small = 28 << 30  # llama3-8b's bf16 weights fill most of it: fp8 leaves room for more
    assert dense_batch_for(SPEC, 1, wl, small, "fp8") > dense_batch_for(SPEC, 1, wl, small)


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")
def test_fp8_rows_of_every_available_impl_match_their_torch_twins():
    """Under fp8 each op's available implementations (the Triton norms and act writing e4m3
    rows, the GEMMs of FP8_GEMM_IMPLS) compute what the torch twin does."""
    from nanosched.models.ops import layer_ops
    from nanosched.profiler.plan import quantized_impls

    ops = ["kqv", "o", "ug", "d", "add_norm_attn", "add_norm_ffn", "act"]
    table, _ = quantized_impls(ProfileSettings(SPEC, 1, fixed(1024, 512), 256,
                                               quantization="fp8"),
                                impl_registry.available(ops)[0])
    assert {i.name for i in table["ug"]} <= set(FP8_GEMM_IMPLS)
    assert {i.name for i in table["act"]} == {"triton", "torch"}
    ws = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32)
    for op in (o.name for o in layer_ops(TINY) if o.name in ops):
        outputs = {}
        for name in [i.name for i in table[op]]:
            impl_registry.get(op, name).kernel(call(TINY, op, ws))  # fill the workspace
            impl_registry.get(op, name).kernel(call(TINY, op, ws)).fn()
            outputs[name] = {k: v[:24].float().clone() for k, v in ws.cache.items()
                             if k.startswith("y_") or k in ("act_out8", "act_scale")}
        first, *rest = outputs.values()
        assert first, op
        for other in rest:
            for key, want in first.items():
                if key.endswith("8"):  # e4m3: equal but for the interpreter's rounding quirk
                    g, w = other[key], want  # (tests/models/test_fp8_weights.py says which)
                    carried = ((w.abs().log2() % 1 == 0) & (g == w / 2)) | (
                        (g.abs().log2() % 1 == 0) & (w == g / 2)) | (
                        (g - w).abs() <= 2 ** -9)  # a step of e4m3's subnormals
                    assert not ((g != w) & ~carried).any(), f"{op} {key}"
                else:
                    torch.testing.assert_close(other[key], want, rtol=1e-3, atol=1e-3,
                                               msg=f"{op} {key}")
