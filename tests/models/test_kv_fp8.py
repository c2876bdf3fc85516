"""The FP8 KV cache: quantisation error, cache layout, the Triton kernels against the torch
references on an FP8 cache (CPU, TRITON_INTERPRET=1), and a whole model's logits and greedy
tokens with an FP8 cache against the same model with a cache in its own dtype."""

from __future__ import annotations

import os

import pytest
import torch
from hf_models import make_hf

from nanosched.errors import ConfigError, ProfileError
from nanosched.kernels import reference as ref
from nanosched.kernels.common import FP8_MAX, PAGED, PIPELINED, PIPELINED_2W, DecodeConfig
from nanosched.kernels.dispatch import KernelOptions, triton_available
from nanosched.models.kvcache import KVCache
from nanosched.models.spec import ModelSpec

interpret = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")

DTYPES = [torch.float32, torch.float16]  # bf16 computes garbage in the interpreter
# e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself. Attention outputs
# over a random cache are weighted means of those values: their error is well under that.
ATTN_TOL = 0.03


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def fp8_cache(pages: int, page: int, hkv: int, d: int, gen: torch.Generator):
    """Random K/V quantised per (token, head): values [P, S, Hkv, d] e4m3, scales [P, S, Hkv]."""
    kc, ks = ref.quantize_fp8(torch.randn(pages, page, hkv, d, generator=gen) * 3)
    vc, vs = ref.quantize_fp8(torch.randn(pages, page, hkv, d, generator=gen))
    return kc, vc, ks, vs


def test_quantisation_error_is_bounded_per_element():
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(0)) * \
        torch.logspace(-3, 3, 64)[:, None, None]  # vectors over six decades of magnitude
    x[0, 0] = 0.0  # an all-zero vector stays zero, with a finite scale
    q, scale = ref.quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == x.shape[:-1]
    back = ref.dequantize(q, scale)
    assert torch.equal(back[0, 0], torch.zeros(128)) and scale.isfinite().all()
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=2 ** -4)  # amax -> 448
    # normal e4m3 values: relative 2^-4; below e4m3's smallest normal (2^-6 of the scale unit)
    # the absolute step is 2^-9 scale units
    bound = torch.maximum(x.abs() * 2 ** -4, scale[..., None] * 2 ** -9)
    assert ((back - x).abs() <= bound * 1.0001).all()


def test_fp8_cache_layout_and_sizes():
    kv = KVCache(2, 5, 3, 16, torch.bfloat16, page_size=4, kv_dtype="fp8")
    assert kv.k.dtype == torch.float8_e4m3fn and kv.k_scale.shape == (2, 6, 4, 3)
    assert len(kv.page_tensors()) == 4 and all(t.shape[1] == 6 for t in kv.page_tensors())
    spec = ModelSpec("s", "llama", 48, 2, 3, 3, 16, 64, 100)
    assert kv.bytes_per_token == spec.kv_bytes_per_token(kv_dtype="fp8") == 2 * 2 * 3 * 20
    layer = kv.layer(1)
    assert layer.k_scale.shape == (6, 4, 3)
    assert layer.scales["v_scale"].data_ptr() == kv.v_scale[1].data_ptr()
    plain = KVCache(2, 5, 3, 16, torch.bfloat16, page_size=4)
    assert plain.layer(0).scales == {"k_scale": None, "v_scale": None}
    assert plain.bytes_per_token == 2 * 2 * 3 * 16 * 2
    kv.fill_random(torch.Generator().manual_seed(0))
    back = ref.dequantize(kv.k, kv.k_scale)
    assert back.isfinite().all() and 0.5 < back.std() < 2


def test_unknown_kv_dtype_names_the_choices():
    with pytest.raises(ConfigError, match=r"'int4' is not one of \('auto', 'fp8'\)"):
        KVCache(1, 2, 1, 8, torch.float32, kv_dtype="int4")
    from nanosched.runtime.config import EngineConfig

    with pytest.raises(ConfigError, match="fp4"):
        EngineConfig(kv_dtype="fp4")


