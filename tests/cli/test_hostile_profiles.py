"""Malformed profile files through the real `nanosched profile show`: each is refused with exit
2 and one line naming the file and the field, and none ends in a traceback (issue 18)."""

from __future__ import annotations

import json

import pytest
from hostile import RUNNER, mutated, refused, write
from repo import PROFILES

from nanosched.cli import app

SHIPPED = PROFILES
BASE = json.loads((SHIPPED / "llama3-70b-tp2-h200x2-quick.json").read_text())


def _k(d, i=0):
    return d["kernels"][i]


CASES = [
    ("time-inf", lambda d: _k(d).update(time_us=float("inf")), "'time_us'"),
    ("time-nan", lambda d: _k(d).update(time_us=float("nan")), "'time_us'"),
    ("time-negative", lambda d: _k(d).update(time_us=-3.0), "time_us"),
    ("time-zero", lambda d: _k(d).update(time_us=0), "time_us"),
    ("time-str", lambda d: _k(d).update(time_us="fast"), "'time_us'"),
    ("tokens-str", lambda d: _k(d).update(tokens="128"), "'tokens'"),
    ("tokens-negative", lambda d: _k(d).update(tokens=-128), "tokens"),
    ("tokens-huge", lambda d: _k(d).update(tokens=10**15), "tokens"),
    ("context-negative", lambda d: _k(d).update(context=-1), "context"),
    ("sms-float", lambda d: _k(d).update(sms=66.5), "'sms'"),
    ("sms-over", lambda d: _k(d).update(sms=10**6), "sms"),
    ("best-str", lambda d: _k(d).update(best="yes"), "'best'"),
    ("clock-inf", lambda d: _k(d).update(clock_mhz=float("inf")), "'clock_mhz'"),
    ("mechanism-unknown", lambda d: _k(d).update(mechanism="magic"), "mechanism"),
    ("kernel-null", lambda d: d["kernels"].__setitem__(0, None), "kernels[0]"),
    ("kernels-object", lambda d: d.update(kernels={}), "'kernels'"),
    ("kernels-empty", lambda d: d.update(kernels=[]), "kernel table is empty"),
    ("pair-zero-time", lambda d: d["pairs"][0].update(compute_us=0.0), "pairs[0]"),
    ("pair-inf", lambda d: d["pairs"][0].update(other_us=float("inf")), "'other_us'"),
    ("pair-negative-settle", lambda d: d["pairs"][0].update(settle_ms=-1.0), "pairs[0]"),
    ("rp-r-inf", lambda d: d["rp"]["memory"][0].update(r=float("inf")), "'r'"),
    ("rp-p-zero", lambda d: d["rp"]["memory"][0].update(p_other=0.0), "rp[memory]"),
    ("rp-object", lambda d: d.update(rp=[]), "'rp'"),
    ("rp-class-unknown", lambda d: d["rp"].update(disk=[]), "disk"),
    ("ceiling-zero", lambda d: d["ceilings"].update(copy_gbs=0), "copy_gbs"),
    ("ceiling-nan", lambda d: d["ceilings"].update(gemm_tflops_8192=float("nan")),
     "'gemm_tflops_8192'"),
    ("num-sms-zero", lambda d: d["identity"].update(num_sms=0), "num_sms"),
    ("num-sms-str", lambda d: d["identity"].update(num_sms="132"), "'num_sms'"),
    ("tp-str", lambda d: d.update(tp="2"), "'tp'"),
    ("tp-undivided", lambda d: d.update(tp=3), "tp"),
    ("dense-batch-huge", lambda d: d.update(dense_batch=10**12), "dense_batch"),
    ("model-hidden-str", lambda d: d["model"].update(hidden_size="8192"), "hidden_size"),
    ("model-context-absurd", lambda d: d["model"].update(max_position_embeddings=10**18),
     "max_position_embeddings"),
    ("model-theta-inf", lambda d: d["model"].update(rope_theta=float("inf")), "rope_theta"),
    ("model-unknown-field", lambda d: d["model"].update(colour=1), "colour"),
    ("model-list", lambda d: d.update(model=[]), "'model'"),
    ("identity-missing", lambda d: d.pop("identity"), "'identity'"),
    ("kv-dtype-int", lambda d: d.update(kv_dtype=8), "'kv_dtype'"),
]


