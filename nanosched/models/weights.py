"""Seeded random weights for benchmarks, at scales that keep activations finite in bf16.

Linear weights are N(0, 1/fan_in) so every projection keeps unit variance; the O and down
projections are further divided by sqrt(2 L) (GPT-2's residual scaling) so the residual stream
grows little over many layers; norms are 1, the embedding N(0, 1). Each parameter draws from
its own generator seeded by (seed, parameter name, tp rank), directly on the parameter's device.
"""

from __future__ import annotations

import math
import zlib

import torch

from nanosched.models.model import CausalLM
from nanosched.models.quant import FP8_DTYPE, quantize_into


def _std(name: str, model: CausalLM) -> float | None:
    """Standard deviation of parameter `name`; None for a norm weight (filled with ones)."""
    spec = model.spec
    depth = math.sqrt(2 * spec.num_layers)
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("attn_norm", "ffn_norm", "final_norm"):
        return None
    table = {
        "embed_tokens": 1.0,
        "lm_head": 1 / math.sqrt(spec.hidden_size),
        "w_qkv": 1 / math.sqrt(spec.hidden_size),
        "b_qkv": 0.1,
        "w_o": 1 / math.sqrt(spec.q_size) / depth,
        "router": 1 / math.sqrt(spec.hidden_size),
        "w_gate_up": 1 / math.sqrt(spec.hidden_size),
        "w_down": 1 / math.sqrt(spec.intermediate_size) / depth,
    }
    return table[leaf]


@torch.no_grad()
def init_random(model: CausalLM, seed: int = 0) -> None:
    """Fill every parameter of `model` with seeded random values (see module docstring). An
    e4m3 weight draws the same values in fp32, one weight at a time, and is quantised with its
    row scales (`{name}_scale`): no model-dtype copy of the model is ever held."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name.endswith("_scale"):
            continue  # written with its weight
        std = _std(name, model)
        if std is None:
            param.fill_(1.0)
            continue
        key = zlib.crc32(f"{seed}:{name}:{model.tp.rank}".encode())
        gen = torch.Generator(device=param.device).manual_seed(key)
        if param.dtype == FP8_DTYPE:
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            quantize_into(values.normal_(0.0, std, generator=gen), param, params[name + "_scale"])
        else:
            param.normal_(0.0, std, generator=gen)
    if model.local.vocab * model.tp.size > model.spec.vocab_size:
        _zero_vocab_padding(model)


def _zero_vocab_padding(model: CausalLM) -> None:
    """Rows past the vocabulary (padding of the last vocab shard) stay zero."""
    valid = max(0, model.spec.vocab_size - model.local.vocab_start)
    model.embed_tokens[valid:].zero_()
    model.lm_head[valid:].zero_()