def test_reference_rope_append_quantises_per_token_and_head():
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d = 4, 2, 16
    qkv = torch.randn(5, (hq + 2 * hkv) * d, generator=gen)
    pos, slots = torch.tensor([0, 3, 7, 100, 5]), torch.tensor([1, 9, 23, 3, 12])
    freqs = torch.outer(torch.arange(128).float(), 1 / 500.0 ** (torch.arange(0, d, 2) / d))
    plain = KVCache(1, 6, hkv, d, torch.float32, page_size=4)
    fp8 = KVCache(1, 6, hkv, d, torch.float32, page_size=4, kv_dtype="fp8")
    for kv in (plain, fp8):
        layer = kv.layer(0)
        ref.rope_append(qkv, pos, freqs.cos(), freqs.sin(), slots, layer.k, layer.v,
                        torch.empty(5, hq, d), **layer.scales)
    for cache, scale, want in ((fp8.k, fp8.k_scale, plain.k), (fp8.v, fp8.v_scale, plain.v)):
        got = ref.dequantize(cache[0], scale[0]).view(-1, hkv, d)[slots]
        want = want[0].view(-1, hkv, d)[slots]
        assert rel_err(got, want) < 2 ** -4
        assert torch.allclose(scale[0].view(-1, hkv)[slots], want.abs().amax(-1) / FP8_MAX)


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_ctas", [None, 1, 3])  # one program per token, then persistent
def test_triton_rope_append_writes_the_reference_fp8_cache(dtype, max_ctas):
    from nanosched.kernels.elementwise import rope_append

    gen = torch.Generator().manual_seed(3)
    hq, hkv, d = 4, 2, 16
    qkv = torch.randn(5, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    pos, slots = torch.tensor([0, 3, 7, 100, 5]), torch.tensor([1, 9, 23, 3, 12])
    freqs = torch.outer(torch.arange(128).float(), 1 / 500.0 ** (torch.arange(0, d, 2) / d))
    caches = []
    for fn, bound in ((ref.rope_append, {}), (rope_append, {"max_ctas": max_ctas})):
        kv = KVCache(1, 6, hkv, d, dtype, page_size=4, kv_dtype="fp8")
        layer = kv.layer(0)
        fn(qkv, pos, freqs.cos(), freqs.sin(), slots, layer.k, layer.v,
           torch.empty(5, hq, d, dtype=dtype), **layer.scales, **bound)
        caches.append(kv)
    want, got = caches
    # fp16: the reference rotates in fp16 (two roundings), the kernel in fp32 (one)
    assert torch.allclose(got.k_scale, want.k_scale, rtol=2e-3)
    assert torch.equal(got.v_scale, want.v_scale)  # V is copied: the same amax
    assert got.v_scale[0].view(-1, hkv)[9].min() > 0  # token 1's slot holds its scales
    # The interpreter's fp32 -> e4m3 conversion rounds ties up and drops the carry of a
    # rounding that overflows the mantissa (31.9 -> 16, where torch and the GPU give 32), so
    # a few values differ here; tests/gpu compares the kernel's hardware conversion.
    for a, b in ((got.k, want.k), (got.v, want.v)):
        assert (a.view(torch.uint8) != b.view(torch.uint8)).float().mean() < 0.05


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_ctas, num_splits", [(3, None), (16, 3)])
@pytest.mark.parametrize("config", [PAGED, PIPELINED, PIPELINED_2W, DecodeConfig(16, 5, 4, 1)])
def test_triton_decode_attention_on_fp8_cache(dtype, max_ctas, num_splits, config):
    from nanosched.kernels.decode_attn import decode_attention

    gen = torch.Generator().manual_seed(0)
    pages, page, hkv, group, d = 24, 16, 2, 4, 32
    kc, vc, ks, vs = fp8_cache(pages, page, hkv, d, gen)
    # one token; seven pages, the last partly filled; four pages exactly; a padded row
    lens = torch.tensor([1, 100, 64, 0], dtype=torch.int32)
    tables = torch.stack([torch.randperm(pages, generator=gen)[:7] for _ in lens]).int()
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype)
    want, got = torch.empty_like(q), torch.full_like(q, float("nan"))
    ref.decode_attention(q, kc, vc, tables, lens, 100, d ** -0.5, want, k_scale=ks, v_scale=vs)
    decode_attention(q, kc, vc, tables, lens, 100, d ** -0.5, got, max_ctas=max_ctas,
                     num_splits=num_splits, config=config, k_scale=ks, v_scale=vs)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-3)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    # and the FP8 result is the attention over the dequantised cache, within e4m3's rounding
    exact = torch.empty_like(q)
    ref.decode_attention(q, ref.dequantize(kc, ks), ref.dequantize(vc, vs), tables, lens, 100,
                         d ** -0.5, exact)
    assert rel_err(want, exact) < 1e-5


