"""FP8 weights (W8A8) in the cost model, the synthetic profile and the search: the layer GEMMs
priced on e4m3 bytes at the FP8 GEMM's rate, `search --quantization` picking (or checking) a
profile of those weights and falling back to a synthetic FP8 one, the set and its schedules
recording the quantization (absent for none, so older sets keep their bytes and digests)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from search_fixtures import small_profile, small_schedule

from nanosched.autosearch.check import check_schedule
from nanosched.autosearch.request import resolve
from nanosched.autosearch.synthetic import context_grid, synthetic_profile
from nanosched.errors import ConfigError, ProfileError, ScheduleError
from nanosched.hardware import get_gpu
from nanosched.models.costmodel import (
    FP8_GEMM_SPEEDUP,
    batch_mix,
    max_dense_batch,
    nano_mix,
    op_costs,
    op_demands,
    weight_bytes,
)
from nanosched.models.spec import load_spec
from nanosched.profiler.catalog import SHIPPED as PROFILES
from nanosched.schedules.format import Schedule, check_compatible
from nanosched.schedules.sets import (
    ScheduleSet,
    from_single,
    load_schedule_set,
    save_schedule_set,
)
from nanosched.schedules.shipped import SHIPPED_DIR
from nanosched.schedules.show import set_summary_lines, summary_lines
from nanosched.workloads import fixed

SPEC = load_spec("llama3-8b")
MOE = load_spec("mixtral-8x7b")
H100 = get_gpu("h100")


def test_cost_model_prices_fp8_layer_gemms_on_e4m3_bytes():
    mix = nano_mix(512, 128, 1280, 512)
    D, q, kv, inter = SPEC.hidden_size, SPEC.q_size, SPEC.kv_size, SPEC.intermediate_size
    # (weight elements, input elements) of each layer GEMM: a byte each instead of two
    e4m3 = {"kqv": (D * (q + 2 * kv), 512 * D), "o": (q * D, 512 * q),
            "ug": (D * 2 * inter, 512 * D), "d": (inter * D, 512 * inter)}
    for op, (w, x) in e4m3.items():
        f0, m0, _ = op_demands(SPEC, 1, mix, op)
        f8, m8, _ = op_demands(SPEC, 1, mix, op, "fp8")
        assert f8 == f0 and m0 - m8 == (w + x) * (SPEC.dtype_bytes - 1), op
    for op in ("attn_decode", "attn_prefill", "rope_append", "act", "add_norm_ffn"):
        assert op_demands(SPEC, 1, mix, op, "fp8") == op_demands(SPEC, 1, mix, op), op
    # a MoE's experts are e4m3 too: every touched expert's weights a byte an element
    E, moe_inter, moe_d = MOE.num_experts, MOE.intermediate_size, MOE.hidden_size
    for op, w, x in (("experts_ug", E * moe_d * 2 * moe_inter, 512 * moe_d),
                     ("experts_d", E * moe_inter * moe_d, 512 * 2 * moe_inter)):
        f0, m0, _ = op_demands(MOE, 1, mix, op)
        f8, m8, _ = op_demands(MOE, 1, mix, op, "fp8")
        assert f8 == f0 and m0 - m8 == w + x, op
    assert op_demands(MOE, 1, mix, "kqv", "fp8")[1] < op_demands(MOE, 1, mix, "kqv")[1]
    # the compute side at the FP8 GEMM's rate, the rest as before
    plain = {c.name: c for c in op_costs(SPEC, H100, 1, batch_mix(fixed(1024, 512), 1024))}
    fp8 = {c.name: c for c in op_costs(SPEC, H100, 1, batch_mix(fixed(1024, 512), 1024), "fp8")}
    assert fp8["ug"].t_compute_s == pytest.approx(plain["ug"].t_compute_s / FP8_GEMM_SPEEDUP)
    assert fp8["attn_decode"] == plain["attn_decode"] and fp8["lm_head"] == plain["lm_head"]
    with pytest.raises(ConfigError, match="--quantization must be one of none, fp8"):
        op_demands(SPEC, 1, mix, "kqv", "int4")


def test_fp8_weights_leave_more_memory_for_the_batch():
    D = SPEC.hidden_size
    layer = D * (SPEC.q_size + 2 * SPEC.kv_size) + SPEC.q_size * D + 3 * D * \
        SPEC.intermediate_size
    assert weight_bytes(SPEC) == SPEC.num_params() * 2
    assert weight_bytes(SPEC) - weight_bytes(SPEC, "fp8") == SPEC.num_layers * layer
    wl = fixed(1024, 512)
    assert max_dense_batch(SPEC, H100, 1, wl, quantization="fp8") > max_dense_batch(SPEC, H100,
                                                                                     1, wl)
    # Mixtral-8x7B: 93 GB in bf16, 47 GB with its experts and attention GEMMs in e4m3
    assert weight_bytes(MOE) / 1e9 == pytest.approx(93.4, abs=0.1)
    assert weight_bytes(MOE, "fp8") / 1e9 == pytest.approx(47.0, abs=0.1)


def test_synthetic_fp8_profile_prices_fp8_gemms():
    grid = context_grid(768, 512)
    plain = synthetic_profile(SPEC, H100, 1, 1024, grid)
    fp8 = synthetic_profile(SPEC, H100, 1, 1024, grid, "fp8")
    assert plain == synthetic_profile(SPEC, H100, 1, 1024, grid, "none")
    assert (plain.quantization, fp8.quantization) == ("none", "fp8")
    assert "quantization" not in plain.to_json() and fp8.to_json()["quantization"] == "fp8"
    assert fp8.ceilings.gemm_tflops_model == pytest.approx(
        FP8_GEMM_SPEEDUP * plain.ceilings.gemm_tflops_model, rel=1e-3)
    for op in ("kqv", "ug", "d"):  # compute-bound at the dense batch: near the FP8 rate
        ratio = plain.kernel_time_us(op, 1024) / fp8.kernel_time_us(op, 1024)
        assert 1.4 < ratio <= FP8_GEMM_SPEEDUP, (op, ratio)
    # `o` also pays its input's quantisation; attention and the LM head are unchanged
    assert 1.0 < plain.kernel_time_us("o", 1024) / fp8.kernel_time_us("o", 1024) < 1.5
    for op in ("attn_decode", "lm_head", "act"):
        ctx = 768 if op == "attn_decode" else None
        assert fp8.kernel_time_us(op, 512, context=ctx) == \
            plain.kernel_time_us(op, 512, context=ctx)
    assert any("FP8 weights (W8A8)" in n for n in fp8.notes)
    with pytest.raises(ConfigError, match="a a100 has no FP8 tensor cores"):
        synthetic_profile(SPEC, get_gpu("a100"), 1, 1024, grid, "fp8")


def test_search_picks_profiles_of_the_requested_quantization(tmp_path):
    bf16 = small_profile()
    (tmp_path / "a-bf16.json").write_text(json.dumps(bf16.to_json()))
    (tmp_path / "b-fp8.json").write_text(json.dumps(
        dataclasses.replace(bf16, quantization="fp8", dense_batch=512).to_json()))
    wl = fixed(512, 512)
    assert resolve(SPEC, 1, None, None, wl, "512", tmp_path).profile.quantization == "none"
    picked = resolve(SPEC, 1, None, None, wl, "512", tmp_path, quantization="fp8")
    assert picked.profile.quantization == "fp8"
    with pytest.raises(ProfileError, match="measured on 'none' weights, not --quantization "
                                           "fp8"):
        resolve(SPEC, 1, str(tmp_path / "a-bf16.json"), None, wl, "512", tmp_path,
                quantization="fp8")
    with pytest.raises(ProfileError, match="measured on 'fp8' weights, not --quantization "
                                           "none"):
        resolve(SPEC, 1, str(tmp_path / "b-fp8.json"), None, wl, "512", tmp_path)
    (tmp_path / "b-fp8.json").unlink()
    # no measured FP8 profile: the synthetic one, said twice
    synthetic = resolve(SPEC, 1, None, "h100", wl, "512", tmp_path, quantization="fp8")
    assert synthetic.profile is None
    assert any("SYNTHETIC PROFILE" in m for m in synthetic.messages)
    assert any("synthetic profile of FP8 weights" in m for m in synthetic.messages)
    assert any("no shipped profile for llama3-8b with fp8 weights" in m
               for m in synthetic.messages)
    # an FP8 KV cache still needs a measured profile; the hint names both flags
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8 --quantization fp8` and pass"):
        resolve(SPEC, 1, None, None, wl, "512", tmp_path, kv_dtype="fp8", quantization="fp8")
    with pytest.raises(ConfigError, match="--quantization must be one of"):
        resolve(SPEC, 1, None, None, wl, "512", tmp_path, quantization="auto")
    # the shipped profiles are all unquantised: none is picked for fp8
    assert resolve(SPEC, 1, None, "h100", wl, "512", quantization="fp8").profile is None
    assert resolve(SPEC, 1, None, "h100", wl, "512", PROFILES).profile is not None


def fp8_schedule() -> Schedule:
    return Schedule.from_json(dataclasses.replace(small_schedule(), quantization="fp8")
                              .to_json())


def test_schedules_and_sets_record_the_quantization_only_when_fp8(tmp_path):
    old = small_schedule().to_json()
    assert "quantization" not in old and Schedule.from_json(old).quantization == "none"
    sched = fp8_schedule()
    assert sched.quantization == "fp8" and sched.to_json()["quantization"] == "fp8"
    sset = from_single(sched)
    assert sset.quantization == "fp8"
    full = dataclasses.replace(sset, source_format="nanosched.schedule/2")
    save_schedule_set(full, tmp_path / "s.json")
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["quantization"] == "fp8"
    assert load_schedule_set(tmp_path / "s.json").quantization == "fp8"
    # a set whose schedules were searched on other weights is refused
    with pytest.raises(ScheduleError, match="KV dtype or quantization differs"):
        ScheduleSet.from_json({k: v for k, v in data.items() if k != "quantization"})
    # every shipped set reads and writes as before (the same bytes), the field only in the
    # FP8 sets
    shipped = {}
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        raw = json.loads(path.read_text())
        loaded = load_schedule_set(path)
        shipped[path.name] = loaded.quantization
        assert raw.get("quantization", "none") == loaded.quantization
        if raw.get("format") == "nanosched.schedule/2":
            assert loaded.to_json() == raw, path.name
    assert sorted(set(shipped.values())) == ["fp8", "none"], shipped
    assert "fp8 weights" in set_summary_lines(sset)[0]
    assert "(fp8 weights)" in summary_lines(sched)[0]
    assert "weights" not in set_summary_lines(from_single(small_schedule()))[0]


def test_a_schedule_runs_only_on_the_weights_it_was_searched_on():
    sched = fp8_schedule()
    assert check_compatible(sched, SPEC, 1, sched.gpu_name, quantization="fp8") == []
    with pytest.raises(ScheduleError, match="quantization: schedule was searched on a profile "
                                            "of 'fp8' weights, running --quantization none"):
        check_compatible(sched, SPEC, 1, sched.gpu_name)
    with pytest.raises(ScheduleError, match="of 'none' weights, running --quantization fp8"):
        check_compatible(small_schedule(), SPEC, 1, sched.gpu_name, quantization="fp8")
    # the checker holds a schedule to a profile of its own weights
    with pytest.raises(ScheduleError, match="measured on 'none' weights, not --quantization "
                                            "fp8"):
        check_schedule(sched, small_profile())


def test_search_fp8_without_a_profile_writes_a_synthetic_fp8_set(tmp_path):
    from nanosched.autosearch.command import search_command
    from nanosched.autosearch.request import SearchRequest

    lines: list[str] = []
    out = tmp_path / "fp8.set.json"
    sset = search_command(SearchRequest(
        model="llama3-8b", tp=1, profile=None, gpu="h100", workload=None, input_len=512,
        output_len=512, dense_batch="256", time_limit=2, workers=1, max_nano_ops=2,
        max_period_us=None, out=str(out), buckets="dense", quantization="fp8"),
        lines.append).sset
    assert sset.quantization == "fp8"  # type: ignore[attr-defined]
    data = json.loads(out.read_text())
    assert data["quantization"] == "fp8"
    assert all(e["schedule"]["quantization"] == "fp8" for e in data["entries"]
               if e.get("schedule"))
    assert any("SYNTHETIC" in line for line in lines)
    assert any("synthetic profile of FP8 weights" in line for line in lines)
    assert any("fp8 weights" in line for line in lines)
