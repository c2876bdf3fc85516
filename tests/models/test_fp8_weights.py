"""FP8 weights (W8A8, models/quant.py) on the CPU: the GEMM's exact emulation, the producers'
Triton kernels against the references (TRITON_INTERPRET=1), a model's forward against the same
model in its own dtype, random weights made in e4m3, a plain checkpoint quantised as it loads,
and `--quantization` resolved and refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_models import make_hf

from nanosched.errors import ConfigError
from nanosched.kernels import dispatch as K
from nanosched.kernels import reference as ref
from nanosched.models.model import CausalLM
from nanosched.models.quant import FP8_DTYPE, resolve_quantization
from nanosched.models.weights import init_random

interpret = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not K.triton_available(),
    reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
TRITON = K.KernelOptions(backend="triton")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def assert_e4m3_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every e4m3 element equal, but where Triton's interpreter rounds up across a power of
    two: it does not carry the mantissa into the exponent and writes half the value (2^k / 2
    for 2^k). The GPU's conversion (cvt.rn) carries; tests/gpu/test_fp8_gpu.py checks it."""
    g, w = got.float(), want.float()
    differ = g != w
    carried = (w.abs().log2() % 1 == 0) & (g == w / 2)
    assert not (differ & ~carried).any(), (g[differ & ~carried][:5], w[differ & ~carried][:5])
    assert differ.float().mean() < 0.3


def test_emulated_gemm_is_scaled_integer_products():
    gen = torch.Generator().manual_seed(0)
    x8, xs = ref.quantize_fp8(torch.randn(5, 32, generator=gen))
    w8, ws = ref.quantize_fp8(torch.randn(7, 32, generator=gen))
    out = torch.empty(5, 7)
    ref.linear_fp8(x8, xs, w8, ws, None, out)
    want = (x8.double() @ w8.double().t()) * xs.double()[:, None] * ws.double()[None, :]
    assert rel_err(out, want) < 1e-6
    # against the unquantised product: e4m3's 3 mantissa bits, about 2-4% relative
    x, w = ref.dequantize(x8, xs), ref.dequantize(w8, ws)
    assert rel_err(out, x @ w.t()) < 1e-6
    exact = torch.randn(5, 32, generator=gen)
    x8, xs = ref.quantize_fp8(exact)
    assert 0.005 < rel_err(ref.dequantize(x8, xs), exact) < 0.05


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_producer_kernels_write_the_references_e4m3(dtype):
    gen = torch.Generator().manual_seed(1)
    n, d, inter = 9, 64, 48
    x, r = torch.randn(n, d, generator=gen).to(dtype), torch.randn(n, d, generator=gen).to(dtype)
    w = torch.randn(d, generator=gen).to(dtype)
    outs = [(torch.empty(n, d, dtype=FP8_DTYPE), torch.empty(n)) for _ in range(2)]
    res = [torch.empty(n, d, dtype=dtype) for _ in range(2)]
    ref.rms_norm_add(x, r, w, 1e-6, outs[0][0], res[0], outs[0][1])
    K.rms_norm_add(x, r, w, 1e-6, outs[1][0], res[1], TRITON, {"max_ctas": 4},
                   out_scale=outs[1][1])
    torch.testing.assert_close(res[1], res[0])
    torch.testing.assert_close(outs[1][1], outs[0][1])
    assert_e4m3_equal(outs[1][0], outs[0][0])

    gu = torch.randn(n, 2 * inter, generator=gen).to(dtype)
    outs = [(torch.empty(n, inter, dtype=FP8_DTYPE), torch.empty(n)) for _ in range(2)]
    ref.silu_mul(gu, *outs[0])
    K.silu_mul(gu, outs[1][0], TRITON, {"max_ctas": 2}, out_scale=outs[1][1])
    torch.testing.assert_close(outs[1][1], outs[0][1])
    assert_e4m3_equal(outs[1][0], outs[0][0])
    ref.quantize_rows(gu[:, :inter], *outs[0])
    K.quantize_rows(gu[:, :inter], outs[1][0], outs[1][1], TRITON)
    torch.testing.assert_close(outs[1][1], outs[0][1])
    assert_e4m3_equal(outs[1][0], outs[0][0])


def _forward(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    ws = model.new_workspace(len(ids), 16)
    meta = ws.kv.plan([(0, len(ids), False)])
    ws.token_ids[:len(ids)].copy_(ids)
    return model.forward(ws, meta)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_fp8_model_close_to_its_own_dtype(tmp_path, arch):
    """Random weights: the e4m3 model's logits within 10% (relative L2) of the fp32 model's
    built from the same seed; MoE experts stay in the model dtype."""
    make_hf(arch, tmp_path, seed=0)
    folder = tmp_path
    from nanosched.models.spec import load_spec

    spec = load_spec(str(folder))
    ids = torch.randint(0, spec.vocab_size, (24,), generator=torch.Generator().manual_seed(2))
    models = {q: CausalLM(spec, quantization=q) for q in ("none", "fp8")}
    for m in models.values():
        init_random(m, seed=4)
    layer = models["fp8"].layers[0]
    assert layer.w_qkv.dtype == FP8_DTYPE and layer.w_o.dtype == FP8_DTYPE
    assert (layer.w_gate_up.dtype == FP8_DTYPE) == (arch != "mixtral")
    a, b = _forward(models["fp8"], ids), _forward(models["none"], ids)
    assert rel_err(a, b) < 0.1
    # the e4m3 weights are the fp32 ones quantised: dequantised, within e4m3's rounding
    w = models["none"].layers[1].w_o
    assert rel_err(ref.dequantize(models["fp8"].layers[1].w_o, models["fp8"].layers[1].w_o_scale),
                   w) < 0.05


def test_plain_checkpoint_quantised_as_it_loads(tmp_path):
    from nanosched.models.checkpoint import load_checkpoint
    from nanosched.models.spec import load_spec

    make_hf("llama", tmp_path, seed=0)
    folder = tmp_path
    spec = load_spec(str(folder))
    plain, fp8 = CausalLM(spec), CausalLM(spec, quantization="fp8")
    load_checkpoint(plain, folder)
    load_checkpoint(fp8, folder)
    for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
        got = ref.dequantize(getattr(fp8.layers[0], name), getattr(fp8.layers[0], name + "_scale"))
        assert rel_err(got, getattr(plain.layers[0], name)) < 0.05, name
    torch.testing.assert_close(fp8.embed_tokens, plain.embed_tokens)


def test_quantization_resolved_and_refused(tmp_path):
    assert resolve_quantization("auto", "random") == "none"
    assert resolve_quantization("fp8", "random") == "fp8"
    with pytest.raises(ConfigError, match=r"--quantization must be one of auto, none, fp8; "
                                          r"got 'int4'"):
        resolve_quantization("int4", "random")
    make_hf("llama", tmp_path, seed=0)
    folder = tmp_path
    assert resolve_quantization("auto", str(folder)) == "none"
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"'quantization_config.quant_method' is 'awq'"):
        resolve_quantization("auto", str(folder))
    config["quantization_config"] = {"quant_method": "fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    assert resolve_quantization("auto", str(folder)) == "fp8"
    with pytest.raises(ConfigError, match=r"--quantization none cannot serve it"):
        resolve_quantization("none", str(folder))
