"""The named ops of a decoder layer, each on a token range [start, end) of the dense batch.

Signature of every op: `op(model, layer, ws, meta, start, end, launch) -> None`, called through
`CausalLM.run_op`. `launch` is the runtime's launch dict (kernels/impls.py: `impl`, `num_sms`,
`max_ctas`, `num_splits`), handed to every kernel the op launches. An op reads and writes only
rows [start, end) of the workspace (see `model.py` for the contract); `meta` is the full
batch's metadata and the op slices it: a `BatchMeta`, or a CUDA-graph bucket's `BucketMeta`
(models/bucket.py), which answers the same calls from static tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from nanosched.kernels import dispatch as K
from nanosched.kernels.dispatch import Launch
from nanosched.kernels.impls import CASCADE_DECODE
from nanosched.models import moe
from nanosched.models.batch import BatchMeta
from nanosched.models.ops import GROUPED
from nanosched.models.ops import OPS as TABLE
from nanosched.models.workspace import Workspace

if TYPE_CHECKING:
    from nanosched.models.model import CausalLM


def kqv(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
        launch: Launch) -> None:
    """qkv[s:e] = normed[s:e] @ w_qkv.T (+ bias)."""
    layer = m.layers[i]
    if layer.is_fp8("w_qkv"):
        K.linear_fp8(ws.normed8[s:e], ws.normed_scale[s:e], layer.w_qkv, layer.w_qkv_scale,
                     layer.b_qkv, ws.qkv[s:e], m.kernels, launch)
    else:
        K.linear(ws.normed[s:e], layer.w_qkv, layer.b_qkv, ws.qkv[s:e], m.kernels, launch)


def rope_append(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
                launch: Launch) -> None:
    """Rotate q → q[s:e]; rotate k and write k, v into layer i's pages."""
    r, kv = meta.slice(s, e), ws.kv.layer(i)
    K.rope_append(ws.qkv[s:e], r.positions, m.rope_cos, m.rope_sin, r.slot_mapping, kv.k, kv.v,
                  ws.q[s:e], m.kernels, launch, **kv.scales)


def attn_decode(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
                launch: Launch) -> None:
    """Decode tokens of the range attend to their requests' cached context; with the cascade
    option, a range holding all the batch's decode rows passes their prefix groups."""
    r = meta.slice(s, e)
    nd = r.num_decode
    if nd == 0:
        return
    tables, lens = r.decode_tables()
    kv = ws.kv.layer(i)
    groups = r.cascade_groups() if m.kernels.decode_impl == CASCADE_DECODE else None
    K.decode_attention(ws.q[s:s + nd], kv.k, kv.v, tables, lens, r.max_decode_context, m.scale,
                       ws.attn[s:s + nd], m.kernels, launch, **kv.scales, groups=groups)


def attn_prefill(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
                 launch: Launch) -> None:
    """Prefill tokens of the range: causal over their prompts' cached earlier tokens."""
    r = meta.slice(s, e)
    nd = r.num_decode
    if nd == e - s:
        return
    kv = ws.kv.layer(i)
    K.prefill_attention(ws.q[s + nd:e], kv.k, kv.v, r.prefill_block_tables(),
                        r.prefill_tensors(), m.scale, ws.attn[s + nd:e], m.kernels, launch,
                        **kv.scales)


def o(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
      launch: Launch) -> None:
    """o_out[s:e] = attn[s:e] @ w_o.T (a partial sum under tp); an e4m3 w_o first quantises
    the attention rows (their kernels write the model dtype)."""
    layer = m.layers[i]
    if layer.is_fp8("w_o"):
        K.quantize_rows(ws.attn[s:e].flatten(1), ws.attn8[s:e], ws.attn_scale[s:e], m.kernels)
        K.linear_fp8(ws.attn8[s:e], ws.attn_scale[s:e], layer.w_o, layer.w_o_scale, None,
                     ws.o_out[s:e], m.kernels, launch)
    else:
        K.linear(ws.attn[s:e].flatten(1), layer.w_o, None, ws.o_out[s:e], m.kernels, launch)


def ar_attn(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
            launch: Launch) -> None:
    """All-reduce o_out[s:e] over the tp group (launch: impl, max_ctas)."""
    m.tp.all_reduce(ws.o_out[s:e], *K.network_args(m.kernels, launch))


def add_norm_ffn(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
                 launch: Launch) -> None:
    """residual += o_out; normed = RMSNorm_ffn(residual) (e4m3 + row scales for an e4m3
    w_gate_up)."""
    out, scale = m.normed_out(ws, i, "w_gate_up", s, e)
    K.rms_norm_add(ws.o_out[s:e], ws.residual[s:e], m.layers[i].ffn_norm, m.spec.rms_norm_eps,
                   out, ws.residual[s:e], m.kernels, launch, out_scale=scale)


def ug(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
       launch: Launch) -> None:
    """gate_up[s:e] = normed[s:e] @ w_gate_up.T."""
    layer = m.layers[i]
    if layer.is_fp8("w_gate_up"):
        K.linear_fp8(ws.normed8[s:e], ws.normed_scale[s:e], layer.w_gate_up,
                     layer.w_gate_up_scale, None, ws.gate_up[s:e], m.kernels, launch)
    else:
        K.linear(ws.normed[s:e], layer.w_gate_up, None, ws.gate_up[s:e], m.kernels, launch)


def act(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
        launch: Launch) -> None:
    """act = SiLU(gate) * up on the range's rows (k rows per token for MoE); e4m3 + row scales
    for an e4m3 w_down."""
    rows = ws.rows(s, e)
    if m.layers[i].e4m3_input("w_down"):
        K.silu_mul(ws.gate_up[rows], ws.act8[rows], m.kernels, launch, out_scale=ws.act_scale[rows])
    else:
        K.silu_mul(ws.gate_up[rows], ws.act[rows], m.kernels, launch)


def d(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
      launch: Launch) -> None:
    """ffn_out[s:e] = act[s:e] @ w_down.T (a partial sum under tp)."""
    layer = m.layers[i]
    if layer.is_fp8("w_down"):
        K.linear_fp8(ws.act8[s:e], ws.act_scale[s:e], layer.w_down, layer.w_down_scale, None,
                     ws.ffn_out[s:e], m.kernels, launch)
    else:
        K.linear(ws.act[s:e], layer.w_down, None, ws.ffn_out[s:e], m.kernels, launch)


def ar_ffn(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
           launch: Launch) -> None:
    """All-reduce ffn_out[s:e] over the tp group (launch: impl, max_ctas)."""
    m.tp.all_reduce(ws.ffn_out[s:e], *K.network_args(m.kernels, launch))


def add_norm_attn(m: CausalLM, i: int, ws: Workspace, meta: BatchMeta, s: int, e: int,
                  launch: Launch) -> None:
    """residual += ffn_out; normed = the next layer's input RMSNorm (final norm at the end, in
    the model dtype for the LM head; e4m3 + row scales before an e4m3 w_qkv)."""
    out, scale = m.normed_out(ws, i + 1, "w_qkv", s, e)
    K.rms_norm_add(ws.ffn_out[s:e], ws.residual[s:e], m.norm_before(i + 1),
                   m.spec.rms_norm_eps, out, ws.residual[s:e], m.kernels, launch,
                   out_scale=scale)


# each op of the table runs the function of its name, here or (the grouped experts) in moe.py
OP_FUNCTIONS: dict[str, Callable[..., None]] = {
    op.name: getattr(moe if op.family == GROUPED else sys.modules[__name__], op.name)
    for op in TABLE}