@interpret
@pytest.mark.parametrize("tiles", ["small", "default"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_prefill_attention_on_fp8_cache(dtype, tiles):
    """Small tiles (several K/V tiles a segment) and the default tiles an e4m3 cache gets."""
    from nanosched.kernels.prefill_attn import PrefillConfig, prefill_attention

    gen = torch.Generator().manual_seed(2)
    pages, page, hkv, group, d = 30, 4, 2, 2, 16
    kc, vc, ks, vs = fp8_cache(pages, page, hkv, d, gen)
    segments = [(0, 9, 6), (9, 20, 0), (20, 23, 30)]
    tables = torch.randperm(pages, generator=gen)[:30].view(3, 10).int()
    q = torch.randn(23, hkv * group, d, generator=gen).to(dtype)
    want, got = torch.zeros(q.shape), torch.full_like(q, float("nan"))
    ref.prefill_attention(q.float(), kc, vc, tables, segments, d ** -0.5, want, k_scale=ks,
                          v_scale=vs)
    cfg = PrefillConfig(32, 16, 4, 1) if tiles == "small" else None
    prefill_attention(q, kc, vc, tables, segments, d ** -0.5, got, cfg, k_scale=ks, v_scale=vs)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-3)


def model_logits(folder, kv_dtype: str, opts: KernelOptions) -> torch.Tensor:
    """Logits of a prefill chunk that continues a cached prompt plus one decode row."""
    from nanosched.models.checkpoint import load_checkpoint
    from nanosched.models.model import CausalLM
    from nanosched.models.spec import load_spec

    model = CausalLM(load_spec(str(folder)), kernels=opts)
    load_checkpoint(model, folder)
    ws = model.new_workspace(32, 16, page_size=4, kv_dtype=kv_dtype)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (30,))
    with torch.inference_mode():
        ws.token_ids[:12] = ids[:12]  # request 0: a 12-token prompt
        model(ws, ws.kv.plan([(0, 12, False)]))
        ws.token_ids[:1] = ids[12:13]  # then its decode beside request 1's 17-token prompt
        ws.token_ids[1:18] = ids[13:30]
        return model(ws, ws.kv.plan([(0, 1, True), (1, 17, False)]))


# The logit error of an FP8 cache on the tiny models, relative (norm) to the logits with a cache
# in the model's dtype (fp32 on the CPU): measured 1.7-6.7% over seeds 0-4 of the three
# architectures. e4m3 rounds each element within 2^-4 of itself (about 2% RMS), whatever the
# scale, so this is the format's error, not the scales'.
LOGIT_TOL = 0.08


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
@pytest.mark.parametrize("seed", [1, 4])
def test_fp8_cache_logits_stay_close_to_the_model_dtype_cache(arch, seed, tmp_path):
    make_hf(arch, tmp_path, seed=seed)
    base = model_logits(tmp_path, "auto", KernelOptions("torch"))
    fp8 = model_logits(tmp_path, "fp8", KernelOptions("torch"))
    assert rel_err(fp8, base) < LOGIT_TOL


@pytest.mark.slow
@interpret
def test_fp8_cache_logits_on_triton_kernels_match_torch(tmp_path):
    make_hf("llama", tmp_path, seed=5, num_hidden_layers=1)
    want = model_logits(tmp_path, "fp8", KernelOptions("torch"))
    got = model_logits(tmp_path, "fp8", KernelOptions("triton", gemm="triton"))
    # the attention kernels read the cache exactly (the tests above); what differs is the
    # interpreter's e4m3 conversion of a few written values (see the rope_append test)
    assert rel_err(got, want) < 0.05


# Greedy outputs of an FP8 cache agree with the model-dtype cache's for the first 16 tokens on
# the tiny Qwen2 config (measured 16-32 over seeds 0-4). The tiny Llama and Mixtral configs
# diverge after 0-32 tokens: their random weights leave top-2 logit margins smaller than the
# 2% logit error above, so which seed agrees how long is chance, not a property to test.
GREEDY_TOKENS = 16


