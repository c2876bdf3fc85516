"""Malformed schedule files through the real `nanosched show` and `bench --schedule`: each is
refused with exit 2 and one line naming the file and the field, before any work, and none ends
in a traceback (issue 18)."""

from __future__ import annotations

import json

import pytest
from hostile import mutated, refused, write
from repo import DATA

BASE = json.loads((DATA / "tiny_llama_schedule.json").read_text())


def _op(d, i=0):
    return d["nano_ops"][i]


# (case id, mutation, the field the message must name)
CASES = [
    ("share-str", lambda d: _op(d)["alloc"].update(share="abc"), "'share'"),
    ("share-inf", lambda d: _op(d)["alloc"].update(share=float("inf")), "'share'"),
    ("share-nan", lambda d: _op(d)["alloc"].update(share=float("nan")), "'share'"),
    ("tp-str", lambda d: d.update(tp="1"), "'tp'"),
    ("tp-bool", lambda d: d.update(tp=True), "'tp'"),
    ("tp-zero", lambda d: d.update(tp=0), "tp"),
    ("deps-object", lambda d: _op(d).update(deps={}), "'deps'"),
    ("deps-item-str", lambda d: _op(d).update(deps=["x"]), "'deps'"),
    ("dep-shift-float", lambda d: _op(d)["deps"].append({"id": "kqv.0", "shift": 0.5}), "'shift'"),
    ("period-inf", lambda d: d["prediction"].update(solver_period_us=float("inf")),
     "'solver_period_us'"),
    ("period-nan", lambda d: d["prediction"].update(solver_period_us=float("nan")),
     "'solver_period_us'"),
    ("period-zero", lambda d: d["prediction"].update(solver_period_us=0), "solver_period_us"),
    ("period-negative", lambda d: d["prediction"].update(solver_period_us=-59.0),
     "solver_period_us"),
    ("iteration-zero", lambda d: d["prediction"].update(iteration_us=0), "iteration_us"),
    ("seq-iteration-inf", lambda d: d["prediction"].update(sequential_iteration_us=1e400),
     "'sequential_iteration_us'"),
    ("tokens-negative", lambda d: d["prediction"].update(tokens_per_s=-1.0), "tokens_per_s"),
    ("duration-inf", lambda d: _op(d).update(duration_us=float("inf")), "'duration_us'"),
    ("duration-zero", lambda d: _op(d).update(duration_us=0), "duration_us"),
    ("duration-over-period", lambda d: _op(d).update(duration_us=1e9), "duration_us"),
    ("start-huge", lambda d: _op(d).update(start_us=1e15), "start_us"),
    ("start-huge-offset", lambda d: _op(d).update(start_us=1e15, layer_offset=10**13),
     "layer_offset"),
    ("start-negative", lambda d: _op(d).update(start_us=-5.0), "start_us"),
    ("start-str", lambda d: _op(d).update(start_us="0"), "'start_us'"),
    ("layer-offset-huge", lambda d: _op(d).update(layer_offset=10**9), "layer_offset"),
    ("units-str", lambda d: _op(d)["alloc"].update(units="many"), "'units'"),
    ("units-zero", lambda d: _op(d)["alloc"].update(units=0), "units"),
    ("units-over-sms", lambda d: _op(d)["alloc"].update(units=10**6), "units"),
    ("mechanism-unknown", lambda d: _op(d)["alloc"].update(mechanism="magic"), "mechanism"),
    ("mechanism-int", lambda d: _op(d)["alloc"].update(mechanism=3), "'mechanism'"),
    ("side-unknown", lambda d: _op(d)["alloc"].update(side="left"), "side"),
    ("alloc-list", lambda d: _op(d).update(alloc=[1, 2]), "'alloc'"),
    ("id-int", lambda d: _op(d).update(id=7), "'id'"),
    ("order-float", lambda d: _op(d).update(order=0.5), "'order'"),
    ("start-token-str", lambda d: _op(d).update(start="0"), "'start'"),
    ("nano-ops-object", lambda d: d.update(nano_ops={}), "'nano_ops'"),
    ("nano-op-null", lambda d: d["nano_ops"].__setitem__(0, None), "'nano_ops' item 0"),
    ("streams-str", lambda d: d.update(streams="compute"), "'streams'"),
    ("stream-units-str", lambda d: d["streams"][0].update(units="12"), "'units'"),
    ("batch-list", lambda d: d.update(batch=[]), "'batch'"),
    ("dense-batch-huge", lambda d: d["batch"].update(dense_batch=10**12), "dense_batch"),
    ("dense-batch-float", lambda d: d["batch"].update(dense_batch=256.0), "'dense_batch'"),
    ("context-negative", lambda d: d["batch"].update(decode_context=-1.0), "decode_context"),
    ("num-sms-huge", lambda d: d.update(num_sms=10**9), "num_sms"),
    ("ranges-str", lambda d: d.update(ranges={"kqv": "x"}), "'ranges'"),
    ("ranges-triple", lambda d: d["ranges"].update(kqv=[[0, 1, 2]]), "'ranges'"),
    ("ranges-unknown-op", lambda d: d["ranges"].update(teleport=[[0, 256]]), "teleport"),
    ("ranges-empty", lambda d: d["ranges"].update(kqv=[]), "ranges[kqv]"),
    ("forms-unknown", lambda d: d.update(forms={"attn": "broadcast"}), "forms"),
    ("forms-list", lambda d: d.update(forms=["ar"]), "'forms'"),
    ("model-list", lambda d: d.update(model=[]), "'model'"),
    ("notes-ints", lambda d: d.update(notes=[1, 2]), "'notes'"),
    ("stage-gap-str", lambda d: d["stages"][0].update(gap="0"), "'gap'"),
    ("kv-dtype-int", lambda d: d.update(kv_dtype=8), "'kv_dtype'"),
    ("gpu-name-null", lambda d: d.update(gpu_name=None), "'gpu_name'"),
    ("unknown-field", lambda d: d.update(colour="red"), "colour"),
    ("format-missing", lambda d: d.pop("format"), "format"),
]


