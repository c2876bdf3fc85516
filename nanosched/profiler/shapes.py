"""Shapes of each op on one GPU at tensor parallelism tp, and their work. Pure Python.

GEMMs are `x @ w.T` with x [T, K] and w [N, K] (torch.nn.functional.linear's layout). MoE
GEMMs are E experts' [T k / E, K] x [K, N] with uniform routing. Legend in models/spec.py; each
op's shape is the op table's (models/ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanosched.errors import ConfigError
from nanosched.models.ops import GEMM_OPS, GROUPED, OP_FAMILY, decode_kv_bytes, spec_of
from nanosched.models.spec import ModelSpec

__all__ = ["GEMM_OPS", "HeadShape", "decode_kv_bytes", "gemm_dims", "gemm_flops", "gemm_rows",
           "heads", "op_bytes"]



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
    entry = spec_of(op)
    if entry is None or entry.gemm is None:
        raise ConfigError(f"op {op!r} is not a GEMM; GEMMs: {', '.join(GEMM_OPS)}")
    return entry.gemm(spec, tp)


def gemm_rows(spec: ModelSpec, op: str, tokens: int) -> int:
    """Rows of x: tokens, or token-expert pairs for MoE GEMMs."""
    grouped = op in OP_FAMILY and OP_FAMILY[op] == GROUPED
    return tokens * spec.num_experts_per_tok if grouped else tokens


def gemm_flops(spec: ModelSpec, tp: int, op: str, tokens: int) -> float:
    k, n = gemm_dims(spec, tp, op)
    return 2.0 * gemm_rows(spec, op, tokens) * k * n


def op_bytes(spec: ModelSpec, tp: int, op: str, tokens: int, context: int) -> float:
    """Bytes an op moves (reads + writes) on one GPU: what bounds memory-bound ops."""
    S = spec.dtype_bytes
    if op in GEMM_OPS:
        k, n = gemm_dims(spec, tp, op)
        experts = min(spec.num_experts, tokens * spec.num_experts_per_tok) if spec.is_moe else 1
        rows = gemm_rows(spec, op, tokens)
        return float(S * (experts * k * n + rows * k + rows * n))
    entry = spec_of(op)
    if entry is None or entry.bytes is None:
        raise ConfigError(f"no shape for op {op!r}")
    return entry.bytes(spec, tp, tokens, context)
