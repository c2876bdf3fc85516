"""Plain torch references of every kernel; the models' CPU path and the tests' ground truth.

Every function writes into caller-given output tensors (slices of preallocated full-batch
buffers) and returns nothing, exactly as its Triton twin does. Numerics follow HF transformers
(residual add in the model dtype, RMSNorm in fp32, rotary embedding with cos/sin cast to the
model dtype), so the torch path matches HF to rounding.

Legend: n = tokens in the range, D = hidden, Hq/Hkv = query/KV heads (local to this tp rank),
d = head dim, P = pages, S = page size, E = experts, I = intermediate size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor) -> None:
    """out = x @ w.T (+ bias). x [n, K], w [N, K], out [n, N]."""
    if bias is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(bias, x, w.t(), out=out)


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor, residual_out: torch.Tensor) -> None:
    """residual_out = x + residual (x alone when residual is None); out = RMSNorm(residual_out).

    x, residual, out, residual_out [n, D]; residual_out may alias residual or x.
    """
    summed = x if residual is None else x + residual  # [n, D], rounded to the model dtype
    h = summed.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * h.to(x.dtype)
    if residual_out.data_ptr() != summed.data_ptr():
        residual_out.copy_(summed)
    out.copy_(normed)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """out = SiLU(gate) * up, where gate_up [n, 2I] holds gate then up; out [n, I]."""
    inter = out.shape[-1]
    out.copy_(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary embedding. x [n, H, d]; cos, sin [n, 1, d] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_append(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                sin_table: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, q_out: torch.Tensor) -> None:
    """Rotate q and k of each token; write q to q_out and k, v into the paged cache.

    qkv [n, (Hq + 2 Hkv) d]; positions, slot_mapping [n] (slot = page * S + offset);
    cos_table, sin_table [max_pos, d/2] fp32; k_cache, v_cache [P, S, Hkv, d]; q_out [n, Hq, d].
    """
    num_q, d = q_out.shape[1], q_out.shape[2]
    num_kv = k_cache.shape[2]
    q = qkv[:, : num_q * d].view(-1, num_q, d)
    k = qkv[:, num_q * d: (num_q + num_kv) * d].view(-1, num_kv, d)
    v = qkv[:, (num_q + num_kv) * d:].view(-1, num_kv, d)
    cos = torch.cat((cos_table[positions],) * 2, dim=-1).to(qkv.dtype)[:, None, :]  # [n, 1, d]
    sin = torch.cat((sin_table[positions],) * 2, dim=-1).to(qkv.dtype)[:, None, :]
    q_out.copy_(_rotate(q, cos, sin))
    k_cache.view(-1, num_kv, d).index_copy_(0, slot_mapping, _rotate(k, cos, sin))
    v_cache.view(-1, num_kv, d).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one request: [length, Hkv, d]."""
    page = cache.shape[1]
    pages = block_table[: math.ceil(length / page)].long()
    return cache[pages].flatten(0, 1)[:length]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     max_context_len: int, scale: float, out: torch.Tensor) -> None:
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
    k = k_cache[pages].flatten(1, 2).float()  # [n, L, Hkv, d]
    v = v_cache[pages].flatten(1, 2).float()
    qg = q.float().view(n, num_kv, num_q // num_kv, d)  # [n, Hkv, G, d]
    scores = torch.einsum("nhgd,nlhd->nhgl", qg, k) * scale  # [n, Hkv, G, L]
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None].long()
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = probs.masked_fill((context_lens == 0)[:, None, None, None], 0.0)  # all -inf rows
    res = torch.einsum("nhgl,nlhd->nhgd", probs, v)  # [n, Hkv, G, d]
    out.copy_(res.reshape(n, num_q, d))


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, segments: list[tuple[int, int, int]],
                      scale: float, out: torch.Tensor) -> None:
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
        k = gather_kv(k_cache, block_tables[i], length).repeat_interleave(group, 1)
        v = gather_kv(v_cache, block_tables[i], length).repeat_interleave(group, 1)
        qs = q[start:end].transpose(0, 1)[None]  # [1, Hq, m, d]
        res = F.scaled_dot_product_attention(qs, k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None],
                                             attn_mask=causal_lower_right(m, length),
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
