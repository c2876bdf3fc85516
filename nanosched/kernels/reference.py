"""Plain torch references of every kernel; the models' CPU path and the tests' ground truth.

Every function writes into caller-given output tensors (slices of preallocated full-batch
buffers) and returns nothing, exactly as its Triton twin does. Numerics follow HF transformers
(residual add in the model dtype, RMSNorm in fp32, rotary embedding with cos/sin cast to the
model dtype), so the torch path matches HF to rounding.

An FP8 KV cache (`kv_dtype="fp8"`, models/kvcache.py) holds e4m3 K and V with one fp32 scale
per (token, KV head): `k_scale`, `v_scale` [P, S, Hkv] beside `k_cache`, `v_cache`
[P, S, Hkv, d]. The attention functions take them as keyword arguments (None: a cache in the
model dtype); the value is `cache * scale`.

Legend: n = tokens in the range, D = hidden, Hq/Hkv = query/KV heads (local to this tp rank),
d = head dim, P = pages, S = page size, E = experts, I = intermediate size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nanosched.kernels.common import FP8_MAX, FP8_MIN_SCALE


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor) -> None:
    """out = x @ w.T (+ bias). x [n, K], w [N, K], out [n, N]."""
    if bias is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(bias, x, w.t(), out=out)


def linear_fp8(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
               w_scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = (x @ w.T) * x_scale[:, None] * w_scale[None, :] (+ bias): the FP8 GEMM emulated
    as the GPU computes it (e4m3 products summed in fp32, then the two scales, then rounded to
    out's dtype). x [n, K] and w [N, K] e4m3, x_scale [n] and w_scale [N] fp32, out [n, N]."""
    acc = torch.mm(x.float(), w.float().t())  # [n, N] exact products, fp32 sums
    acc.mul_(x_scale.view(-1, 1)).mul_(w_scale.view(1, -1))
    if bias is not None:
        acc.add_(bias.float())
    out.copy_(acc)


def quantize_rows(x: torch.Tensor, out: torch.Tensor, out_scale: torch.Tensor) -> None:
    """out [n, K] e4m3, out_scale [n] fp32 = x [n, K] with one dynamic scale per row (its
    amax / 448): the activation quantisation of an FP8 GEMM's input."""
    q, scale = quantize_fp8(x)
    out.copy_(q)
    out_scale.copy_(scale)