@pytest.mark.parametrize("mutate, field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_show_refuses_malformed_schedule(tmp_path, mutate, field):
    path = write(tmp_path / "bad.json", mutated(BASE, mutate))
    refused(["show", str(path)], str(path), field)


RAW = [
    ("empty", b""),
    ("truncated", json.dumps(BASE).encode()[:500]),
    ("not-utf8", b'{"format": "\xff\xfe"}'),
    ("deep", b"[" * 100_000 + b"]" * 100_000),
    ("top-level-list", b"[1, 2, 3]"),
    ("top-level-str", b'"schedule"'),
    ("nan-literal", b"NaN"),
]


@pytest.mark.parametrize("raw", [r[1] for r in RAW], ids=[r[0] for r in RAW])
def test_show_refuses_garbage_file(tmp_path, raw):
    path = tmp_path / "bad.json"
    path.write_bytes(raw)
    refused(["show", str(path)], str(path))


def test_show_refuses_a_directory_and_a_missing_file(tmp_path):
    refused(["show", str(tmp_path)], str(tmp_path), "is a folder")
    refused(["show", str(tmp_path / "none.json")], "does not exist")


def test_the_base_schedule_is_accepted(tmp_path):
    """The mutations above start from a schedule `show` accepts: each refusal is the fault's."""
    from hostile import RUNNER

    from nanosched.cli import app

    path = write(tmp_path / "good.json", BASE)
    r = RUNNER.invoke(app, ["show", str(path)])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("mutate, field", [c[1:] for c in CASES[:4]], ids=[c[0] for c in
                                                                            CASES[:4]])
def test_bench_refuses_malformed_schedule_before_loading(tmp_path, mutate, field):
    """`bench --schedule FILE` checks the file before building the model (the loader's path)."""
    path = write(tmp_path / "bad.json", mutated(BASE, mutate))
    refused(["bench", "--model", str(DATA / "tiny_llama_config.json"), "--device", "cpu",
             "--input-len", "8", "--output-len", "2", "--num-prompts", "1",
             "--schedule", str(path)], str(path), field)


def test_a_profile_given_to_show_is_named_a_profile(tmp_path):
    """Issue 45: not "search again to write the current format": it is no schedule at all."""
    from repo import PROFILES

    profile = sorted(PROFILES.glob("*.json"))[0]
    refused(["show", str(profile)], "this is a profile (nanosched.profile/1), not a schedule",
            "nanosched profile show")


def test_a_key_the_set_lacks_lists_the_keys_it_has(tmp_path):
    """Issue 45: a `--buckets dense` set holds only the steady state's key; `--key` elsewhere
    lists that key instead of a rule the asked key seems to fit."""
    from repo import ROOT

    shipped = ROOT / "nanosched" / "schedules" / "shipped" / \
        "llama3-8b-tp1-h100-in1024-out512-b1024.set.json"
    data = json.loads(shipped.read_text())
    steady = data["search"]["steady_key"]
    data["entries"] = [e for e in data["entries"]
                       if [e["num_decode"], e["num_tokens"]] == steady]
    dense = write(tmp_path / "dense.set.json", data)
    refused(["show", str(dense), "--key", "128,256"], "no entry at D=128, T=256",
            "its keys (D,T): 384,1024")
    many = refused(["show", str(shipped), "--key", "1024,128"], "its keys (D,T): 0,128 0,256")
    assert "and 24 more" in many


@pytest.mark.parametrize("command", [["show"], ["bench", "--model",
                                                str(DATA / "tiny_llama_config.json"),
                                                "--device", "cpu", "--schedule"]])
def test_a_key_given_twice_is_refused_not_taken_last(tmp_path, command):
    """Issue 45: JSON keeps the last of a repeated key silently; the file is refused instead,
    naming the key (a schedule and a profile alike: fileio.read_json)."""
    text = json.dumps(BASE)
    assert text.count('"tp": 1,') == 1
    path = tmp_path / "dup.json"
    path.write_text(text.replace('"tp": 1,', '"tp": 1, "tp": 2,'))
    args = [*command, str(path)] if command == ["show"] else \
        [*command, str(path), "--input-len", "4", "--output-len", "2", "--num-prompts", "1"]
    refused(args, "dup.json", "key 'tp' appears twice")


def test_a_profile_key_given_twice_is_refused(tmp_path):
    from repo import PROFILES

    text = (PROFILES / "llama3-8b-tp1-h100.json").read_text()
    path = tmp_path / "dup-profile.json"
    path.write_text(text.replace('"format":', '"tp": 9, "format":', 1))
    data = json.loads(path.read_text())
    assert "tp" in data
    refused(["profile", "show", str(path)], "dup-profile.json", "appears twice")
