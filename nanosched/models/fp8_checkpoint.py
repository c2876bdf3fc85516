"""FP8 checkpoints as users have them, read into the model's e4m3 weights with row scales.

Formats: compressed-tensors `float-quantized` (llm-compressor's FP8 and FP8_DYNAMIC: weights
e4m3 with `weight_scale` per channel [N, 1] or per tensor), and `quant_method: "fp8"` (per-tensor
`weight_scale`, or block-wise `weight_block_size` [b, b] with `weight_scale_inv`
[ceil(N/b), ceil(K/b)]). Every scale multiplies: value = e4m3 * scale. A per-tensor scale is
the same row scale on every row; block scales become row scales by dequantising a slice and
quantising its rows again (one more rounding, within e4m3's step). Static activation scales
(`input_scale`) are accepted and not used: activations get dynamic per-token scales, as
FP8_DYNAMIC's do. An e4m3 tensor where the model keeps its dtype (MoE experts, a module the
checkpoint's `ignore` list left out) is dequantised. The config's fields are checked here (a
handful of keys; the compressed-tensors package would add transformers and pydantic to every
install for them); anything else (int8/int4, other strategies) is refused naming the field.
"""

from __future__ import annotations

from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.kernels.reference import quantize_fp8

COMPANIONS = (".weight_scale", ".weight_scale_inv", ".input_scale")
KV_SCALES = (".k_scale", ".v_scale")  # a compressed-tensors FP8 KV scheme's static scales


def check_config(qc: Any, where: str) -> None:
    """Refuse a `quantization_config` whose weights are not FP8 in a layout read here."""
    field = f"{where}: field 'quantization_config"
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2
                                  or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"{field}.weight_block_size' is {block!r}; expected [rows, cols]")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ConfigError(f"{field}.activation_scheme' is {scheme!r}; expected dynamic or "
                              f"static")
        return
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise ConfigError(f"{field}.format' is {fmt!r}; nanosched reads compressed-tensors "
                          f"'float-quantized' (FP8) checkpoints only")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{field}.config_groups' must be a non-empty object")
    for name, group in groups.items():
        at = f"{field}.config_groups.{name}"
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ConfigError(f"{at}.weights' must be an object")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ConfigError(f"{at}.weights' is {weights.get('num_bits')}-bit "
                              f"{weights.get('type')}; nanosched runs 8-bit float (FP8) weights")
        if weights.get("strategy") not in ("channel", "tensor", "block"):
            raise ConfigError(f"{at}.weights.strategy' is {weights.get('strategy')!r}; "
                              f"expected channel, tensor or block")
        acts = group.get("input_activations")
        if acts is not None and (acts.get("type") != "float" or acts.get("num_bits") != 8):
            raise ConfigError(f"{at}.input_activations' is {acts.get('num_bits')}-bit "
                              f"{acts.get('type')}; nanosched quantises activations to FP8")


def is_companion(name: str, weight_names: set[str]) -> bool:
    """Whether `name` is a scale stored beside one of `weight_names` (or a KV-cache scale,
    unused: the FP8 cache's scales are dynamic per token and head)."""
    for suffix in COMPANIONS:
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight" in weight_names
    return name.endswith(KV_SCALES)


def e4m3_rows(source: Any, name: str, value: torch.Tensor, rows: tuple[int, int] | None,
              cols: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 slice `value` (rows / cols of weight `name`) and one scale per row of it, from
    the scale stored beside the weight."""
    base = name.removesuffix(".weight")
    names = source.names()
    n = value.shape[0]
    if base + ".weight_scale" in names:
        shape = source.shape(base + ".weight_scale")
        if len(shape) == 0 or shape in ((1,), (1, 1)):  # per tensor
            scale = source.read(base + ".weight_scale", None, None).float().reshape(1)
            return value, scale.expand(n).clone()
        if shape[0] != source.shape(name)[0] or (len(shape) == 2 and shape[1] != 1):
            raise ConfigError(f"checkpoint: tensor {base + '.weight_scale'!r} has shape "
                              f"{list(shape)}; expected one scale per output channel "
                              f"[{source.shape(name)[0]}, 1] or one for the tensor")
        return value, source.read(base + ".weight_scale", rows, None).float().reshape(n)
    if base + ".weight_scale_inv" in names:
        return quantize_fp8(_dequantize_blocks(source, base + ".weight_scale_inv", name, value,
                                               rows, cols))
    raise ConfigError(f"checkpoint: tensor {name!r} is e4m3 but no {base + '.weight_scale'!r} "
                      f"or {base + '.weight_scale_inv'!r} is stored beside it")


def _dequantize_blocks(source: Any, scale_name: str, name: str, value: torch.Tensor,
                       rows: tuple[int, int] | None,
                       cols: tuple[int, int] | None) -> torch.Tensor:
    """fp32 values of a block-quantised slice: each element times its block's scale."""
    full_n, full_k = source.shape(name)
    sn, sk = source.shape(scale_name)
    bn, bk = -(-full_n // sn), -(-full_k // sk)  # the block's rows and columns
    r0, r1 = rows or (0, full_n)
    c0, c1 = cols or (0, full_k)
    blocks = source.read(scale_name, (r0 // bn, -(-r1 // bn)), (c0 // bk, -(-c1 // bk)))
    grid = blocks.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    grid = grid[r0 % bn:r0 % bn + r1 - r0, c0 % bk:c0 % bk + c1 - c0]
    return value.float() * grid
