"""Mixtral's top-k MoE FFN as the ops `experts_ug` and `experts_d`.

Rows are token-major: (token t, choice j) is row t*k + j of `gate_up`, `act`, `expert_out`,
`expert_ids` and `expert_weights`, so a token range [s, e) owns rows [s*k, e*k) and MoE ops run
on nano-batches like dense ones. `experts_ug` routes (softmax over E in fp32, top-k, renormalise,
as HF) and runs the grouped gate/up GEMM; `experts_d` runs the grouped down GEMM and sums each
token's k outputs weighted by the router. Both GEMMs go through `dispatch.grouped_linear` (row i
uses expert expert_ids[i]): the Triton grouped GEMM (kernels/grouped_gemm.py, no host sync) or
the torch loop over experts, as the launch's `impl` or the model's `KernelOptions` say. With
e4m3 experts (`--quantization fp8`) both are W8A8 (`dispatch.grouped_linear_fp8`): `experts_ug`
quantises the normed rows it routes in the model dtype, `experts_d` reads the e4m3 rows
SiLU·mul wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nanosched.kernels import dispatch as K
from nanosched.models.batch import BatchMeta
from nanosched.models.workspace import Workspace

if TYPE_CHECKING:
    from nanosched.models.model import CausalLM


def route(x: torch.Tensor, router: torch.Tensor, k: int,
          opts: K.KernelOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each token and their renormalised weights: ([n, k] int64, [n, k] fp32)."""
    logits = torch.empty((x.shape[0], router.shape[0]), dtype=x.dtype, device=x.device)
    K.linear(x, router, None, logits, opts)  # [n, E]
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def experts_ug(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
               launch: dict[str, Any] | None) -> None:
    """Route tokens [s, e) and compute gate_up rows [s*k, e*k) with each row's expert."""
    layer, k, rows = m.layers[i], ws.experts_per_token, ws.rows(s, e)
    x = ws.normed[s:e]  # [n, D]
    ids, weights = route(x, layer.router, k, m.kernels)
    ws.expert_ids[rows] = ids.flatten()
    ws.expert_weights[rows] = weights.flatten()
    x_rows = torch.arange(e - s, device=x.device).repeat_interleave(k)  # [n k]
    if layer.is_fp8("w_gate_up"):
        x8, xs = ws.normed8[s:e], ws.normed_scale[s:e]
        K.quantize_rows(x, x8, xs, m.kernels)
        K.grouped_linear_fp8(x8, xs, layer.w_gate_up, layer.w_gate_up_scale,
                             ws.expert_ids[rows], x_rows, ws.gate_up[rows], m.kernels, launch)
        return
    K.grouped_linear(x, layer.w_gate_up, ws.expert_ids[rows], x_rows, ws.gate_up[rows],
                     m.kernels, launch)


def experts_d(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
              launch: dict[str, Any] | None) -> None:
    """Down-project rows [s*k, e*k) and combine them into ffn_out[s:e] by router weight."""
    layer, k, rows = m.layers[i], ws.experts_per_token, ws.rows(s, e)
    out = ws.expert_out[rows]  # [n k, D]
    if layer.is_fp8("w_down"):
        K.grouped_linear_fp8(ws.act8[rows], ws.act_scale[rows], layer.w_down, layer.w_down_scale,
                             ws.expert_ids[rows], None, out, m.kernels, launch)
    else:
        K.grouped_linear(ws.act[rows], layer.w_down, ws.expert_ids[rows], None, out,
                         m.kernels, launch)
    weighted = out.view(e - s, k, -1).float() * ws.expert_weights[rows].view(e - s, k, 1)
    ws.ffn_out[s:e] = weighted.sum(dim=1).to(ws.ffn_out.dtype)