@pytest.mark.parametrize("seed", range(5))
def test_fp8_cache_greedy_tokens_agree(seed, tmp_path):
    from nanosched.runtime.config import EngineConfig
    from nanosched.runtime.generate import GenerateConfig, generate

    make_hf("qwen2", tmp_path, seed=seed)
    outs = []
    for kv_dtype in ("auto", "fp8"):
        cfg = GenerateConfig(EngineConfig(model=str(tmp_path), device="cpu", kv_dtype=kv_dtype,
                                          eos_ids=frozenset()),
                             prompt_ids=(5, 9, 2, 77, 31, 4), max_tokens=GREEDY_TOKENS)
        outs.append(generate(cfg).output_ids)
    assert len(outs[0]) == GREEDY_TOKENS and outs[1] == outs[0]


def test_profile_records_its_kv_dtype_and_schedules_carry_it(tmp_path):
    """An FP8 profile says so (its digest changes), a schedule searched on it says so, and the
    runtime's compatibility check refuses it on a cache of another dtype."""
    import dataclasses
    import json

    from search_fixtures import small_profile, small_schedule
    from typer.testing import CliRunner

    from nanosched.cli import app
    from nanosched.errors import ScheduleError
    from nanosched.models.spec import load_spec
    from nanosched.profiler.format import Profile
    from nanosched.schedules.format import Schedule, check_compatible

    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", "--fake-gpu", "--model", "llama3-8b", "--quick",
                                 "--dense-batch", "256", "--out", str(out), "--no-progress",
                                 "--kv-cache-dtype", "fp8"])
    assert r.exit_code == 0, r.output
    assert "FP8 KV cache" in r.output and json.loads(out.read_text())["kv_dtype"] == "fp8"
    r = CliRunner().invoke(app, ["profile", "--fake-gpu", "--model", "llama3-8b",
                                 "--kv-cache-dtype", "int8", "--out", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "'int8' is not one of ('auto', 'fp8')" in r.output

    prof = small_profile()
    assert "kv_dtype" not in prof.to_json()  # bf16 profiles keep their digest
    fp8 = dataclasses.replace(prof, kv_dtype="fp8")
    assert fp8.digest() != prof.digest()
    assert Profile.from_json(fp8.to_json()).kv_dtype == "fp8"

    spec = load_spec("llama3-8b")
    sched = dataclasses.replace(small_schedule(), kv_dtype="fp8")
    sched = Schedule.from_json(sched.to_json())
    assert sched.kv_dtype == "fp8"
    assert check_compatible(sched, spec, 1, sched.gpu_name, kv_dtype="fp8") == []
    with pytest.raises(ScheduleError, match="searched on a 'fp8' profile, running "
                                            "--kv-cache-dtype auto"):
        check_compatible(sched, spec, 1, sched.gpu_name)
    old = small_schedule().to_json()
    old.pop("kv_dtype")  # a schedule written before the field: a bf16 cache's
    assert Schedule.from_json(old).kv_dtype == "auto"


def test_search_picks_profiles_of_the_requested_kv_dtype(tmp_path):
    import dataclasses
    import json

    from search_fixtures import small_profile

    from nanosched.autosearch.request import resolve
    from nanosched.models.spec import load_spec
    from nanosched.workloads import fixed

    spec = load_spec("llama3-8b")
    bf16 = small_profile()
    (tmp_path / "a-bf16.json").write_text(json.dumps(bf16.to_json()))
    (tmp_path / "b-fp8.json").write_text(json.dumps(
        dataclasses.replace(bf16, kv_dtype="fp8", dense_batch=512).to_json()))
    wl = fixed(512, 512)
    assert resolve(spec, 1, None, None, wl, "512", tmp_path).profile.kv_dtype == "auto"
    assert resolve(spec, 1, None, None, wl, "512", tmp_path, kv_dtype="fp8").profile.kv_dtype \
        == "fp8"
    with pytest.raises(ProfileError, match="measured on a 'auto' KV cache, not "
                                          "--kv-cache-dtype fp8"):
        resolve(spec, 1, str(tmp_path / "a-bf16.json"), None, wl, "512", tmp_path,
                kv_dtype="fp8")
    (tmp_path / "b-fp8.json").unlink()
    with pytest.raises(ConfigError, match="no shipped profile for llama3-8b with a fp8 KV "
                                          "cache: measure one"):
        resolve(spec, 1, None, None, wl, "512", tmp_path, kv_dtype="fp8")
