"""FP8 weights (W8A8, models/quant.py) on the CPU: the GEMM's exact emulation, the producers'
Triton kernels against the references (TRITON_INTERPRET=1), a model's forward against the same
model in its own dtype, random weights made in e4m3, a plain checkpoint quantised as it loads,
and `--quantization` resolved and refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_models import FP8_FORMATS, make_hf, save_fp8

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


@interpret
def test_wide_rows_quantised_in_two_passes(monkeypatch):
    """A row wider than ROW_FP8_MAX_BLOCK is read twice (amax, then store) in chunks."""
    from nanosched.kernels import elementwise

    monkeypatch.setattr(elementwise, "ROW_FP8_MAX_BLOCK", 16)
    monkeypatch.setattr(elementwise, "SILU_BLOCK", 16)
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(5, 2 * 40, generator=gen)
    outs = [(torch.empty(5, 40, dtype=FP8_DTYPE), torch.empty(5)) for _ in range(2)]
    ref.silu_mul(gu, *outs[0])
    K.silu_mul(gu, outs[1][0], TRITON, out_scale=outs[1][1])
    torch.testing.assert_close(outs[1][1], outs[0][1])
    assert_e4m3_equal(outs[1][0], outs[0][0])


@interpret
def test_grouped_fp8_gemm_is_the_emulation():
    """The Triton W8A8 grouped GEMM (interpreter) equals `reference.grouped_linear_fp8`: the
    rows gathered by x_rows, each scaled by its own row's and its expert's channel's scale;
    both within e4m3's rounding of the unquantised grouped GEMM; missing scales refused."""
    from nanosched.errors import ConfigError
    from nanosched.kernels.grouped_gemm import GroupedGemmConfig, grouped_linear

    gen = torch.Generator().manual_seed(8)
    e, n, k, tokens, top = 4, 48, 64, 11, 2
    x, w = torch.randn(tokens, k, generator=gen), torch.randn(e, n, k, generator=gen) / 8
    x8, xs = ref.quantize_fp8(x)
    w8, wsc = ref.quantize_fp8(w)  # [E, N] scales
    ids = torch.randint(0, e, (tokens * top,), generator=gen)
    rows = torch.arange(tokens).repeat_interleave(top)
    want, got = torch.zeros(tokens * top, n), torch.zeros(tokens * top, n)
    ref.grouped_linear_fp8(x8, xs, w8, wsc, ids, rows, want)
    cfg = GroupedGemmConfig(block_m=16, block_n=16, block_k=32)
    grouped_linear(x8, w8, ids, rows, got, cfg, x_scale=xs, w_scale=wsc)
    assert rel_err(got, want) < 1e-6
    exact = torch.zeros(tokens * top, n)
    ref.grouped_linear(x, w, ids, rows, exact)
    assert 0.01 < rel_err(want, exact) < 0.06
    one = torch.zeros(tokens * top, n)  # row i of a dense [m, K] input: x_rows None
    ref.grouped_linear_fp8(x8[rows], xs[rows], w8, wsc, ids, None, one)
    torch.testing.assert_close(one, want, rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"x_scale \[11\] and w_scale None must both"):
        grouped_linear(x8, w8, ids, rows, got, cfg, x_scale=xs)


@interpret
def test_fp8_mixtral_on_the_triton_kernels_is_the_emulation(tmp_path):
    """A tiny e4m3 Mixtral through the Triton kernels (norms, SiLU·mul, row quantisation,
    grouped GEMMs; interpreter) near the logits of the torch path (the exact emulation): the
    interpreter's e4m3 rounding at powers of two (assert_e4m3_equal) moves them 5.0% here, as
    it moves a dense Llama's 5.3%; a misplaced scale moves them by their whole size."""
    from nanosched.models.spec import load_spec

    make_hf("mixtral", tmp_path, seed=3)
    spec = load_spec(str(tmp_path))
    ids = torch.randint(0, spec.vocab_size, (13,), generator=torch.Generator().manual_seed(4))
    models = [CausalLM(spec, quantization="fp8", kernels=K.KernelOptions(backend=b))
              for b in ("torch", "triton")]
    for m in models:
        init_random(m, seed=5)
    a, b = (_forward(m, ids) for m in models)
    assert rel_err(b, a) < 0.1


