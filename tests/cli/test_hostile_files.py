"""Files handed in, round two (issue 36): profiles with times of 1e300 or 1e-300, an unknown op,
an empty R->P table or another model's dimensions; a schedule set without entries; JSONL and
safetensors headers with integers of thousands of digits; checkpoints whose weights file is a
FIFO, whose weights are integers where floats belong, or hold NaN. Each ends in one `error:`
line naming the file and the field (exit 2), never a traceback, a hang or a silent answer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hostile import RUNNER, mutated, refused, write
from repo import DATA, ROOT
from serve_helpers import free_port

from nanosched.cli import app
from nanosched.schedules.format import load_schedule
from nanosched.schedules.sets import from_single

PROFILE = json.loads((ROOT / "nanosched/profiler/profiles/llama3-70b-tp8-h200-quick.json")
                     .read_text())
FORWARD_ROW = {"op": "kqv", "batch_tokens": 256, "num_decode": 256, "tokens": 256,
               "impl": "cublas", "row_us": 25.0, "time_us": 27.5, "context": 0,
               "settle_ms": 300.0, "window_ms": 1000.0, "clock_mhz": 1952.3, "power_w": 691.8}
CONFIG = str(DATA / "tiny_llama_config.json")


def _all(op: str, **change):
    def mutate(d):
        for k in d["kernels"]:
            if k["op"] == op:
                k.update(change)
    return mutate


def _fwd(**change):
    def mutate(d):
        d["forward"] = [FORWARD_ROW | change]
    return mutate


# (id, mutation, what the one error line names); each crashed or misled the search before
PROFILES = [
    ("time-1e300", _all("kqv", time_us=1e300), "time_us is 1e+300"),
    ("time-1e-300", _all("act", time_us=1e-300), "time_us is 1e-300"),
    ("forward-row-1e-300", _fwd(row_us=1e-300), "row_us"),
    ("forward-factor-1e6", _fwd(time_us=1e5), "time_us / row_us"),
    ("pair-time-1e300", lambda d: d["pairs"][0].update(compute_us=1e300), "pairs[0]"),
    ("ceiling-1e300", lambda d: d["ceilings"].update(copy_gbs=1e300), "copy_gbs"),
    ("unknown-op", lambda d: d["kernels"][0].update(op="teleport"), "'teleport'"),
    ("unknown-pair-op", lambda d: d["pairs"][0].update(other_op="teleport"), "'teleport'"),
]


@pytest.mark.parametrize("mutate, needle", [c[1:] for c in PROFILES], ids=[c[0] for c in PROFILES])
def test_profiles_with_absurd_times_or_foreign_ops_are_refused(tmp_path, mutate, needle):
    path = write(tmp_path / "p.json", mutated(PROFILE, mutate))
    refused(["profile", "show", str(path)], str(path), needle)
    refused(["search", "--model", "llama3-70b", "--profile", str(path), "--buckets", "dense",
             "--time-limit", "1"], str(path), needle)


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(rp={}), "empty R->P table for class 'memory'"),
    (lambda d: d["rp"].update(memory=[]), "empty R->P table for class 'memory'"),
    (lambda d: d["rp"].update(network=[]), "empty R->P table for class 'network'"),
    (lambda d: d["model"].update(intermediate_size=14336), "intermediate_size 14336, not 28672"),
    (lambda d: d["model"].update(name="llama3-8b"), "made for model 'llama3-8b'"),
], ids=["rp-empty", "rp-memory-empty", "rp-network-empty", "other-dims", "other-model"])
def test_search_refuses_a_profile_it_cannot_price_this_model_with(tmp_path, mutate, needle):
    path = write(tmp_path / "p.json", mutated(PROFILE, mutate))
    refused(["search", "--model", "llama3-70b", "--profile", str(path), "--buckets", "dense",
             "--time-limit", "1"], str(path), needle)


@pytest.fixture(scope="module")
def empty_set(tmp_path_factory) -> Path:
    data = from_single(load_schedule(DATA / "tiny_llama_schedule.json")).to_json()
    path = tmp_path_factory.mktemp("set") / "empty.set.json"
    return write(path, data | {"entries": []})


@pytest.mark.parametrize("args", [
    ["show", "{}"],
    ["bench", "--model", CONFIG, "--device", "cpu", "--input-len", "8", "--output-len", "2",
     "--num-prompts", "1", "--schedule", "{}"],
    ["serve", "--model", CONFIG, "--device", "cpu", "--port", "PORT", "--schedule", "{}"],
    ["verify", "{}", "--device", "cpu", "--out", "OUT"],
], ids=["show", "bench", "serve", "verify"])
def test_a_set_without_entries_is_refused(empty_set, tmp_path, args):
    args = [a.replace("{}", str(empty_set)).replace("PORT", str(free_port()))
            .replace("OUT", str(tmp_path / "v.json")) for a in args]
    refused(args, str(empty_set), "entries is empty")


def test_a_jsonl_integer_of_5000_digits_is_refused(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_len": 4, "output_len": 2}\n{"prompt_len": 1%s, "output_len": 2}\n'
                    % ("0" * 5000))
    refused(["bench", "--model", CONFIG, "--device", "cpu", "--workload", str(path),
             "--num-prompts", "1"], f"{path}:2:", "too long")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from hf_models import make_hf

    folder = tmp_path_factory.mktemp("hf") / "good"
    make_hf("llama", folder, num_hidden_layers=1)
    return folder


def _damaged(checkpoint: Path, tmp_path: Path, damage) -> Path:
    folder = Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))
    damage(folder)
    return folder


def _retype(folder: Path, name: str, fn) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors[name] = fn(tensors[name])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _fifo_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")


def _fifo_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").write_text("{}")
    os.mkfifo(folder / "tokenizer_config.json")


def _devzero_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("/dev/zero")


def _folder_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()


def _folder_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink(missing_ok=True)
    (folder / "tokenizer.json").mkdir()


def _huge_header_int(folder: Path) -> None:
    header = b'{"a": {"dtype": "F32", "shape": [1%s], "data_offsets": [0, 4]}}' % (b"0" * 5000)
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)


NORM = "model.layers.0.input_layernorm.weight"
DAMAGE = [
    ("weights-fifo", _fifo_weights, "model.safetensors", "FIFO"),
    ("tokenizer-fifo", _fifo_tokenizer, "tokenizer_config.json", "FIFO"),
    # issue 45: weights were named a "tokenizer file", a folder of weights exited 1, a folder
    # tokenizer.json said "Couldn't instantiate the backend tokenizer from one of: "
    ("weights-devzero", _devzero_weights, "checkpoint", "model.safetensors: is a character"),
    ("weights-fifo-named", _fifo_weights, "checkpoint", "model.safetensors: is a FIFO"),
    ("weights-folder", _folder_weights, "checkpoint", "is a folder, not a safetensors file"),
    ("tokenizer-folder", _folder_tokenizer, "tokenizer file", "tokenizer.json: is a folder"),
    ("header-huge-int", _huge_header_int, "model.safetensors", "JSON"),
    ("int64-weight", lambda f: _retype(f, NORM, lambda t: t.to(__import__("torch").int64)),
     NORM, "holds I64"),
    ("nan-weight", lambda f: _retype(f, NORM, lambda t: t.fill_(float("nan"))), NORM, "NaN"),
    ("inf-weight", lambda f: _retype(f, "model.norm.weight", lambda t: t.fill_(float("inf"))),
     "model.norm.weight", "infinite"),
]


@pytest.mark.parametrize("damage, name, why", [c[1:] for c in DAMAGE], ids=[c[0] for c in DAMAGE])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_damaged_checkpoints_are_refused_not_hung_on_or_served(checkpoint, tmp_path, damage,
                                                                name, why, command):
    folder = _damaged(checkpoint, tmp_path, damage)
    if command == "generate":
        prompt = ["--prompt", "hi"] if "tokenizer" in name else ["--prompt-ids", "1,2"]
        args = ["generate", "--model", str(folder), *prompt, "--max-tokens", "1"]
    else:
        args = ["serve", "--model", str(folder), "--device", "cpu", "--port", str(free_port())]
    refused(args, str(folder), name, why)


def test_the_undamaged_checkpoint_generates(checkpoint):
    r = RUNNER.invoke(app, ["generate", "--model", str(checkpoint), "--prompt-ids", "1,2",
                            "--max-tokens", "2"])
    assert r.exit_code == 0, r.output


SET_COMMANDS = [
    ["show", "{}"],
    ["bench", "--model", CONFIG, "--device", "cpu", "--input-len", "8", "--output-len", "2",
     "--num-prompts", "1", "--schedule", "{}"],
    ["serve", "--model", CONFIG, "--device", "cpu", "--port", "PORT", "--schedule", "{}"],
    ["verify", "{}", "--device", "cpu", "--out", "OUT"],
]


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf")], ids=["-1", "nan", "inf"])
@pytest.mark.parametrize("args", SET_COMMANDS, ids=["show", "bench", "serve", "verify"])
def test_a_set_with_an_impossible_min_gain_is_refused(empty_set, tmp_path, args, value):
    """Issue 45: a set's min_gain of -1 was taken (show, bench, serve, verify)."""
    data = json.loads(empty_set.read_text())
    data["entries"] = from_single(load_schedule(DATA / "tiny_llama_schedule.json")) \
        .to_json()["entries"]
    path = write(tmp_path / "gain.set.json", data | {"min_gain": value})
    args = [a.replace("{}", str(path)).replace("PORT", str(free_port()))
            .replace("OUT", str(tmp_path / "v.json")) for a in args]
    refused(args, str(path), "min_gain", "must be a finite number")


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["streams"][0].update(units=[]), "streams[0].units"),
    (lambda d: d["streams"][0].update(units=[-40]), "streams[0].units"),
    (lambda d: d["model"].update(num_layers=0), "model.num_layers"),
    (lambda d: d["model"].update(num_layers=80), "model.num_layers"),
], ids=["units-empty", "units-negative", "layers-0", "layers-80"])
@pytest.mark.parametrize("command", ["show", "bench-force"])
def test_schedule_values_no_model_or_gpu_has_are_refused(tmp_path, mutate, field, command):
    """Issue 45: these were accepted with exit 0 (`show`, `bench --force`)."""
    from hostile import mutated

    base = json.loads((DATA / "tiny_llama_schedule.json").read_text())
    assert base["model"]["num_layers"] == 2
    path = write(tmp_path / "bad.json", mutated(base, mutate))
    args = ["show", str(path)] if command == "show" else \
        ["bench", "--model", CONFIG, "--device", "cpu", "--input-len", "8", "--output-len", "2",
         "--num-prompts", "1", "--force", "--schedule", str(path)]
    refused(args, str(path), field)
