"""Malformed JSONL workloads, config.json files, checkpoint folders and tokenizers through the
real `nanosched bench` and `generate`: each is refused with exit 2 and one line naming the file
(and the line or field), before any model is built, and none ends in a traceback (issue 18)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hostile import RUNNER, refused
from repo import DATA

from nanosched.cli import app

CONFIG = json.loads((DATA / "tiny_llama_config.json").read_text())
VOCAB = CONFIG["vocab_size"]

GOOD = b'{"prompt_len": 4, "output_len": 2}\n'
WORKLOADS = [
    ("not-utf8", GOOD + b'{"prompt_len": 4, "output_len": 2, "x": "\xff"}\n', ":2:", "UTF-8"),
    ("bad-json", GOOD + b"{oops\n", ":2:", "not valid JSON"),
    ("empty-line", GOOD + b"\n" + GOOD, ":2:", "empty line"),
    ("deep", b"[" * 100_000 + b"]" * 100_000 + b"\n", ":1:", "nested too deep"),
    ("array", b"[1, 2]\n", ":1:", "expected an object"),
    ("ids-str", b'{"prompt_ids": ["a"], "output_len": 2}\n', ":1:", "prompt_ids[0]"),
    ("ids-float", b'{"prompt_ids": [1.5], "output_len": 2}\n', ":1:", "prompt_ids[0]"),
    ("ids-bool", b'{"prompt_ids": [1, true], "output_len": 2}\n', ":1:", "prompt_ids[1]"),
    ("ids-negative", b'{"prompt_ids": [-1], "output_len": 2}\n', ":1:", "prompt_ids[0]"),
    ("ids-over-vocab", b'{"prompt_ids": [%d], "output_len": 2}\n' % VOCAB, ":1:",
     "prompt_ids[0]"),
    ("ids-object", b'{"prompt_ids": {}, "output_len": 2}\n', ":1:", "prompt_ids"),
    ("ids-empty", b'{"prompt_ids": [], "output_len": 2}\n', ":1:", "prompt_ids"),
    ("len-huge", b'{"prompt_len": 1000000000000, "output_len": 2}\n', ":1:", "context"),
    ("len-str", b'{"prompt_len": "4", "output_len": 2}\n', ":1:", "prompt_len"),
    ("len-inf", b'{"prompt_len": Infinity, "output_len": 2}\n', ":1:", "prompt_len"),
    ("out-zero", b'{"prompt_len": 4, "output_len": 0}\n', ":1:", "output_len"),
    ("out-float", b'{"prompt_len": 4, "output_len": 2.0}\n', ":1:", "output_len"),
    ("out-missing", b'{"prompt_len": 4}\n', ":1:", "output_len"),
    ("unknown-field", b'{"prompt_len": 4, "output_len": 2, "temperature": 1}\n', ":1:",
     "temperature"),
    ("no-requests", b"", "", "no requests"),
]


@pytest.mark.parametrize("raw, line, why", [w[1:] for w in WORKLOADS],
                         ids=[w[0] for w in WORKLOADS])
def test_bench_refuses_malformed_workload(tmp_path, raw, line, why):
    path = tmp_path / "w.jsonl"
    path.write_bytes(raw)
    refused(["bench", "--model", str(DATA / "tiny_llama_config.json"), "--device", "cpu",
             "--workload", str(path), "--num-prompts", "1"], f"{path}{line}", why)


def test_bench_runs_the_good_workload(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_bytes(GOOD)
    r = RUNNER.invoke(app, ["bench", "--model", str(DATA / "tiny_llama_config.json"),
                            "--device", "cpu", "--workload", str(path), "--num-prompts", "1"])
    assert r.exit_code == 0, r.output


CONFIGS = [
    ("hidden-str", {"hidden_size": "64"}, "hidden_size"),
    ("layers-zero", {"num_hidden_layers": 0}, "num_layers"),
    ("context-absurd", {"max_position_embeddings": 10**18}, "max_position_embeddings"),
    ("context-float", {"max_position_embeddings": 4096.5}, "max_position_embeddings"),
    ("vocab-huge", {"vocab_size": 10**12}, "vocab_size"),
    ("heads-zero", {"num_attention_heads": 0}, "num_heads"),
    ("eps-str", {"rms_norm_eps": "tiny"}, "rms_norm_eps"),
    ("eps-nan", {"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ("theta-inf", {"rope_theta": float("inf")}, "rope_theta"),
    ("theta-list", {"rope_theta": [1]}, "rope_theta"),
    ("rope-scaling-str", {"rope_scaling": "yarn"}, "rope_scaling"),
    ("tie-str", {"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    ("archs-str", {"architectures": "LlamaForCausalLM"}, None),
    ("archs-int", {"architectures": [3]}, "architectures"),
]


def _folder(tmp_path: Path, config: object | bytes) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    raw = config if isinstance(config, bytes) else json.dumps(config).encode()
    (folder / "config.json").write_bytes(raw)
    return folder


def _generate(folder: Path) -> list[str]:
    return ["generate", "--model", str(folder), "--prompt-ids", "1,2", "--max-tokens", "1"]


@pytest.mark.parametrize("change, field", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_generate_refuses_malformed_config(tmp_path, change, field):
    folder = _folder(tmp_path, {**CONFIG, **change})
    if field is None:  # a single architecture as a string is what some configs write: accepted
        assert RUNNER.invoke(app, _generate(folder)).exit_code == 0
        return
    refused(_generate(folder), str(folder), field)


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe", b"[1]", b"{" * 100_000],
                         ids=["empty", "not-utf8", "list", "deep"])
def test_generate_refuses_garbage_config(tmp_path, raw):
    folder = _folder(tmp_path, raw)
    refused(_generate(folder), str(folder / "config.json"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny HF llama checkpoint (config.json + model.safetensors) that loads."""
    from hf_models import make_hf

    folder = tmp_path_factory.mktemp("hf") / "good"
    make_hf("llama", folder, num_hidden_layers=1)
    assert RUNNER.invoke(app, _generate(folder)).exit_code == 0
    return folder


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))


