"""Tiny HF transformers models saved as safetensors checkpoints, for equivalence tests."""

from __future__ import annotations

import math
from pathlib import Path

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights N(0, 1/fan_in) (embeddings N(0, 1), norms U(0.5, 1.5)): well-spread logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                std = 1 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.1
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def make_hf(arch: str, folder: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Build a tiny random HF model of `arch` (llama | qwen2 | mixtral) and save it to folder."""
    import transformers as tf

    kw = {**TINY, "vocab_size": 256, **overrides}
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**kw))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**kw))
    else:
        kw.setdefault("num_local_experts", 4)
        kw.setdefault("num_experts_per_tok", 2)
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**kw))
    randomize(model, seed)
    model.eval()
    model.save_pretrained(folder)
    return model


FP8_FORMATS = ("ct-channel", "ct-tensor", "fp8-tensor", "fp8-block")
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           ".w1.", ".w2.", ".w3.")


def save_fp8(folder: Path, fmt: str, block: int = 16) -> None:
    """Rewrite the checkpoint in `folder` as an FP8 checkpoint of format `fmt`: compressed-
    tensors float-quantized with per-channel (`ct-channel`) or per-tensor (`ct-tensor`) weight
    scales and dynamic token activations (llm-compressor's FP8_DYNAMIC / FP8), or
    `quant_method: fp8` with a per-tensor scale and a static input scale (`fp8-tensor`) or
    `block` x `block` blocks (`fp8-block`, `weight_scale_inv`). The LM head stays unquantised."""
    import json

    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    out = {}
    for name, t in tensors.items():
        if not (name.endswith(".weight") and any(k in name for k in _LINEAR)):
            out[name] = t
            continue
        base, w = name.removesuffix(".weight"), t.float()
        if fmt == "ct-channel":
            scale = w.abs().amax(1, keepdim=True) / 448
            out[base + ".weight_scale"] = scale
        elif fmt == "fp8-block":
            n, k = w.shape
            blocks = w.reshape(n // block, block, k // block, block).abs().amax((1, 3)) / 448
            out[base + ".weight_scale_inv"] = blocks
            scale = blocks.repeat_interleave(block, 0).repeat_interleave(block, 1)
        else:
            scale = w.abs().amax() / 448
            out[base + ".weight_scale"] = scale.reshape(1) if fmt == "ct-tensor" else scale
            if fmt == "fp8-tensor":
                out[base + ".input_scale"] = torch.tensor(0.02)
        out[name] = (w / scale).to(torch.float8_e4m3fn)
    save_file(out, path)
    config = json.loads((folder / "config.json").read_text())
    if fmt.startswith("ct-"):
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": fmt.removeprefix("ct-")}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                "strategy": "token"}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}},
            "ignore": ["lm_head"]}
    else:
        config["quantization_config"] = {
            "quant_method": "fp8", "activation_scheme": "static" if fmt == "fp8-tensor"
            else "dynamic"} | ({"weight_block_size": [block, block]} if fmt == "fp8-block"
                               else {})
    (folder / "config.json").write_text(json.dumps(config))
