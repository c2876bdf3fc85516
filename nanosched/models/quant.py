"""Weight quantisation: which layer weights are e4m3 (W8A8 on Hopper), and how they are made.

`fp8`: each layer GEMM's weight [N, K] (MoE experts: [E, N, K]) is e4m3 with one fp32 scale
per output row (a per-tensor checkpoint scale is the same value on every row), its input e4m3
with one dynamic scale per token, written by the kernel that produces it (RMSNorm, SiLU·mul; the
attention output, and a MoE layer's normed rows, which its router reads in the model dtype, by a
one-pass kernel before the GEMM), and the product in the model dtype. The embedding, LM head,
norms and router stay in the model dtype. `auto` follows the checkpoint's `quantization_config`
(none for random weights and plain checkpoints).
"""

from __future__ import annotations

from pathlib import Path

import torch

from nanosched import constants
from nanosched.errors import ConfigError
from nanosched.fileio import read_json
from nanosched.kernels.reference import quantize_rows
from nanosched.models.ops import FP8_GEMM_OPS, GEMM_WEIGHT, layer_ops
from nanosched.models.spec import ModelSpec

AUTO, NONE, FP8 = "auto", "none", "fp8"
QUANTIZATION_FLAGS = (AUTO, *constants.QUANTIZATIONS)  # what --quantization accepts: auto too
FP8_DTYPE = torch.float8_e4m3fn


def check_quantization(name: str, allow_auto: bool = False) -> str:
    """`name` when it is a quantisation the model runs (`auto` too where `allow_auto`)."""
    allowed = QUANTIZATION_FLAGS if allow_auto else constants.QUANTIZATIONS
    if name not in allowed:
        raise ConfigError(f"--quantization must be one of {', '.join(allowed)}; got {name!r}")
    return name


def check_model_dtype(quantization: str, dtype: torch.dtype) -> None:
    """Refuse fp8 weights in a float16 model: the GEMMs with row scales write bfloat16."""
    if quantization == FP8 and dtype == torch.float16:
        raise ConfigError("--dtype float16 with --quantization fp8: the FP8 GEMMs with row "
                          "scales write bfloat16; use --dtype auto or bfloat16")


FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) on


def check_fp8_device(quantization: str, device: torch.device | str) -> None:
    """Refuse fp8 weights on a GPU without FP8 tensor cores (before Ada), where the W8A8 GEMMs
    would fail at the first forward; the CPU runs the exact emulation."""
    device = torch.device(device)
    if quantization != FP8 or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"--quantization fp8 needs FP8 tensor cores (compute capability "
                          f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later: Ada, Hopper); "
                          f"{device} is {name} ({capability[0]}.{capability[1]}): use "
                          f"--quantization none and a bf16 checkpoint")


def fp8_weights(spec: ModelSpec, quantization: str) -> tuple[str, ...]:
    """The layer weights held in e4m3 under `quantization`: those of the FP8_GEMM_OPS the
    model's layer has (dense GEMMs, or MoE experts' grouped GEMMs)."""
    if check_quantization(quantization) == NONE:
        return ()
    ops = {op.name for op in layer_ops(spec)}
    return tuple(GEMM_WEIGHT[op] for op in FP8_GEMM_OPS if op in ops)


def producer_writes_e4m3(spec: ModelSpec, weight: str, e4m3: tuple[str, ...]) -> bool:
    """Whether the kernel before `weight`'s GEMM (a norm, SiLU·mul) writes that GEMM's input in
    e4m3 with row scales, `e4m3` being the e4m3 weights (`fp8_weights`): it does for each e4m3
    weight but a MoE layer's `w_gate_up`, whose normed rows the router reads in the model dtype
    (`experts_ug` quantises them itself)."""
    return weight in e4m3 and not (spec.is_moe and weight == "w_gate_up")


@torch.no_grad()
def quantize_into(w: torch.Tensor, dest: torch.Tensor, scale: torch.Tensor) -> None:
    """dest [N, K] e4m3 and scale [N] fp32 from the weight rows w [N, K] (any float dtype):
    one scale per row, its amax on e4m3's largest finite value."""
    quantize_rows(w.to(dest.device), dest, scale)


def checkpoint_quantization(folder: str | Path) -> str:
    """The quantisation a checkpoint folder's config.json declares (`quantization_config`):
    none without one, fp8 for the FP8 formats loaded here; any other method is refused."""
    config = Path(folder) / "config.json"
    data = read_json(config, "config", ConfigError) if config.is_file() else {}
    qc = data.get("quantization_config") if isinstance(data, dict) else None
    if qc is None:
        return NONE
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in CHECKPOINT_METHODS:
        raise ConfigError(f"config {config}: field 'quantization_config.quant_method' is "
                          f"{method!r}; nanosched loads {', '.join(CHECKPOINT_METHODS)} "
                          f"checkpoints (FP8) or unquantised ones")
    from nanosched.models.fp8_checkpoint import check_config

    check_config(qc, f"config {config}")
    return FP8


CHECKPOINT_METHODS = ("fp8", "compressed-tensors")


def resolve_quantization(requested: str, weights: str) -> str:
    """`--quantization` against the weights ('random' or a checkpoint folder): `auto` is the
    checkpoint's own (none for random weights); fp8 over a plain checkpoint quantises it as it
    loads; none over an FP8 checkpoint is refused (its weights are e4m3 already)."""
    check_quantization(requested, allow_auto=True)
    own = NONE if weights == "random" else checkpoint_quantization(weights)
    if requested == AUTO:
        return own
    if requested == NONE and own == FP8:
        raise ConfigError(f"checkpoint {weights} is quantised to FP8 (its config.json's "
                          f"quantization_config); --quantization none cannot serve it: use "
                          f"--quantization auto or fp8")
    return requested