def _write(value: torch.Tensor, out: torch.Tensor, out_scale: torch.Tensor | None) -> None:
    """out = value, or its e4m3 rows and their scales when out is e4m3 (`quantize_rows`)."""
    if out.dtype == torch.float8_e4m3fn:
        quantize_rows(value, out, out_scale)
    else:
        out.copy_(value)


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor, residual_out: torch.Tensor,
                 out_scale: torch.Tensor | None = None) -> None:
    """residual_out = x + residual (x alone when residual is None); out = RMSNorm(residual_out).

    x, residual, out, residual_out [n, D]; residual_out may alias residual or x. An e4m3 `out`
    gets the normed rows (in the model dtype) quantised, their scales in `out_scale` [n].
    """
    summed = x if residual is None else x + residual  # [n, D], rounded to the model dtype
    h = summed.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * h.to(x.dtype)
    if residual_out.data_ptr() != summed.data_ptr():
        residual_out.copy_(summed)
    _write(normed, out, out_scale)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor,
             out_scale: torch.Tensor | None = None) -> None:
    """out = SiLU(gate) * up, where gate_up [n, 2I] holds gate then up; out [n, I] (e4m3: the
    rows quantised, their scales in `out_scale` [n])."""
    inter = out.shape[-1]
    _write(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], out, out_scale)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary embedding. x [n, H, d]; cos, sin [n, 1, d] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and fp32 scales of x [..., d]: one scale per vector along the last dim
    (amax / 448, so the largest element lands on e4m3's largest finite value)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)  # [...]
    return (xf / scale[..., None]).to(torch.float8_e4m3fn), scale


def dequantize(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of a cache slice [..., d] and its scales [...] (None: not quantised)."""
    return cache.float() if scale is None else cache.float() * scale[..., None]


def rope_append(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                sin_table: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, q_out: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> None:
    """Rotate q and k of each token; write q to q_out and k, v into the paged cache.

    qkv [n, (Hq + 2 Hkv) d]; positions, slot_mapping [n] (slot = page * S + offset);
    cos_table, sin_table [max_pos, d/2] fp32; k_cache, v_cache [P, S, Hkv, d]; q_out [n, Hq, d].
    With scales (an FP8 cache) k and v are rounded to the model dtype, then quantised per
    (token, KV head).
    """
    num_q, d = q_out.shape[1], q_out.shape[2]
    num_kv = k_cache.shape[2]
    q = qkv[:, : num_q * d].view(-1, num_q, d)
    k = qkv[:, num_q * d: (num_q + num_kv) * d].view(-1, num_kv, d)
    v = qkv[:, (num_q + num_kv) * d:].view(-1, num_kv, d)
    cos = torch.cat((cos_table[positions],) * 2, dim=-1).to(qkv.dtype)[:, None, :]  # [n, 1, d]
    sin = torch.cat((sin_table[positions],) * 2, dim=-1).to(qkv.dtype)[:, None, :]
    q_out.copy_(_rotate(q, cos, sin))
    append_kv(_rotate(k, cos, sin), v, slot_mapping, k_cache, v_cache, k_scale=k_scale,
              v_scale=v_scale)


def append_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, *,
              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write k, v [n, Hkv, d] into the paged cache [P, S, Hkv, d] at `slot_mapping` [n]
    (quantised per (token, KV head) into an FP8 cache with scales)."""
    num_kv, d = k_cache.shape[2], k_cache.shape[3]
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        if scales is not None:
            x, sx = quantize_fp8(x)
            scales.view(-1, num_kv).index_copy_(0, slot_mapping, sx)
        elif x.dtype != cache.dtype:
            x = x.to(cache.dtype)
        if x.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel: copy the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, num_kv, d).index_copy_(0, slot_mapping, x)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """The first `length` cached tokens of one request, fp32: [length, Hkv, d]."""
    page = cache.shape[1]
    pages = block_table[: math.ceil(length / page)].long()
    sc = None if scale is None else scale[pages].flatten(0, 1)[:length]
    return dequantize(cache[pages].flatten(0, 1)[:length], sc)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     max_context_len: int, scale: float, out: torch.Tensor, *,
                     k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> None:
    """One query token per request attends to its whole cached context (GQA), in fp32.

    q, out [n, Hq, d]; block_tables [n, max_pages] int32; context_lens [n] int32. A request of
    context length 0 (a padded row of a CUDA-graph bucket) gets a zero output, as in the kernel.
    """
    n, num_q, d = q.shape
    if n == 0:
        return
    page, num_kv = k_cache.shape[1], k_cache.shape[2]
    num_pages = math.ceil(max_context_len / page)
    pages = block_tables[:, :num_pages].long()  # [n, p]
    k = dequantize(k_cache[pages], None if k_scale is None else k_scale[pages]).flatten(1, 2)
    v = dequantize(v_cache[pages], None if v_scale is None else v_scale[pages]).flatten(1, 2)
    # k, v [n, L, Hkv, d] fp32
    qg = q.float().view(n, num_kv, num_q // num_kv, d)  # [n, Hkv, G, d]
    scores = torch.einsum("nhgd,nlhd->nhgl", qg, k) * scale  # [n, Hkv, G, L]
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None].long()
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = probs.masked_fill((context_lens == 0)[:, None, None, None], 0.0)  # all -inf rows
    res = torch.einsum("nhgl,nlhd->nhgd", probs, v)  # [n, Hkv, G, d]
    out.copy_(res.reshape(n, num_q, d))


def causal_mask(m: int, length: int, device: torch.device) -> object:
    """The lower-right causal mask of m queries over `length` keys: on CUDA a CausalBias, which
    SDPA's fused (flash / memory-efficient) kernels take natively; elsewhere the boolean mask SDPA
    would make of it. torch.nn.attention.bias imports torch._dynamo (2-5 s of CPU), so only
    CUDA processes import it, and only when they first attend."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(m, length)
    return torch.ones(m, length, dtype=torch.bool, device=device).tril(length - m)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, segments: list[tuple[int, int, int]],
                      scale: float, out: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Chunked causal prefill attention through torch SDPA.

    Segment i = (start, end, first_pos): tokens q[start:end] of one request at positions
    first_pos.. attend to the request's cached tokens 0..own position (earlier chunks from the
    cache, this chunk causally). block_tables [num_segments, max_pages]; q, out [n, Hq, d].
    """
    group = q.shape[1] // k_cache.shape[2]
    for i, (start, end, first_pos) in enumerate(segments):
        length, m = first_pos + end - start, end - start
        # [1, Hq, L, d]: K/V repeated over each KV head's query heads, so SDPA picks its fused
        # (flash / memory-efficient) kernels, which take a lower-right causal mask natively
        k = gather_kv(k_cache, block_tables[i], length, k_scale).to(q.dtype)
        v = gather_kv(v_cache, block_tables[i], length, v_scale).to(q.dtype)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        qs = q[start:end].transpose(0, 1)[None]  # [1, Hq, m, d]
        res = F.scaled_dot_product_attention(qs, k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None],
                                             attn_mask=causal_mask(m, length, q.device),
                                             scale=scale)
        out[start:end].copy_(res[0].transpose(0, 1))


def grouped_linear(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor,
                   x_rows: torch.Tensor | None, out: torch.Tensor) -> None:
    """Grouped GEMM: out[i] = x[x_rows[i]] @ w[expert_ids[i]].T, one group per expert.

    x [m0, K]; w [E, N, K]; expert_ids [m] int64; x_rows [m] (None: row i reads x[i]);
    out [m, N]. The Triton twin is grouped_gemm.grouped_linear (one launch, no host sync).
    """
    rows_in = torch.arange(out.shape[0], device=x.device) if x_rows is None else x_rows
    for e in torch.unique(expert_ids).tolist():
        idx = (expert_ids == e).nonzero().squeeze(1)  # [m_e]
        out.index_copy_(0, idx, x.index_select(0, rows_in[idx]) @ w[e].t())


def grouped_linear_fp8(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                       w_scale: torch.Tensor, expert_ids: torch.Tensor,
                       x_rows: torch.Tensor | None, out: torch.Tensor) -> None:
    """The W8A8 grouped GEMM, emulated as `linear_fp8` is: out[i] = (x[r] @ w[e].T) *
    x_scale[r] * w_scale[e] with r = x_rows[i] (i when None) and e = expert_ids[i]. x [m0, K]
    and w [E, N, K] e4m3, x_scale [m0] and w_scale [E, N] fp32, out [m, N]."""
    rows_in = torch.arange(out.shape[0], device=x.device) if x_rows is None else x_rows
    for e in torch.unique(expert_ids).tolist():
        idx = (expert_ids == e).nonzero().squeeze(1)  # [m_e]
        r = rows_in[idx]
        acc = torch.mm(x.index_select(0, r).float(), w[e].float().t())  # exact, fp32 sums
        acc.mul_(x_scale[r].view(-1, 1)).mul_(w_scale[e].view(1, -1))
        out.index_copy_(0, idx, acc.to(out.dtype))
