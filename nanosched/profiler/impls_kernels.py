"""The registered implementations: the model's kernels, launched through nanosched.kernels.dispatch.

Each setup builds the op's inputs and outputs at the row's shape and returns a `Kernel` that
calls the dispatch function the model's op calls, with the runtime's launch dict
(`impl_registry.launch_of`), so a row times exactly what a replay launches. Names are those
of nanosched/kernels/impls.py (GEMMs: cuBLAS, cuBLASLt with an SM target, persistent Triton;
attention: the paged Triton kernels and torch; elementwise and grouped GEMM families).

More in docs/profiler.md, module notes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nanosched.constants import PAGE_SIZE
from nanosched.kernels import dispatch
from nanosched.kernels.common import PrefillSegments, Segment
from nanosched.kernels.dispatch import Launch
from nanosched.kernels.impls import cublaslt_missing, persistent_name
from nanosched.models import ops as optable
from nanosched.models.quant import FP8_DTYPE, fp8_weights, producer_writes_e4m3
from nanosched.profiler.backend import Unsupported
from nanosched.profiler.impl_registry import (
    Impl,
    Kernel,
    OpCall,
    bulk_missing,
    register,
    triton_missing,
)
from nanosched.profiler.shapes import gemm_dims, gemm_rows, heads

SM_MECHANISMS = ("full", "green_ctx")
# input -> the output of the op before it in a layer (a forward table's layer reads these, so
# its ops find in L2 what a forward's find; the two norms share their names and read `o`'s)
LAYER_FLOW = {"x_kqv": "y_norm", "qkv_rope": "y_kqv", "q_decode": "q_rope", "x_o": "y_decode",
              "x_norm": "y_o", "x_ug": "y_norm", "gate_up": "y_ug", "x_d": "act_out",
              # the e4m3 inputs of FP8 GEMMs and their row scales (quantization fp8)
              "x8_kqv": "y_norm8", "xs_kqv": "y_norm_scale", "x8_ug": "y_norm8",
              "xs_ug": "y_norm_scale", "x8_d": "act_out8", "xs_d": "act_scale"}
OPTS = dispatch.KernelOptions()  # every launch names its impl; this is never consulted


def _rows(call: OpCall) -> int:
    return max(call.max_tokens, call.tokens)


def _fp8(call: OpCall) -> bool:
    """Whether `call`'s GEMM is e4m3 under its quantization, as in the model
    (models/quant.fp8_weights)."""
    return optable.WEIGHT_OF.get(call.op) in fp8_weights(call.spec, call.quantization)


def _writes_e4m3(call: OpCall) -> bool:
    """Whether `call` (a norm, SiLU·mul) writes the input of the GEMM after it in e4m3, as in
    the model (models/quant.producer_writes_e4m3)."""
    return producer_writes_e4m3(call.spec, optable.WEIGHT_OF.get(call.op, ""),
                                fp8_weights(call.spec, call.quantization))


def _scales(call: OpCall, name: str, rows: int) -> torch.Tensor:
    """Positive fp32 row scales [rows] (values of the size real ones have)."""
    return call.ws.tensor(name, (rows,), scale=0.01, dtype=torch.float32).abs_()


def _linear(call: OpCall, launch: Launch) -> Kernel:
    if _fp8(call):
        return _linear_fp8(call, launch)
    k, n = gemm_dims(call.spec, call.tp, call.op)
    x = call.ws.tensor("x_" + call.op, (_rows(call), k))[:call.tokens]  # [T, K]
    w = call.ws.tensor("w_" + call.op, (n, k), scale=k ** -0.5)  # [N, K]
    bias = call.ws.tensor("b_kqv", (n,)) if call.op == optable.KQV and call.spec.qkv_bias else None
    out = call.ws.tensor("y_" + call.op, (_rows(call), n))[:call.tokens]  # [T, N]
    return Kernel(lambda: dispatch.linear(x, w, bias, out, OPTS, launch))


def _linear_fp8(call: OpCall, launch: Launch) -> Kernel:
    """The W8A8 GEMM of the model's FP8 layer (models/op_impls.py), `o` with the quantisation
    of its input rows before it."""
    from nanosched.profiler.plan import FP8_GEMM_IMPLS

    if launch["impl"] not in FP8_GEMM_IMPLS:
        raise Unsupported(f"{call.op}/{launch['impl']}: no FP8 GEMM of that implementation "
                          f"(FP8 GEMMs: {', '.join(FP8_GEMM_IMPLS)})")
    k, n = gemm_dims(call.spec, call.tp, call.op)
    rows, t = _rows(call), call.tokens
    x8 = call.ws.tensor("x8_" + call.op, (rows, k), dtype=FP8_DTYPE)[:t]  # [T, K] e4m3
    xs = _scales(call, "xs_" + call.op, rows)[:t]
    w8 = call.ws.tensor("w8_" + call.op, (n, k), dtype=FP8_DTYPE)  # [N, K] e4m3
    w_scale = _scales(call, "ws_" + call.op, n)
    bias = call.ws.tensor("b_kqv", (n,)) if call.op == optable.KQV and call.spec.qkv_bias else None
    out = call.ws.tensor("y_" + call.op, (rows, n))[:t]  # [T, N] in the model dtype

    def gemm() -> None:
        dispatch.linear_fp8(x8, xs, w8, w_scale, bias, out, OPTS, launch)
    if call.op != optable.O_PROJ:
        return Kernel(gemm)
    x = call.ws.tensor("x_o", (rows, k))[:t]  # the attention rows, in the model dtype

    def quantize_and_gemm() -> None:
        dispatch.quantize_rows(x, x8, xs, OPTS)
        gemm()
    return Kernel(quantize_and_gemm)


def _grouped(call: OpCall, launch: Launch) -> Kernel:
    if _fp8(call):
        return _grouped_fp8(call, launch)
    k, n = gemm_dims(call.spec, call.tp, call.op)
    e = call.spec.num_experts
    rows = gemm_rows(call.spec, call.op, call.tokens)
    x = call.ws.tensor("x_" + call.op, (rows, k))  # [T k, K]
    w = call.ws.tensor("w_" + call.op, (e, n, k), scale=k ** -0.5)  # [E, N, K]
    out = call.ws.tensor("y_" + call.op, (rows, n))
    ids = torch.arange(rows, device=x.device) % e  # uniform routing
    return Kernel(lambda: dispatch.grouped_linear(x, w, ids, None, out, OPTS, launch))


def _grouped_fp8(call: OpCall, launch: Launch) -> Kernel:
    """The W8A8 grouped GEMM of the model's e4m3 experts (models/moe.py): `experts_ug` with the
    quantisation of its normed rows before it and each token's rows gathered, as it runs;
    `experts_d` on the e4m3 rows SiLU·mul wrote (`torch`: the exact emulation, which a
    profile does not measure: plan.FP8_IMPLS)."""
    k, n = gemm_dims(call.spec, call.tp, call.op)
    e, top = call.spec.num_experts, call.spec.num_experts_per_tok
    rows = gemm_rows(call.spec, call.op, call.tokens)
    w8 = call.ws.tensor("w8_" + call.op, (e, n, k), dtype=FP8_DTYPE)  # [E, N, K] e4m3
    w_scale = _scales(call, "ws_" + call.op, e * n).view(e, n)
    out = call.ws.tensor("y_" + call.op, (rows, n))
    ids = torch.arange(rows, device=out.device) % e  # uniform routing
    if call.op != optable.EXPERTS_UG:
        x8 = call.ws.tensor("x8_" + call.op, (rows, k), dtype=FP8_DTYPE)  # [T k, K]
        xs = _scales(call, "xs_" + call.op, rows)
        return Kernel(lambda: dispatch.grouped_linear_fp8(x8, xs, w8, w_scale, ids, None, out,
                                                          OPTS, launch))
    t = call.tokens
    x = call.ws.tensor("x_" + call.op, (t, k))  # the normed rows, in the model dtype
    x8 = call.ws.tensor("x8_" + call.op, (t, k), dtype=FP8_DTYPE)
    xs = _scales(call, "xs_" + call.op, t)
    x_rows = torch.arange(t, device=out.device).repeat_interleave(top)  # [T k]

    def quantize_and_gemm() -> None:
        dispatch.quantize_rows(x, x8, xs, OPTS)
        dispatch.grouped_linear_fp8(x8, xs, w8, w_scale, ids, x_rows, out, OPTS, launch)
    return Kernel(quantize_and_gemm)


def _kv_pages(call: OpCall, prefix: str, pages: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                dict[str, Any]]:
    """K, V pages [P, S, Hkv, d] of the run's KV cache dtype, and the scale keywords of the
    attention kernels ([P, S, Hkv] fp32 for an FP8 cache, None otherwise)."""
    h = heads(call.spec, call.tp)
    shape = (pages, PAGE_SIZE, h.num_kv_heads, h.head_dim)
    if call.kv_dtype != "fp8":
        k, v = call.ws.tensor(prefix + "k_pages", shape), call.ws.tensor(prefix + "v_pages", shape)
        return k, v, {"k_scale": None, "v_scale": None}
    k = call.ws.tensor(prefix + "k_pages8", shape, dtype=torch.float8_e4m3fn)
    v = call.ws.tensor(prefix + "v_pages8", shape, dtype=torch.float8_e4m3fn)
    scales = {name: call.ws.tensor(prefix + name, shape[:-1], scale=0.01, dtype=torch.float32)
              for name in ("k_scale", "v_scale")}
    return k, v, scales


def _paged_cache(call: OpCall, requests: int, context: int, prefix: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """K, V pages and their scales (`_kv_pages`) and block tables [requests, pages per
    request] (int32) of `requests` requests of `context` tokens, their pages in random order."""
    per = math.ceil(context / PAGE_SIZE)
    k, v, scales = _kv_pages(call, prefix, requests * per)
    tables = torch.randperm(requests * per, device=k.device).view(requests, per).int()
    return k, v, tables, scales


def _check_gather(call: OpCall, context: int) -> None:
    """Refuse the torch decode reference where its fp32 gather of K and V would not fit."""
    h = heads(call.spec, call.tp)
    size = 2 * call.tokens * context * h.num_kv_heads * h.head_dim * (4 + call.ws.dtype.itemsize)
    if size > call.ws.max_bytes:
        raise Unsupported(f"attn_decode/torch at {call.tokens} x {context} gathers "
                          f"{size / 2**30:.1f} GiB, more than the {call.ws.max_bytes / 2**30:.1f}"
                          f" GiB free")


def _decode(call: OpCall, launch: Launch) -> Kernel:
    if launch["impl"] == "torch":
        _check_gather(call, call.context)
    h = heads(call.spec, call.tp)
    k, v, tables, scales = _paged_cache(call, _rows(call), call.context, "decode_")
    if launch["impl"] == "cuda_bulk":
        from nanosched.kernels.decode_attn_bulk import unsupported

        q = call.ws.tensor("q_decode", (_rows(call), h.num_heads, h.head_dim))
        why = unsupported(q, k, v, scales.get("k_scale"), scales.get("v_scale"))
        if why:
            raise Unsupported(f"attn_decode/cuda_bulk: {why}")
    tables = tables[:call.tokens]
    lens = torch.full((call.tokens,), call.context, dtype=torch.int32, device=k.device)
    q = call.ws.tensor("q_decode", (_rows(call), h.num_heads, h.head_dim))[:call.tokens]
    out = call.ws.tensor("y_decode", (_rows(call), h.num_heads, h.head_dim))[:call.tokens]
    scale = h.head_dim ** -0.5
    return Kernel(lambda: dispatch.decode_attention(q, k, v, tables, lens, call.context, scale,
                                                    out, OPTS, launch, **scales))


def prefill_rows(tokens: int, prompt: int) -> list[Segment]:
    """(start, end, first_pos) of a prefill row: T tokens cut from prompts of `prompt` tokens
    (docs/profiler.md)."""
    if tokens < prompt:
        return [(0, tokens, (prompt - tokens) // 2)]
    return [(s, min(s + prompt, tokens), 0) for s in range(0, tokens, prompt)]


def _prefill(call: OpCall, launch: Launch) -> Kernel:
    h = heads(call.spec, call.tp)
    segments = prefill_rows(call.tokens, call.context)
    k, v, tables, scales = _paged_cache(call, len(segments),
                                        max(e - s + p for s, e, p in segments), "prefill_")
    meta = PrefillSegments.build(segments, k.device)  # setup: the launch copies nothing
    q = call.ws.tensor("q_prefill", (call.tokens, h.num_heads, h.head_dim))
    out = call.ws.tensor("y_prefill", (call.tokens, h.num_heads, h.head_dim))
    scale = h.head_dim ** -0.5
    return Kernel(lambda: dispatch.prefill_attention(q, k, v, tables, meta, scale, out, OPTS,
                                                     launch, **scales))


def _rope_append(call: OpCall, launch: Launch) -> Kernel:
    h = heads(call.spec, call.tp)
    t, d, rows = call.tokens, h.head_dim, _rows(call)
    qkv = call.ws.tensor("qkv_rope", (rows, (h.num_heads + 2 * h.num_kv_heads) * d))[:t]
    max_pos = call.spec.max_position_embeddings
    cos = call.ws.tensor("rope_cos", (max_pos, d // 2), dtype=torch.float32)
    sin = call.ws.tensor("rope_sin", (max_pos, d // 2), dtype=torch.float32)
    positions = torch.randint(0, max_pos, (t,), device=qkv.device)
    pages = math.ceil(4 * rows / PAGE_SIZE)  # the batch's new tokens land on 1/4 of the slots
    k_cache, v_cache, scales = _kv_pages(call, "rope_", pages)
    slots = torch.randperm(pages * PAGE_SIZE, device=qkv.device)[:t]
    q_out = call.ws.tensor("q_rope", (rows, h.num_heads, d))[:t]
    return Kernel(lambda: dispatch.rope_append(qkv, positions, cos, sin, slots, k_cache, v_cache,
                                               q_out, OPTS, launch, **scales))


def _add_norm(call: OpCall, launch: Launch) -> Kernel:
    dim, rows, t = call.spec.hidden_size, _rows(call), call.tokens
    x = call.ws.tensor("x_norm", (rows, dim))[:t]
    res = call.ws.tensor("res_norm", (rows, dim))[:t]
    weight = call.ws.tensor("w_norm", (dim,))
    res_out = call.ws.tensor("res_out_norm", (rows, dim))[:t]  # not in place: values stay put
    eps = call.spec.rms_norm_eps
    if _writes_e4m3(call):  # the e4m3 input of the FP8 GEMM after it, with its row scales
        out = call.ws.tensor("y_norm8", (rows, dim), dtype=FP8_DTYPE)[:t]
        scale = _scales(call, "y_norm_scale", rows)[:t]
        return Kernel(lambda: dispatch.rms_norm_add(x, res, weight, eps, out, res_out, OPTS,
                                                    launch, out_scale=scale))
    out = call.ws.tensor("y_norm", (rows, dim))[:t]
    return Kernel(lambda: dispatch.rms_norm_add(x, res, weight, eps, out, res_out, OPTS,
                                                launch))


def _act(call: OpCall, launch: Launch) -> Kernel:
    inter = call.spec.intermediate_size // call.tp
    ug = optable.ffn_ops(call.spec)[0]
    rows, most = gemm_rows(call.spec, ug, call.tokens), gemm_rows(call.spec, ug, _rows(call))
    gate_up = call.ws.tensor("gate_up", (most, 2 * inter))[:rows]
    if _writes_e4m3(call):  # e4m3 rows and their scales for the FP8 `d` / `experts_d`
        out8 = call.ws.tensor("act_out8", (most, inter), dtype=FP8_DTYPE)[:rows]
        scale = _scales(call, "act_scale", most)[:rows]
        return Kernel(lambda: dispatch.silu_mul(gate_up, out8, OPTS, launch, out_scale=scale))
    out = call.ws.tensor("act_out", (most, inter))[:rows]
    return Kernel(lambda: dispatch.silu_mul(gate_up, out, OPTS, launch))


def register_all() -> None:
    """Register every implementation above under its runtime name."""
    for op in (o for o, f in optable.OP_FAMILY.items() if f == optable.GEMM):
        register(op, Impl("cublas", SM_MECHANISMS, _linear))
        # in the quick grid too: the GEMM told to leave a bounded collective's SMs (beside the
        # copy-engine all-reduce on 4xH100 it kept 0.87-0.93 where the persistent Triton GEMM
        # kept 0.64-0.65: bench/results/ce_allreduce-*-4gpu-*.json, the tp=4 quick profile)
        register(op, Impl("cublaslt", SM_MECHANISMS, _linear, targets_sms=True,
                          requires=cublaslt_missing))
        register(op, Impl(persistent_name(128, 128), SM_MECHANISMS, _linear, targets_sms=True,
                          requires=triton_missing))
        register(op, Impl(persistent_name(128, 256), SM_MECHANISMS, _linear, quick=False,
                          targets_sms=True, requires=triton_missing))
    for op in (o for o, f in optable.OP_FAMILY.items() if f == optable.GROUPED):
        register(op, Impl("triton", SM_MECHANISMS, _grouped, targets_sms=True,
                          requires=triton_missing))
        register(op, Impl("torch", SM_MECHANISMS, _grouped))
    register(optable.ATTN_DECODE, Impl("triton_pipelined", ("full", "green_ctx", "cta_bound"),
                                 _decode, requires=triton_missing))
    register(optable.ATTN_DECODE, Impl("triton_pipelined_2w", ("full", "green_ctx", "cta_bound"),
                                 _decode, requires=triton_missing))
    register(optable.ATTN_DECODE, Impl("cuda_bulk", ("full", "green_ctx", "cta_bound"), _decode,
                                 requires=bulk_missing))
    register(optable.ATTN_DECODE, Impl("triton_paged", ("full", "green_ctx", "cta_bound"), _decode,
                                 quick=False, requires=triton_missing))
    register(optable.ATTN_DECODE, Impl("torch", SM_MECHANISMS, _decode, quick=False))
    register(optable.ATTN_PREFILL, Impl("triton", SM_MECHANISMS, _prefill, requires=triton_missing))
    register(optable.ATTN_PREFILL, Impl("torch", SM_MECHANISMS, _prefill))
    for op, setup in ((optable.ROPE_APPEND, _rope_append), (optable.ADD_NORM_FFN, _add_norm),
                      (optable.ADD_NORM_ATTN, _add_norm), (optable.ACT, _act)):
        register(op, Impl("triton", ("full", "green_ctx", "cta_bound"), setup,
                          requires=triton_missing))
        register(op, Impl("torch", SM_MECHANISMS, setup))
