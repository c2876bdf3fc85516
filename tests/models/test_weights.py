"""Checkpoint loading (sharded, errors that name the tensor) and seeded random weights."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import make_hf
from safetensors.torch import load_file, save_file

from nanosched.errors import ConfigError
from nanosched.models.checkpoint import load_checkpoint
from nanosched.models.model import CausalLM
from nanosched.models.spec import REGISTRY, ModelSpec, load_spec
from nanosched.models.weights import init_random


def test_transformers5_rope_parameters_are_read(tmp_path):
    make_hf("llama", tmp_path, num_hidden_layers=1, rope_parameters={
        "rope_type": "default", "rope_theta": 123456.0})
    assert load_spec(str(tmp_path)).rope_theta == 123456.0


def test_sharded_checkpoint_with_index_loads_like_a_single_file(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    make_hf("llama", one, seed=7)
    tensors = load_file(one / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    two.mkdir()
    for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        fname = f"model-0000{part + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, two / fname)
        weight_map.update(dict.fromkeys(chunk, fname))
    (two / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (two / "config.json").write_text((one / "config.json").read_text())
    models = []
    for folder in (one, two):
        models.append(CausalLM(load_spec(str(folder))))
        load_checkpoint(models[-1], folder)
    for (name, a), (_, b) in zip(models[0].state_dict().items(),
                                 models[1].state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(models[0].layers[1].w_qkv[64:96],
                       tensors["model.layers.1.self_attn.k_proj.weight"])


def rewrite(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
     "unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.ones(16, 64)}),
     r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \[16, 64\], "
     r"expected \[32, 64\]"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, edit, message):
    make_hf("llama", tmp_path)
    rewrite(tmp_path, edit)
    model = CausalLM(load_spec(str(tmp_path)))
    with pytest.raises(ConfigError, match=message):
        load_checkpoint(model, tmp_path)


def test_folder_without_weights_is_refused(tmp_path):
    make_hf("llama", tmp_path, num_hidden_layers=1)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors files"):
        load_checkpoint(CausalLM(load_spec(str(tmp_path))), tmp_path)


def deep_spec(arch: str) -> ModelSpec:
    base = REGISTRY["mixtral-8x7b" if arch == "mixtral" else "llama3-8b"]
    return ModelSpec(name=f"deep-{arch}", arch=arch, hidden_size=128, num_layers=48,
                     num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
                     vocab_size=512, num_experts=base.num_experts,
                     num_experts_per_tok=base.num_experts_per_tok)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_random_weights_keep_bf16_activations_finite_over_many_layers(arch):
    model = CausalLM(deep_spec(arch), dtype=torch.bfloat16)
    init_random(model, seed=11)
    ws = model.new_workspace(24, 4)
    meta = ws.kv.plan([(0, 24, False)])
    ws.token_ids[:24] = torch.arange(24) * 7
    with torch.inference_mode():
        logits = model(ws, meta).float()
    assert torch.isfinite(logits).all() and torch.isfinite(ws.residual[:24].float()).all()
    assert ws.residual[:24].float().abs().max() < 100
    assert logits.std() > 0.1  # not collapsed
    again = CausalLM(deep_spec(arch), dtype=torch.bfloat16)
    init_random(again, seed=11)
    assert torch.equal(again.layers[5].w_down, model.layers[5].w_down)
