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