def _forward(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    ws = model.new_workspace(len(ids), 16)
    meta = ws.kv.plan([(0, len(ids), False)])
    ws.token_ids[:len(ids)].copy_(ids)
    return model.forward(ws, meta)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_fp8_model_close_to_its_own_dtype(tmp_path, arch):
    """Random weights: the e4m3 model's logits within 10% (relative L2) of the fp32 model's
    built from the same seed; MoE experts e4m3 too, with a scale per expert and row."""
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
    assert layer.w_gate_up.dtype == FP8_DTYPE and layer.w_down.dtype == FP8_DTYPE
    if arch == "mixtral":
        e, n = layer.w_gate_up.shape[:2]
        assert layer.w_gate_up_scale.shape == (e, n) and layer.router.dtype == torch.float32
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


def _checkpoint_model(folder, **kw) -> CausalLM:
    from nanosched.models.checkpoint import load_checkpoint
    from nanosched.models.spec import load_spec

    model = CausalLM(load_spec(str(folder)), **kw)
    load_checkpoint(model, folder)
    return model


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_fp8_checkpoints_load(tmp_path, fmt, arch):
    """Each format serves with `--quantization auto` close to the unquantised checkpoint;
    per-channel and per-tensor weights arrive as stored (no second rounding), Mixtral's
    experts too, each with its own row scales."""
    from safetensors.torch import load_file

    plain, fp8 = tmp_path / "plain", tmp_path / fmt
    make_hf(arch, plain, seed=5)
    make_hf(arch, fp8, seed=5)
    save_fp8(fp8, fmt)
    assert resolve_quantization("auto", str(fp8)) == "fp8"
    got = _checkpoint_model(fp8, quantization="fp8")
    want = _checkpoint_model(plain)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(6))
    # e4m3's rounding through two tiny layers: 6-10% measured (block scales, re-rounded per
    # row, at the top)
    assert rel_err(_forward(got, ids), _forward(want, ids)) < 0.15
    if fmt == "ct-channel" and arch == "llama":  # the scales quantising at load computes
        at_load = _checkpoint_model(plain, quantization="fp8")
        torch.testing.assert_close(_forward(got, ids), _forward(at_load, ids), rtol=0, atol=0)
    stored = load_file(fp8 / "model.safetensors")
    o = "model.layers.1.self_attn.o_proj"
    if fmt != "fp8-block":
        assert torch.equal(got.layers[1].w_o.view(torch.uint8),
                           stored[o + ".weight"].view(torch.uint8))
    assert rel_err(ref.dequantize(got.layers[1].w_o, got.layers[1].w_o_scale),
                   want.layers[1].w_o) < 0.05
    if arch == "mixtral":
        down = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
        assert got.layers[0].w_down.dtype == FP8_DTYPE
        if fmt != "fp8-block":
            assert torch.equal(got.layers[0].w_down[1].view(torch.uint8),
                               stored[down].view(torch.uint8))
        assert rel_err(ref.dequantize(got.layers[0].w_down, got.layers[0].w_down_scale),
                       want.layers[0].w_down) < 0.05


def test_fp8_checkpoint_refusals(tmp_path):
    from nanosched.models.checkpoint import load_checkpoint
    from nanosched.models.spec import load_spec

    folder = tmp_path / "m"
    make_hf("llama", folder, seed=5)
    save_fp8(folder, "ct-channel")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())

    def refused(change, match):
        qc = json.loads(json.dumps(config["quantization_config"]))
        change(qc)
        config_path.write_text(json.dumps(config | {"quantization_config": qc}))
        with pytest.raises(ConfigError, match=match):
            resolve_quantization("auto", str(folder))

    weights = ("config_groups", "group_0", "weights")

    def put(path, value):
        def change(qc):
            node = qc
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
        return change

    refused(put(weights, {"num_bits": 8, "type": "int", "strategy": "channel"}),
            r"'quantization_config.config_groups.group_0.weights' is 8-bit int; nanosched "
            r"runs 8-bit float")
    refused(put(weights, {"num_bits": 4, "type": "int", "strategy": "group"}),
            r"weights' is 4-bit int")
    refused(put(weights + ("strategy",), "group"),
            r"'quantization_config.config_groups.group_0.weights.strategy' is 'group'")
    refused(put(("format",), "pack-quantized"),
            r"'quantization_config.format' is 'pack-quantized'")
    refused(put(("config_groups", "group_0", "input_activations"),
                {"num_bits": 8, "type": "int"}), r"input_activations' is 8-bit int")
    config_path.write_text(json.dumps(config))
    # an e4m3 weight without its scale is named
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, folder / "model.safetensors")
    model = CausalLM(load_spec(str(folder)), quantization="fp8")
    with pytest.raises(ConfigError, match=r"'model.layers.0.mlp.up_proj.weight' is e4m3 but no "
                                          r"'model.layers.0.mlp.up_proj.weight_scale'"):
        load_checkpoint(model, folder)


def _fp8_rank(tp, folder: str) -> list[dict]:
    """Every rank's layer-0 e4m3 weights, their scales and the logits of a prefill batch."""
    torch.set_num_threads(1)
    from nanosched.models.checkpoint import load_checkpoint
    from nanosched.models.spec import load_spec

    model = CausalLM(load_spec(folder), tp=tp, quantization="fp8")
    load_checkpoint(model, folder)
    layer = model.layers[0]
    with torch.inference_mode():
        ws = model.new_workspace(16, 8)
        meta = ws.kv.plan([(0, 7, False), (1, 4, False)])
        ws.token_ids[:11] = torch.arange(11) * 13 % 250
        logits = model(ws, meta)
    mine = {"logits": logits.tolist()} | {
        n: (getattr(layer, n).view(torch.uint8).tolist(), getattr(layer, n + "_scale").tolist())
        for n in ("w_gate_up", "w_o", "w_down")}
    if tp.size == 1:
        return [mine]
    import torch.distributed as dist

    ranks = [None] * tp.size
    dist.all_gather_object(ranks, mine)
    return ranks


