"""Implementations available before the model's own kernels: torch ops, cuBLAS, cuBLASLt with an
SM target, and the profiler's own Triton kernels (triton_kernels.py). See impls.py for the API.

- kqv, o, ug, d: `cublas` (F.linear), `cublaslt` (SM target), `triton_persistent_128x128`
  and `triton_persistent_128x256` (NUM_SMS = the SMs given)
- experts_ug, experts_d: `torch_bmm` (uniform routing)
- attn_decode: `torch_sdpa` (GQA), `triton_decode` (grid bounded: the CTAs given, or 4 per SM)
- attn_prefill: `torch_sdpa` (causal, chunks cut from `context`-token prompts)
- rope_append, add_norm_ffn, add_norm_attn, act: `torch`
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanosched.profiler.impls import (
    Impl,
    Kernel,
    OpCall,
    cublaslt_missing,
    cublaslt_sm_target,
    register,
    triton_missing,
)
from nanosched.profiler.shapes import gemm_dims, gemm_rows, heads

CTAS_PER_SM = 4  # decode attention grid when nothing bounds it
FULL_GEMM_SMS = ("full", "green_ctx")


def _rows(call: OpCall) -> int:
    return max(call.max_tokens, call.tokens)


def _linear_inputs(call: OpCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    k, n = gemm_dims(call.spec, call.tp, call.op)
    x = call.ws.tensor("x_" + call.op, (_rows(call), k))[:call.tokens]
    w = call.ws.tensor("w_" + call.op, (n, k), scale=k ** -0.5)
    bias = call.ws.tensor("b_kqv", (n,)) if call.op == "kqv" and call.spec.qkv_bias else None
    return x, w, bias


def _cublas(call: OpCall) -> Kernel:
    x, w, b = _linear_inputs(call)
    return Kernel(lambda: F.linear(x, w, b))


def _cublaslt(call: OpCall) -> Kernel:
    x, w, b = _linear_inputs(call)
    return Kernel(lambda: F.linear(x, w, b),
                  scope=lambda: cublaslt_sm_target(call.sms, call.num_sms))


def _persistent(block_n: int):  # noqa: ANN202 - returns a setup function
    def setup(call: OpCall) -> Kernel:
        from nanosched.profiler.triton_kernels import persistent_linear

        x, w, b = _linear_inputs(call)
        out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)

        def fn() -> None:
            persistent_linear(x, w, out, num_sms=call.sms, block_n=block_n)
            if b is not None:
                out.add_(b)
        return Kernel(fn)
    return setup


def _bmm(call: OpCall) -> Kernel:
    k, n = gemm_dims(call.spec, call.tp, call.op)
    e = call.spec.num_experts
    per = -(-gemm_rows(call.spec, call.op, call.tokens) // e)
    x = call.ws.tensor("x_" + call.op, (e, per, k))
    w = call.ws.tensor("w_" + call.op, (e, k, n), scale=k ** -0.5)
    return Kernel(lambda: torch.bmm(x, w))


def _kv(call: OpCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = heads(call.spec, call.tp)
    shape = (_rows(call), h.num_kv_heads, call.context, h.head_dim)
    k = call.ws.tensor("k_cache", shape)[:call.tokens]
    v = call.ws.tensor("v_cache", shape)[:call.tokens]
    q = call.ws.tensor("q_decode", (_rows(call), h.num_heads, h.head_dim))[:call.tokens]
    return q, k, v


def _sdpa_decode(call: OpCall) -> Kernel:
    q, k, v = _kv(call)
    q4 = q.unsqueeze(2)  # [T, Hq, 1, d]
    return Kernel(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))


def _triton_decode(call: OpCall) -> Kernel:
    from nanosched.profiler.triton_kernels import decode_attention

    q, k, v = _kv(call)
    out = torch.empty_like(q)
    ctas = call.sms if call.mechanism == "cta_bound" else CTAS_PER_SM * call.sms
    return Kernel(lambda: decode_attention(q, k, v, out, num_ctas=ctas))


def _sdpa_prefill(call: OpCall) -> Kernel:
    h = heads(call.spec, call.tp)
    length = min(call.context, call.tokens)
    n, rest = divmod(call.tokens, length)
    q = call.ws.tensor("q_prefill", (n, h.num_heads, length, h.head_dim))
    kv = call.ws.tensor("kv_prefill", (2, n, h.num_kv_heads, length, h.head_dim))
    q_r, kv_r = q[:1, :, :rest], kv[:, :1, :, :rest]

    def fn() -> None:
        F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True, enable_gqa=True)
        if rest:
            F.scaled_dot_product_attention(q_r, kv_r[0], kv_r[1], is_causal=True,
                                           enable_gqa=True)
    return Kernel(fn)


def _rope_append(call: OpCall) -> Kernel:
    h = heads(call.spec, call.tp)
    t, d = call.tokens, h.head_dim
    qkv = call.ws.tensor("qkv_rope", (_rows(call), h.num_heads + 2 * h.num_kv_heads, d))[:t]
    cos = call.ws.tensor("cos", (_rows(call), 1, d // 2))[:t]
    sin = call.ws.tensor("sin", (_rows(call), 1, d // 2))[:t]
    slots_total = 4 * _rows(call)
    cache = call.ws.tensor("kv_slots", (2, slots_total, h.num_kv_heads, d))
    slots = torch.randperm(slots_total, device=qkv.device)[:t]
    q_out = torch.empty_like(qkv[:, :h.num_heads])

    def rotate(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def fn() -> None:
        q_out.copy_(rotate(qkv[:, :h.num_heads]))
        k = rotate(qkv[:, h.num_heads:h.num_heads + h.num_kv_heads])
        cache[0].index_copy_(0, slots, k)
        cache[1].index_copy_(0, slots, qkv[:, h.num_heads + h.num_kv_heads:])
    return Kernel(fn)


def _add_norm(call: OpCall) -> Kernel:
    D = call.spec.hidden_size
    x = call.ws.tensor("x_norm", (_rows(call), D))[:call.tokens]
    res = call.ws.tensor("res_norm", (_rows(call), D))[:call.tokens].clone()
    weight = call.ws.tensor("w_norm", (D,))
    eps = call.spec.rms_norm_eps

    def fn() -> None:
        res.add_(x)
        F.rms_norm(res, (D,), weight, eps)
    return Kernel(fn)


def _act(call: OpCall) -> Kernel:
    inter = call.spec.intermediate_size // call.tp
    ug = "experts_ug" if call.spec.is_moe else "ug"
    rows = gemm_rows(call.spec, ug, call.tokens)
    gu = call.ws.tensor("gate_up", (gemm_rows(call.spec, ug, _rows(call)), 2 * inter))[:rows]
    return Kernel(lambda: F.silu(gu[:, :inter]) * gu[:, inter:])


def register_all() -> None:
    for op in ("kqv", "o", "ug", "d"):
        register(op, Impl("cublas", FULL_GEMM_SMS, _cublas))
        register(op, Impl("cublaslt", FULL_GEMM_SMS, _cublaslt, quick=False, targets_sms=True,
                          requires=cublaslt_missing))
        register(op, Impl("triton_persistent_128x128", FULL_GEMM_SMS, _persistent(128),
                          targets_sms=True, requires=triton_missing))
        register(op, Impl("triton_persistent_128x256", FULL_GEMM_SMS, _persistent(256),
                          quick=False, targets_sms=True, requires=triton_missing))
    for op in ("experts_ug", "experts_d"):
        register(op, Impl("torch_bmm", FULL_GEMM_SMS, _bmm))
    register("attn_decode", Impl("torch_sdpa", FULL_GEMM_SMS, _sdpa_decode, quick=False))
    register("attn_decode", Impl("triton_decode", ("full", "green_ctx", "cta_bound"),
                                 _triton_decode, requires=triton_missing))
    register("attn_prefill", Impl("torch_sdpa", FULL_GEMM_SMS, _sdpa_prefill))
    register("rope_append", Impl("torch", FULL_GEMM_SMS, _rope_append))
    for op in ("add_norm_ffn", "add_norm_attn"):
        register(op, Impl("torch", FULL_GEMM_SMS, _add_norm))
    register("act", Impl("torch", FULL_GEMM_SMS, _act))
