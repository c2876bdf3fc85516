"""Kernel dispatch: the one place that chooses the torch reference or the Triton kernel.

Models call only these functions. `KernelOptions.backend` is "auto" (Triton for CUDA tensors
when triton imports, torch otherwise), "torch" or "triton" (Triton even for CPU tensors, which
needs TRITON_INTERPRET=1). GEMMs use torch (cuBLAS) unless `gemm="triton"` picks the persistent
Triton GEMM. Per-launch arguments (`launch` dicts) carry SM-footprint knobs from the runtime:
`max_ctas` / `num_splits` for decode attention, `num_sms` (and tiles) for the Triton GEMM.

triton is imported lazily, the first time a Triton kernel is used, so `import nanosched.models`
works on machines without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.kernels import reference as ref
from nanosched.kernels.common import is_interpret

BACKENDS = ("auto", "torch", "triton")
GEMM_IMPLS = ("torch", "triton")


@dataclass(frozen=True)
class KernelOptions:
    """Which implementation the models' ops launch."""

    backend: str = "auto"  # auto | torch | triton
    gemm: str = "torch"  # torch (cuBLAS/CPU BLAS) | triton (persistent GEMM)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"kernel backend {self.backend!r} is not one of {BACKENDS}")
        if self.gemm not in GEMM_IMPLS:
            raise ConfigError(f"gemm implementation {self.gemm!r} is not one of {GEMM_IMPLS}")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether triton imports on this machine."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(opts: KernelOptions, x: torch.Tensor) -> bool:
    """Whether an op on tensor `x` runs the Triton kernel under `opts`."""
    if opts.backend == "torch":
        return False
    if opts.backend == "triton":
        if not triton_available():
            raise ConfigError("kernel backend 'triton' needs the triton package; "
                              "install nanosched[gpu] or use backend 'torch'")
        if x.device.type != "cuda" and not is_interpret():
            raise ConfigError("kernel backend 'triton' on CPU tensors needs TRITON_INTERPRET=1")
        return True
    return x.device.type == "cuda" and triton_available()


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           opts: KernelOptions, launch: dict[str, Any] | None = None) -> None:
    """out = x @ w.T (+ bias). x [n, K], w [N, K], out [n, N]."""
    if opts.gemm == "triton" and use_triton(KernelOptions("triton"), x):
        from nanosched.kernels.gemm import GemmConfig, persistent_linear

        persistent_linear(x, w, bias, out, GemmConfig(**(launch or {})))
    else:
        ref.linear(x, w, bias, out)


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor, residual_out: torch.Tensor,
                 opts: KernelOptions) -> None:
    """residual_out = x (+ residual); out = RMSNorm(residual_out) * weight. All [n, D]."""
    if use_triton(opts, x):
        from nanosched.kernels.elementwise import rms_norm_add as kernel

        kernel(x, residual, weight, eps, out, residual_out)
    else:
        ref.rms_norm_add(x, residual, weight, eps, out, residual_out)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor, opts: KernelOptions) -> None:
    """out [n, I] = SiLU(gate_up[:, :I]) * gate_up[:, I:]."""
    if use_triton(opts, gate_up):
        from nanosched.kernels.elementwise import silu_mul as kernel

        kernel(gate_up, out)
    else:
        ref.silu_mul(gate_up, out)


def rope_append(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                sin_table: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, q_out: torch.Tensor, opts: KernelOptions) -> None:
    """Rotary embedding of q and k; q → q_out [n, Hq, d], k and v → the paged cache."""
    if use_triton(opts, qkv):
        from nanosched.kernels.elementwise import rope_append as kernel

        kernel(qkv, positions, cos_table, sin_table, slot_mapping, k_cache, v_cache, q_out)
    else:
        ref.rope_append(qkv, positions, cos_table, sin_table, slot_mapping, k_cache, v_cache,
                        q_out)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     max_context_len: int, scale: float, out: torch.Tensor,
                     opts: KernelOptions, launch: dict[str, Any] | None = None) -> None:
    """Paged GQA decode attention. q, out [n, Hq, d]; launch: max_ctas, num_splits."""
    if use_triton(opts, q):
        from nanosched.kernels.decode_attn import decode_attention as kernel

        kernel(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, out,
               **(launch or {}))
    else:
        ref.decode_attention(q, k_cache, v_cache, block_tables, context_lens, max_context_len,
                             scale, out)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, segments: list[tuple[int, int, int]],
                      scale: float, out: torch.Tensor) -> None:
    """Chunked causal prefill attention (torch SDPA on every device)."""
    ref.prefill_attention(q, k_cache, v_cache, block_tables, segments, scale, out)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor,
                   x_rows: torch.Tensor | None, out: torch.Tensor) -> None:
    """MoE grouped GEMM: out[i] = x[x_rows[i]] @ w[expert_ids[i]].T (torch loop over experts)."""
    ref.grouped_linear(x, w, expert_ids, x_rows, out)