@pytest.mark.slow
def test_fp8_shards_at_tp2(tmp_path):
    """tp = 2 over gloo on a per-channel FP8 checkpoint: column-parallel shards split the row
    scales with the rows (w_gate_up: each rank's gate | up rows), row-parallel shards keep
    every row's scale whole and split the e4m3 columns; logits within e4m3's rounding of
    tp = 1 (the activations of o and d get their scales over each rank's columns)."""
    from nanosched.models.parallel import TensorParallel, launch

    make_hf("llama", tmp_path, seed=7)
    save_fp8(tmp_path, "ct-channel")
    one = _fp8_rank(TensorParallel(), str(tmp_path))[0]
    two = launch(_fp8_rank, 2, "gloo", str(tmp_path))
    inter = 64  # TINY intermediate 128 over two ranks
    for r, rank in enumerate(two):
        w, s = (torch.tensor(x) for x in one["w_gate_up"])
        rows = torch.cat([torch.arange(r * inter, (r + 1) * inter),
                          torch.arange(128 + r * inter, 128 + (r + 1) * inter)])
        assert torch.equal(torch.tensor(rank["w_gate_up"][0]), w[rows])
        assert torch.equal(torch.tensor(rank["w_gate_up"][1]), s[rows])
        for name, cols in (("w_o", 32), ("w_down", inter)):
            w, s = (torch.tensor(x) for x in one[name])
            assert torch.equal(torch.tensor(rank[name][1]), s)  # whole
            assert torch.equal(torch.tensor(rank[name][0]), w[:, r * cols:(r + 1) * cols])
    # two roundings of the activations, each e4m3 (~3%): 5.4% measured
    assert rel_err(torch.tensor(two[0]["logits"]), torch.tensor(one["logits"])) < 0.1


@pytest.mark.parametrize("cmd", ["bench", "generate", "serve"])
def test_quantization_flag_refused_in_one_line(cmd):
    from hostile import refused

    refused([cmd, "--model", "stories15m", "--quantization", "int4"],
            "--quantization must be one of auto, none, fp8; got 'int4'")


def test_fp8_bench_records_its_quantization(tmp_path):
    """`bench --quantization fp8` on the CPU (random weights, exactly emulated GEMMs): the
    record names the quantization and the GEMM precision."""
    from typer.testing import CliRunner

    from nanosched.cli import app

    out = tmp_path / "b.json"
    r = CliRunner().invoke(app, ["bench", "--model", "stories15m", "--input-len", "16",
                                 "--output-len", "4", "--num-prompts", "2", "--quantization",
                                 "fp8", "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["config"]["quantization"] == "fp8" and data["gemm_precision"] == "fp8"
    assert "(FP8 W8A8)" in r.output
    assert "weights: " in r.output and data["gpu_bytes_after_load"] is None  # no GPU here
    # the weights it held: the layer GEMMs at a byte an element, against the same model's own
    plain = tmp_path / "plain.json"
    r = CliRunner().invoke(app, ["bench", "--model", "stories15m", "--input-len", "16",
                                 "--output-len", "4", "--num-prompts", "2", "--quantization",
                                 "none", "--json", str(plain)])
    assert r.exit_code == 0, r.output
    own = json.loads(plain.read_text())["weight_bytes"]
    assert 0 < data["weight_bytes"] < 0.8 * own


def test_fp8_weights_refused_in_a_float16_model(tmp_path):
    """The rowwise FP8 GEMMs write bfloat16: a float16 model with fp8 weights is refused by the
    model itself (so `--quantization auto` resolving to fp8 is caught too)."""
    make_hf("llama", tmp_path, seed=0)
    from nanosched.models.spec import load_spec

    with pytest.raises(ConfigError, match=r"--dtype float16 with --quantization fp8"):
        CausalLM(load_spec(str(tmp_path)), dtype=torch.float16, quantization="fp8")
    CausalLM(load_spec(str(tmp_path)), dtype=torch.float16)  # unquantised float16 is fine


def test_fp8_weights_refused_on_a_gpu_without_fp8_tensor_cores(tmp_path, monkeypatch):
    """An A100 (compute capability 8.0) has no FP8 tensor cores: the model refuses fp8 weights
    there, naming the GPU and what to do, before it allocates anything; Ada (8.9) and Hopper
    (9.0) pass the check, as does the CPU (the exact emulation)."""
    make_hf("llama", tmp_path, seed=0)
    from nanosched.models import quant
    from nanosched.models.spec import load_spec

    capability = {"cc": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["cc"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"needs FP8 tensor cores .* cuda:0 is NVIDIA A100 "
                                          r"\(8\.0\): use --quantization none"):
        CausalLM(load_spec(str(tmp_path)), dtype=torch.bfloat16, device="cuda:0",
                 quantization="fp8")
    quant.check_fp8_device("none", "cuda:0")  # bf16 weights run there
    for cc in ((8, 9), (9, 0)):
        capability["cc"] = cc
        quant.check_fp8_device("fp8", "cuda:0")
    quant.check_fp8_device("fp8", "cpu")
