"""Rotary-embedding tables: cos and sin of position × frequency, [max_pos, d/2] fp32.

Frequencies are HF's (`1 / theta^(2i/d)`), optionally rescaled by Llama-3.1's "llama3" rope
scaling; other scaling types are refused with a ConfigError.
"""

from __future__ import annotations

import math

import torch

from nanosched.errors import ConfigError
from nanosched.models.spec import ModelSpec


def inv_frequencies(spec: ModelSpec) -> torch.Tensor:
    """[d/2] fp32 inverse frequencies, with the spec's rope scaling applied."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = spec.rope_scaling
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3_scaling(inv, scaling)
    raise ConfigError(f"model {spec.name!r}: rope scaling type {kind!r} is not supported; "
                      f"supported: default, llama3")


def _llama3_scaling(inv: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama-3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, blended, scaled)


def rope_tables(spec: ModelSpec, device: torch.device | str = "cpu",
                max_positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_pos, d/2] fp32, for positions 0..max_pos-1."""
    n = max_positions or spec.max_position_embeddings
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_frequencies(spec))
    return freqs.cos().to(device), freqs.sin().to(device)
