"""`nanosched generate`: ids, JSON, random weights, tokenizer text, errors → exit 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_models import make_hf
from typer.testing import CliRunner

from nanosched.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    hf = make_hf("llama", folder, seed=30, eos_token_id=None)
    return folder, hf


def test_generate_json_matches_hf_greedy(tiny):
    folder, hf = tiny
    r = runner.invoke(app, ["generate", "--model", str(folder), "--prompt-ids", "5,9,2,77",
                            "--max-tokens", "6", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    seq = [5, 9, 2, 77]
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out["prompt_ids"] == [5, 9, 2, 77] and out["output_ids"] == seq[4:]
    assert out["text"] is None


def test_generate_prints_ids_and_sampling_is_seeded(tiny):
    folder, _ = tiny
    args = ["generate", "--model", str(folder), "--prompt-ids", "1,2", "--max-tokens", "8",
            "--temperature", "1.5", "--seed", "3"]
    a, b = runner.invoke(app, args), runner.invoke(app, args)
    assert a.exit_code == 0 and a.output == b.output
    assert len(a.output.split()) == 8


def test_config_without_weights_runs_on_random_weights(tmp_path):
    make_hf("llama", tmp_path, num_hidden_layers=1)
    (tmp_path / "model.safetensors").unlink()
    r = runner.invoke(app, ["generate", "--model", str(tmp_path / "config.json"),
                            "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"])
    assert r.exit_code == 0, r.output
    assert "using random weights (seed 0)" in r.stderr
    assert len(json.loads(r.stdout)["output_ids"]) == 4


def test_prompt_text_through_the_checkpoint_tokenizer(tiny, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = shutil.copytree(tiny[0], tmp_path / "with_tokenizer")
    vocab = {f"w{i}": i for i in range(256)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(folder)
    r = runner.invoke(app, ["generate", "--model", str(folder), "--prompt", "w5 w9 w2",
                            "--max-tokens", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["prompt_ids"] == [5, 9, 2]
    assert out["text"].split() == [f"w{i}" for i in out["output_ids"]]


def test_unknown_device_is_refused():
    r = runner.invoke(app, ["generate", "--model", "llama3-8b", "--prompt-ids", "1",
                            "--device", "tpu"])
    assert r.exit_code == 2 and "--device must be cpu or cuda, got 'tpu'" in r.output


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hello"], "--prompt needs a tokenizer"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1,999"], "token 999 is outside the vocabulary 0..255"),
    (["--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--prompt-ids", "1", "--max-tokens", "300"], "exceeds the model's 256 positions"),
    (["--prompt-ids", "1", "--tp", "3"], "--tp 3 does not divide"),
    ([], "give exactly one of --prompt TEXT and --prompt-ids"),
])
def test_generate_bad_inputs_exit_2(tiny, args, message):
    r = runner.invoke(app, ["generate", "--model", str(tiny[0]), *args])
    assert r.exit_code == 2, r.output
    assert message in r.output
