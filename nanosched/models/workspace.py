"""Preallocated full-batch buffers that the ops of every layer read and write.

Each op reads and writes only the rows of its token range [start, end) (MoE buffers: rows
[start*k, end*k), k experts per token), so ops on disjoint ranges never touch the same memory and
nano-batches need no copies. The buffers are shared by all layers: the dependency order of the
op graph (same rows, earlier op first) is what keeps them consistent.

Legend: T = max tokens, D = hidden, Hq/Hkv = local heads, d = head dim, I = local intermediate,
k = experts per token (1 for a dense FFN).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanosched.models.kvcache import KVCache


@dataclass(eq=False)
class Workspace:
    """Activation buffers of one model instance plus its paged KV cache."""

    max_tokens: int
    token_ids: torch.Tensor  # [T] int64, filled by the caller before `embed`
    residual: torch.Tensor  # [T, D] the residual stream
    normed: torch.Tensor  # [T, D] RMSNorm output: input of kqv / ug / LM head
    qkv: torch.Tensor  # [T, (Hq + 2 Hkv) d]
    q: torch.Tensor  # [T, Hq, d] rotated queries
    attn: torch.Tensor  # [T, Hq, d] attention output
    o_out: torch.Tensor  # [T, D] O projection (partial sum under tp until ar_attn)
    gate_up: torch.Tensor  # [T k, 2I]
    act: torch.Tensor  # [T k, I]
    ffn_out: torch.Tensor  # [T, D] FFN output (partial sum under tp until ar_ffn)
    expert_out: torch.Tensor | None  # [T k, D] MoE: each (token, expert) down projection
    expert_ids: torch.Tensor | None  # [T k] int64 MoE: chosen experts, token-major
    expert_weights: torch.Tensor | None  # [T k] fp32 MoE: their normalised router weights
    kv: KVCache
    experts_per_token: int = 1
    # FP8 GEMM inputs (models/quant.py), None in a model without e4m3 weights: e4m3 rows and
    # one fp32 scale per row of the normed stream (kqv / ug / experts_ug), the attention output
    # (o) and act (d / experts_d)
    normed8: torch.Tensor | None = None  # [T, D]
    normed_scale: torch.Tensor | None = None  # [T]
    attn8: torch.Tensor | None = None  # [T, Hq d]
    attn_scale: torch.Tensor | None = None  # [T]
    act8: torch.Tensor | None = None  # [T k, I]
    act_scale: torch.Tensor | None = None  # [T k]

    def rows(self, start: int, end: int) -> slice:
        """Rows of the per-(token, expert) buffers that hold tokens [start, end)."""
        return slice(start * self.experts_per_token, end * self.experts_per_token)


def allocate_workspace(*, max_tokens: int, hidden: int, qkv_size: int, num_heads: int,
                       head_dim: int, intermediate: int, experts_per_token: int,
                       is_moe: bool, kv: KVCache | None, dtype: torch.dtype,
                       device: torch.device | str,
                       reduced: Callable[..., torch.Tensor] | None = None,
                       fp8: bool = False) -> Workspace:
    """Allocate every buffer for up to `max_tokens` tokens (see `CausalLM.new_workspace`);
    `reduced(*shape, dtype=, device=)` allocates the two buffers all-reduces run in (o_out,
    ffn_out), e.g. `TensorParallel.symmetric_zeros` for the copy-engine all-reduce; `fp8` adds
    the e4m3 GEMM inputs; `kv` None only for buffers sized on the meta device."""
    t, k = max_tokens, experts_per_token

    def buf(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dt, device=device)

    def shared(*shape: int) -> torch.Tensor:
        return buf(*shape) if reduced is None else reduced(*shape, dtype=dtype, device=device)

    f8 = torch.float8_e4m3fn
    quant = {} if not fp8 else {
        "normed8": buf(t, hidden, dt=f8), "normed_scale": buf(t, dt=torch.float32),
        "attn8": buf(t, num_heads * head_dim, dt=f8), "attn_scale": buf(t, dt=torch.float32),
        "act8": buf(t * k, intermediate, dt=f8), "act_scale": buf(t * k, dt=torch.float32)}
    return Workspace(
        **quant, max_tokens=t, token_ids=buf(t, dt=torch.int64), residual=buf(t, hidden),
        normed=buf(t, hidden), qkv=buf(t, qkv_size), q=buf(t, num_heads, head_dim),
        attn=buf(t, num_heads, head_dim), o_out=shared(t, hidden),
        gate_up=buf(t * k, 2 * intermediate), act=buf(t * k, intermediate),
        ffn_out=shared(t, hidden),
        expert_out=buf(t * k, hidden) if is_moe else None,
        expert_ids=buf(t * k, dt=torch.int64) if is_moe else None,
        expert_weights=buf(t * k, dt=torch.float32) if is_moe else None,
        kv=kv, experts_per_token=k)