def _truncate(folder: Path, keep: float) -> None:
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:int(len(raw) * keep)])


def _index(folder: Path, weight_map: object) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _shard_elsewhere(folder: Path) -> None:
    outside = folder.parent / "elsewhere.safetensors"
    shutil.move(folder / "model.safetensors", outside)
    _index(folder, {"model.norm.weight": "../elsewhere.safetensors"})


def _link_out(folder: Path) -> None:
    outside = folder.parent / "outside.safetensors"
    shutil.move(folder / "model.safetensors", outside)
    (folder / "model.safetensors").symlink_to(outside)
    _index(folder, {"model.norm.weight": "model.safetensors"})


def _index_without_shards(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    _index(folder, {"model.norm.weight": "model.safetensors"})


def _header(folder: Path, header: bytes) -> None:
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)


CHECKPOINTS = [
    ("truncated-half", lambda f: _truncate(f, 0.5), "model.safetensors", "truncated"),
    ("truncated-header", lambda f: _truncate(f, 0.001), "model.safetensors", "truncated"),
    ("empty-file", lambda f: _truncate(f, 0), "model.safetensors", "truncated"),
    ("header-garbage", lambda f: _header(f, b"\xff" * 32), "model.safetensors", "JSON"),
    ("header-list", lambda f: _header(f, b"[1, 2]"), "model.safetensors", "object"),
    ("header-bad-dtype", lambda f: _header(
        f, b'{"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}'), "'a'", "dtype"),
    ("header-bad-shape", lambda f: _header(
        f, b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}'), "'a'", "shape"),
    ("index-garbage", lambda f: (f / "model.safetensors.index.json").write_bytes(b"{nope"),
     "model.safetensors.index.json", "JSON"),
    ("index-not-utf8", lambda f: (f / "model.safetensors.index.json").write_bytes(b"\xff"),
     "model.safetensors.index.json", "UTF-8"),
    ("index-no-map", lambda f: (f / "model.safetensors.index.json").write_text("{}"),
     "model.safetensors.index.json", "weight_map"),
    ("index-map-list", lambda f: _index(f, ["model.safetensors"]),
     "model.safetensors.index.json", "weight_map"),
    ("index-map-int", lambda f: _index(f, {"model.norm.weight": 3}),
     "model.safetensors.index.json", "weight_map"),
    ("index-missing-shard", lambda f: _index(f, {"model.norm.weight": "shard-2.safetensors"}),
     "model.safetensors.index.json", "missing file"),
    ("index-parent-path", _shard_elsewhere, "model.safetensors.index.json", "outside"),
    ("index-absolute-path", lambda f: _index(f, {"model.norm.weight": "/etc/passwd"}),
     "model.safetensors.index.json", "outside"),
    ("index-symlink-out", _link_out, "model.safetensors.index.json", "outside"),
    ("index-but-no-shards", _index_without_shards, "index", "missing file"),
    ("pickle-only", lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"),
     "pytorch_model.bin", "safetensors only"),
    ("tokenizer-garbage", lambda f: (f / "tokenizer.json").write_bytes(b"\x00garbage{"),
     "tokenizer", "cannot be loaded"),
    ("tokenizer-config-garbage", lambda f: (f / "tokenizer_config.json").write_text("[1, 2"),
     "tokenizer", "cannot be loaded"),
]


@pytest.mark.parametrize("damage, name, why", [c[1:] for c in CHECKPOINTS],
                         ids=[c[0] for c in CHECKPOINTS])
def test_generate_refuses_damaged_checkpoint(checkpoint, tmp_path, damage, name, why):
    folder = _copy(checkpoint, tmp_path)
    damage(folder)
    args = _generate(folder)
    if name == "tokenizer":  # the tokenizer is read for a text prompt
        args = ["generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "1"]
    refused(args, str(folder), name, why)


def test_weights_flag_checks_the_folder_too(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path)
    _truncate(folder, 0.5)
    refused(["bench", "--model", str(folder / "config.json"), "--weights", str(folder),
             "--device", "cpu", "--input-len", "4", "--output-len", "1", "--num-prompts", "1"],
            str(folder), "truncated")


@pytest.mark.parametrize("make, why", [
    (lambda p: p.mkdir(), "is a folder, not a JSONL file"),
    (lambda p: __import__("os").mkfifo(p), "is a FIFO (named pipe), not a regular file"),
    (lambda p: p.symlink_to("/dev/null"), "is a character device, not a regular file"),
], ids=["folder", "fifo", "device"])
def test_bench_names_a_workload_that_exists_but_is_no_file(tmp_path, make, why):
    """Issue 45: these said "no such file" though the path exists (and a FIFO is not read)."""
    path = tmp_path / "w.jsonl"
    make(path)
    refused(["bench", "--model", str(DATA / "tiny_llama_config.json"), "--device", "cpu",
             "--workload", str(path), "--num-prompts", "1"], str(path), why)
