"""Shapes of each op on one GPU at tensor parallelism tp, and their work. Pure Python.

GEMMs are `x @ w.T` with x [T, K] and w [N, K] (torch.nn.functional.linear's layout). MoE
GEMMs are E experts' [T k / E, K] x [K, N] with uniform routing. Legend in models/spec.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanosched.errors import ConfigError
from nanosched.models.spec import ModelSpec

GEMM_OPS = ("kqv", "o", "ug", "d", "experts_ug", "experts_d")


@dataclass(frozen=True)
class HeadShape:
    """Attention heads on one GPU: query heads, KV heads (at least one), head dim."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def heads(spec: ModelSpec, tp: int) -> HeadShape:
    return HeadShape(spec.num_heads // tp, max(1, spec.num_kv_heads // tp), spec.head_dim)


def gemm_dims(spec: ModelSpec, tp: int, op: str) -> tuple[int, int]:
    """(K, N) of GEMM op `op` on one of `tp` GPUs: x [T, K] times w.T, w [N, K]."""
    h = heads(spec, tp)
    D, inter = spec.hidden_size, spec.intermediate_size // tp
    dims = {
        "kqv": (D, (h.num_heads + 2 * h.num_kv_heads) * h.head_dim),
        "o": (h.num_heads * h.head_dim, D),
        "ug": (D, 2 * inter), "experts_ug": (D, 2 * inter),
        "d": (inter, D), "experts_d": (inter, D),
    }
    if op not in dims:
        raise ConfigError(f"op {op!r} is not a GEMM; GEMMs: {', '.join(GEMM_OPS)}")
    return dims[op]


def gemm_rows(spec: ModelSpec, op: str, tokens: int) -> int:
    """Rows of x: tokens, or token-expert pairs for MoE GEMMs."""
    return tokens * spec.num_experts_per_tok if op.startswith("experts_") else tokens


def gemm_flops(spec: ModelSpec, tp: int, op: str, tokens: int) -> float:
    k, n = gemm_dims(spec, tp, op)
    return 2.0 * gemm_rows(spec, op, tokens) * k * n


def decode_kv_bytes(spec: ModelSpec, tp: int, requests: int, context: int) -> float:
    """Bytes of K and V that decode attention reads for `requests` at `context` each."""
    h = heads(spec, tp)
    return 2.0 * requests * context * h.num_kv_heads * h.head_dim * spec.dtype_bytes


def op_bytes(spec: ModelSpec, tp: int, op: str, tokens: int, context: int) -> float:
    """Bytes an op moves (reads + writes) on one GPU: what bounds memory-bound ops."""
    S, D = spec.dtype_bytes, spec.hidden_size
    h = heads(spec, tp)
    if op in GEMM_OPS:
        k, n = gemm_dims(spec, tp, op)
        experts = min(spec.num_experts, tokens * spec.num_experts_per_tok) if spec.is_moe else 1
        rows = gemm_rows(spec, op, tokens)
        return float(S * (experts * k * n + rows * k + rows * n))
    if op == "attn_decode":
        return decode_kv_bytes(spec, tp, tokens, context) + 2.0 * tokens * h.num_heads * \
            h.head_dim * S
    if op == "attn_prefill":
        return 4.0 * tokens * (h.num_heads + 2 * h.num_kv_heads) * h.head_dim * S
    if op == "rope_append":
        return 2.0 * tokens * (h.num_heads + 2 * h.num_kv_heads) * h.head_dim * S
    if op in ("add_norm_ffn", "add_norm_attn"):
        return 4.0 * tokens * D * S
    if op == "act":
        return 3.0 * tokens * max(1, spec.num_experts_per_tok) * spec.intermediate_size // tp * S
    raise ConfigError(f"no shape for op {op!r}")
