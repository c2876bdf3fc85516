import json

import pytest

from nanosched.errors import ProfileError
from nanosched.models.spec import load_spec
from nanosched.profiler.format import (
    Ceilings,
    Identity,
    KernelRow,
    Profile,
    RPPoint,
    load_profile,
    save_profile,
)


def tiny_profile() -> Profile:
    spec = load_spec("llama3-8b")
    rows = [KernelRow("kqv", t, 10.0 * t / 128, 132, best=True) for t in (128, 256)]
    rows += [KernelRow("kqv", 128, 20.0, 100, "green_ctx", "cublaslt", best=True)]
    rows += [KernelRow("attn_decode", 128, 30.0 + c / 100, 132, context=c, best=True)
             for c in (512, 1024, 2048)]
    rp = {"memory": (RPPoint(0.25, 0.6, 0.85, "green_ctx", 100, 32),)}
    return Profile(Identity("NVIDIA H100 80GB HBM3", 132, 80 << 30), spec, 1, 256,
                   Ceilings(761.0, 700.0, 3000.0), tuple(rows), rp=rp)


def test_round_trip_and_digest(tmp_path):
    prof = tiny_profile()
    path = tmp_path / "p.json"
    save_profile(prof, path)
    again = load_profile(path)
    assert again == prof and again.digest() == prof.digest()
    assert not list(tmp_path.glob(".*tmp"))


def test_lookups_interpolate_context_but_never_extrapolate():
    prof = tiny_profile()
    assert prof.kernel_time_us("kqv", 256) == 20.0
    assert prof.kernel_time_us("kqv", 128, sms=100) == 20.0
    assert prof.kernel_time_us("attn_decode", 128, context=768) == pytest.approx(37.68)
    with pytest.raises(ProfileError, match="contexts 512..2048, not 4096"):
        prof.kernel_time_us("attn_decode", 128, context=4096)
    with pytest.raises(ProfileError, match="no row for op 'kqv' at 384 tokens on 132 SMs; "
                                           "measured tokens: 128..256"):
        prof.kernel_time_us("kqv", 384)
    with pytest.raises(ProfileError, match="op 'ug' .* op not profiled"):
        prof.kernel_time_us("ug", 128)
    with pytest.raises(ProfileError, match="no R->P table for class 'network'"):
        prof.rp_points("network")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("kernels"), "missing field 'kernels'"),
    (lambda d: d.update(format="other/2"), "format is 'other/2'"),
    (lambda d: d["kernels"][0].update(time_us=-1), r"kernels\[0\] .* time_us must be positive"),
    (lambda d: d["kernels"][0].update(sms=500), "sms 500 not in 1..132"),
    (lambda d: d["kernels"][0].update(speed=1), r"unknown field\(s\) \['speed'\]"),
    (lambda d: d.update(tp=3), "--tp 3 does not divide"),
    (lambda d: d["rp"]["memory"][0].update(r=1.5), "r must be in"),
])
def test_bad_files_are_rejected_with_the_reason(tmp_path, mutate, message):
    data = tiny_profile().to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(Exception, match=message):
        load_profile(path)


def test_truncated_file(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(tiny_profile().to_json())[:200])
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(path)


def test_per_shape_rp_tables_round_trip_and_are_preferred(tmp_path):
    from dataclasses import replace

    from nanosched.profiler.format import RPPoint as P

    shape_pt = P(0.25, 0.4, 0.8, "green_ctx", 100, 32, compute_op="ug", tokens=128)
    prof = replace(tiny_profile(), rp_shapes={"memory": (shape_pt,)})
    path = tmp_path / "s.json"
    save_profile(prof, path)
    again = load_profile(path)
    assert again == prof
    assert again.rp_points("memory", "ug", 128) == (shape_pt,)
    assert again.rp_points("memory", "kqv", 128) == prof.rp["memory"]  # falls back to folded
    assert "rp_shapes" not in tiny_profile().to_json()  # absent when empty: digests stay


@pytest.mark.parametrize("model, tp, gpu, message", [
    ("llama3-70b", 1, None, "made for model 'llama3-8b', not 'llama3-70b'"),
    ("llama3-8b", 2, None, "made for --tp 1, not --tp 2"),
    ("llama3-8b", 1, "NVIDIA H200", "measured on 'NVIDIA H100 80GB HBM3', not on 'NVIDIA H200'"),
    ("llama3-8b", 1, None, "no kernel rows for op\\(s\\) rope_append, attn_prefill, o"),
])
def test_profile_for_another_model_tp_gpu_or_missing_ops_is_refused(model, tp, gpu, message):
    from nanosched.profiler.format import check_profile_for

    with pytest.raises(ProfileError, match=message):
        check_profile_for(tiny_profile(), load_spec(model), tp, gpu)