@pytest.mark.parametrize("mutate, field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_profile_show_refuses_malformed_profile(tmp_path, mutate, field):
    path = write(tmp_path / "bad.json", mutated(BASE, mutate))
    refused(["profile", "show", str(path)], str(path), field)


RAW = [
    ("empty", b""),
    ("truncated", json.dumps(BASE).encode()[:1000]),
    ("not-utf8", b"\xff\xfe\x00garbage"),
    ("deep", b"{\"a\":" * 50_000 + b"1" + b"}" * 50_000),
    ("top-level-list", b"[]"),
]


@pytest.mark.parametrize("raw", [r[1] for r in RAW], ids=[r[0] for r in RAW])
def test_profile_show_refuses_garbage_file(tmp_path, raw):
    path = tmp_path / "bad.json"
    path.write_bytes(raw)
    refused(["profile", "show", str(path)], str(path))


def test_the_base_profile_is_accepted(tmp_path):
    path = write(tmp_path / "good.json", BASE)
    r = RUNNER.invoke(app, ["profile", "show", str(path)])
    assert r.exit_code == 0, r.output


def _dup_rows(d, factor):
    d["kernels"] = d["kernels"] + [dict(k, time_us=k["time_us"] * factor) for k in d["kernels"]]


PROFILE_MUTATIONS = [  # issue 45: each was accepted with exit 0
    ("rows-duplicated-100x", lambda d: _dup_rows(d, 100.0), "a second row of the same kernel"),
    ("ceiling-1e-300", lambda d: d["ceilings"].update(copy_gbs=1e-300), "copy_gbs"),
    ("row-1048576-tokens", lambda d: _k(d).update(tokens=1 << 20), "at most 131072"),
    ("context-67108864", lambda d: _k(d).update(context=1 << 26), "context in 0..2097152"),
    ("p-falling-as-r-grows", lambda d: _falling(d), "must not fall as r grows"),
    ("duplicate-r-point", lambda d: d["rp"]["memory"].append(dict(d["rp"]["memory"][0])),
     "two points at r="),
]


def _falling(d):
    """The largest-r point of the base profile's first curve of several points made slower
    than its smallest-r one."""
    keys = ("mechanism", "compute_impl", "other_impl", "compute_op", "tokens", "context")
    for pts in d["rp"].values():
        curves = {}
        for p in pts:
            curves.setdefault(tuple(p.get(k) for k in keys), []).append(p)
        for curve in curves.values():
            if len(curve) >= 2:
                curve.sort(key=lambda p: p["r"])
                curve[-1]["p_other"] = curve[0]["p_other"] / 2
                return
    raise AssertionError("the base profile has no R->P curve of two points")


@pytest.mark.parametrize("mutate, field", [c[1:] for c in PROFILE_MUTATIONS],
                         ids=[c[0] for c in PROFILE_MUTATIONS])
@pytest.mark.parametrize("command", ["profile show", "profile rederive", "search"])
def test_profiles_no_gpu_could_measure_are_refused(tmp_path, mutate, field, command):
    path = write(tmp_path / "bad.json", mutated(BASE, mutate))
    args = {"profile show": ["profile", "show", str(path)],
            "profile rederive": ["profile", "rederive", str(path), "--out",
                                 str(tmp_path / "out.json")],
            "search": ["search", "--profile", str(path), "--buckets", "dense", "--time-limit",
                       "1", "--out", str(tmp_path / "set.json")]}[command]
    refused(args, str(path), field)
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "set.json").exists()
