"""The op table: every op of a decoder layer and its facts, declared once (docs/design.md).

Each `OpSpec` says what the other packages need of an op: resource class, the workspace buffers
it reads and writes, the ops whose output it reads (the graph's edges), its token domain, its
cost formula (FLOPs, bytes, network bytes), its profiler shape, its kernel family, the weight
it multiplies and the HF frontend rules that claim it. The models implement the ops, the cost
model prices them, the profiler measures them, the search splits them and the runtime launches
them, each by iterating this table or naming an op by the constants below: adding an op is one
entry here plus its kernel (tests/models/test_op_table.py shows one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanosched.models.spec import ModelSpec

COMPUTE, MEMORY, NETWORK, OTHER = "compute", "memory", "network", "other"
RESOURCE_CLASSES = (COMPUTE, MEMORY, NETWORK, OTHER)
# kernel families (kernels/impls.py's vocabulary of implementation names)
GEMM, DECODE, ELEMENTWISE, GROUPED, PREFILL = "gemm", "decode", "elementwise", "grouped", "prefill"

# the ops' names: the one place each is spelled
KQV, ROPE_APPEND, ATTN_DECODE, ATTN_PREFILL = "kqv", "rope_append", "attn_decode", "attn_prefill"
O_PROJ = "o"
AR_ATTN, ADD_NORM_FFN, UG, EXPERTS_UG, ACT = "ar_attn", "add_norm_ffn", "ug", "experts_ug", "act"
D, EXPERTS_D, AR_FFN, ADD_NORM_ATTN = "d", "experts_d", "ar_ffn", "add_norm_attn"
RS_ATTN, AG_ATTN, RS_FFN, AG_FFN = "rs_attn", "ag_attn", "rs_ffn", "ag_ffn"

Demands = tuple[float, float, float]  # (FLOPs, bytes loaded, network bytes) of one layer


@dataclass(frozen=True)
class OpDef:
    name: str
    resource: str  # one of RESOURCE_CLASSES
    description: str


@dataclass(frozen=True)
class OpSpec:
    """One op's facts. `cost(spec, tp, mix, s8)`: per layer, logical tensors (models/costmodel.py),
    `s8` the bytes of a GEMM weight / input element. `gemm(spec, tp)`: (K, N) of a GEMM on one
    GPU; `bytes(spec, tp, tokens, context)`: what a non-GEMM moves on one GPU (profiler/shapes.py).
    """

    name: str
    resource: str
    description: Callable[[ModelSpec], str]
    reads: tuple[str, ...]  # workspace buffers; "kv" is the layer's K/V rows
    writes: tuple[str, ...]
    inputs: tuple[tuple[str, int], ...] = ()  # (op whose output it reads, layers back)
    models: str = "all"  # "all" | "dense" | "moe": the layers that hold it
    domain: str = "all"  # "all" | "decode" | "prefill": the batch rows it works on
    cost: Callable[[ModelSpec, int, Any, float], Demands] | None = None
    gemm: Callable[[ModelSpec, int], tuple[int, int]] | None = None
    bytes: Callable[[ModelSpec, int, int, int], float] | None = None
    family: str | None = None  # kernel family; None: a collective
    weight: str | None = None  # the layer weight it reads first (fp8 GEMMs: e4m3 under fp8)
    fp8: bool = False  # a GEMM whose weight and input are e4m3 under --quantization fp8
    # HF frontend rules (rank, kind, target, inside): kind "module" (a module path glob),
    # "func" (a function's name) or "op" (a frontend operator of frontend/custom_ops.py); by rank
    hf: tuple[tuple[int, str, str, str | None], ...] = ()
    collective: str | None = None  # all-reduce: its group ("attn" | "ffn")

    def holds(self, spec: ModelSpec) -> bool:
        return self.models == "all" or (self.models == "moe") == spec.is_moe


def _heads(spec: ModelSpec, tp: int) -> tuple[int, int, int]:
    return spec.num_heads // tp, max(1, spec.num_kv_heads // tp), spec.head_dim


def _qkv_cost(spec: ModelSpec, tp: int, mix: Any, s8: float) -> Demands:
    B, D, S = mix.dense_batch, spec.hidden_size, spec.dtype_bytes
    qkv = spec.q_size + 2 * spec.kv_size
    bias = (qkv if spec.qkv_bias else 0) * S
    return 2 * B * D * qkv, (D * qkv + B * D) * s8 + bias + B * qkv * S, 0.0


def _rope_cost(spec: ModelSpec, tp: int, mix: Any, s8: float) -> Demands:
    B, q, kv = mix.dense_batch, spec.q_size, spec.kv_size
    return 6 * B * (q + kv), 2 * B * (q + 2 * kv) * spec.dtype_bytes, 0.0


def _decode_cost(spec: ModelSpec, tp: int, mix: Any, s8: float) -> Demands:
    n_d, q, kv = mix.num_decode, spec.q_size, spec.kv_size
    return (4 * spec.num_heads * spec.head_dim * n_d * mix.decode_context,
            (n_d * mix.decode_context * 2 * kv + n_d * (2 * q + 2 * kv)) * spec.dtype_bytes, 0.0)


def _prefill_cost(spec: ModelSpec, tp: int, mix: Any, s8: float) -> Demands:
    n_p = mix.num_prefill
    return (4 * spec.num_heads * spec.head_dim * n_p * mix.prefill_context,
            n_p * (2 * spec.q_size + 2 * spec.kv_size) * spec.dtype_bytes, 0.0)


def _o_cost(spec: ModelSpec, tp: int, mix: Any, s8: float) -> Demands:
    B, q, D = mix.dense_batch, spec.q_size, spec.hidden_size
    return 2 * B * q * D, (q * D + B * q) * s8 + B * D * spec.dtype_bytes, 0.0


def _all_reduce_cost(spec: ModelSpec, tp: int, mix: Any, s8: float) -> Demands:
    B, D = mix.dense_batch, spec.hidden_size
    sent = 2 * (tp - 1) * B * D * spec.dtype_bytes
    return (tp - 1) * B * D, sent, sent


def _half_collective_cost(reduces: bool) -> Callable[[ModelSpec, int, Any, float], Demands]:
    """A reduce-scatter or an all-gather: half an all-reduce's bytes each."""
    def cost(spec: ModelSpec, tp: int, mix: Any, s8: float) -> Demands:
        B, D = mix.dense_batch, spec.hidden_size
        sent = (tp - 1) * B * D * spec.dtype_bytes
        return ((tp - 1) * B * D if reduces else 0.0), sent, sent
    return cost


def _norm_cost(spec: ModelSpec, tp: int, mix: Any, s8: float) -> Demands:
    B, D = mix.dense_batch, spec.hidden_size
    return 5 * B * D, (4 * B * D + D) * spec.dtype_bytes, 0.0


def _experts(spec: ModelSpec, mix: Any) -> tuple[int, int]:
    """(token-expert pairs, experts whose weights a GEMM loads): (B, 1) for dense models."""
    t_exp = mix.dense_batch * max(spec.num_experts_per_tok, 1)
    return t_exp, min(max(spec.num_experts, 1), t_exp)


def _ug_cost(spec: ModelSpec, tp: int, mix: Any, s8: float) -> Demands:
    B, D, inter = mix.dense_batch, spec.hidden_size, spec.intermediate_size
    t_exp, touched = _experts(spec, mix)
    router = 2 * B * D * spec.num_experts if spec.is_moe else 0
    w = touched * D * 2 * inter
    return 2 * t_exp * D * 2 * inter + router, (w + B * D) * s8 + (
        D * spec.num_experts + t_exp * 2 * inter) * spec.dtype_bytes, 0.0


def _act_cost(spec: ModelSpec, tp: int, mix: Any, s8: float) -> Demands:
    t_exp, inter = _experts(spec, mix)[0], spec.intermediate_size
    return 4 * t_exp * inter, 3 * t_exp * inter * spec.dtype_bytes, 0.0


def _d_cost(spec: ModelSpec, tp: int, mix: Any, s8: float) -> Demands:
    t_exp, touched = _experts(spec, mix)
    inter, D = spec.intermediate_size, spec.hidden_size
    w = touched * inter * D
    return 2 * t_exp * inter * D, (w + t_exp * inter) * s8 + \
        mix.dense_batch * D * spec.dtype_bytes, 0.0


def _qkv_dims(spec: ModelSpec, tp: int) -> tuple[int, int]:
    hq, hkv, d = _heads(spec, tp)
    return spec.hidden_size, (hq + 2 * hkv) * d


def _o_dims(spec: ModelSpec, tp: int) -> tuple[int, int]:
    hq, _, d = _heads(spec, tp)
    return hq * d, spec.hidden_size


def _ug_dims(spec: ModelSpec, tp: int) -> tuple[int, int]:
    return spec.hidden_size, 2 * (spec.intermediate_size // tp)


def _d_dims(spec: ModelSpec, tp: int) -> tuple[int, int]:
    return spec.intermediate_size // tp, spec.hidden_size


def decode_kv_bytes(spec: ModelSpec, tp: int, requests: int, context: int) -> float:
    """Bytes of K and V that decode attention reads for `requests` at `context` each."""
    _, hkv, d = _heads(spec, tp)
    return 2.0 * requests * context * hkv * d * spec.dtype_bytes


def _decode_bytes(spec: ModelSpec, tp: int, tokens: int, context: int) -> float:
    hq, _, d = _heads(spec, tp)
    return decode_kv_bytes(spec, tp, tokens, context) + 2.0 * tokens * hq * d * spec.dtype_bytes


def _prefill_bytes(spec: ModelSpec, tp: int, tokens: int, context: int) -> float:
    hq, hkv, d = _heads(spec, tp)
    return 4.0 * tokens * (hq + 2 * hkv) * d * spec.dtype_bytes


def _rope_bytes(spec: ModelSpec, tp: int, tokens: int, context: int) -> float:
    hq, hkv, d = _heads(spec, tp)
    return 2.0 * tokens * (hq + 2 * hkv) * d * spec.dtype_bytes


def _norm_bytes(spec: ModelSpec, tp: int, tokens: int, context: int) -> float:
    return 4.0 * tokens * spec.hidden_size * spec.dtype_bytes


def _act_bytes(spec: ModelSpec, tp: int, tokens: int, context: int) -> float:
    return 3.0 * tokens * max(1, spec.num_experts_per_tok) * spec.intermediate_size // tp * \
        spec.dtype_bytes


def _text(s: str) -> Callable[[ModelSpec], str]:
    return lambda spec: s


def _qkv_text(spec: ModelSpec) -> str:
    return "GEMM [T, D] x [D, (Hq+2Hkv)d/tp]" + (" + bias" if spec.qkv_bias else "")


_ALL_REDUCE_TEXT = _text("all-reduce of [T, D]")

# the layer, in program order
OPS: tuple[OpSpec, ...] = (
    OpSpec(KQV, COMPUTE, _qkv_text, ("normed",), ("qkv",), ((ADD_NORM_ATTN, 1),),
           cost=_qkv_cost, gemm=_qkv_dims, family=GEMM, weight="w_qkv", fp8=True,
           hf=((0, "module", "*.self_attn.[qkv]_proj", None),)),
    OpSpec(ROPE_APPEND, OTHER, _text("rotary embedding; write K/V into the paged cache"),
           ("qkv",), ("q", "kv"), ((KQV, 0),), cost=_rope_cost, bytes=_rope_bytes,
           family=ELEMENTWISE, hf=((1, "func", "apply_rotary_pos_emb", None),
                                   (2, "op", "KV_APPEND", None))),
    OpSpec(ATTN_DECODE, MEMORY, _text("decode tokens: read each request's KV (GQA)"),
           ("q", "kv"), ("attn",), ((ROPE_APPEND, 0),), domain="decode", cost=_decode_cost,
           bytes=_decode_bytes, family=DECODE, hf=((3, "op", "ATTN_DECODE", None),)),
    OpSpec(ATTN_PREFILL, COMPUTE, _text("prefill tokens: causal attention over the prompt"),
           ("q", "kv"), ("attn",), ((ROPE_APPEND, 0),), domain="prefill", cost=_prefill_cost,
           bytes=_prefill_bytes, family=PREFILL, hf=((4, "op", "ATTN_PREFILL", None),)),
    OpSpec(O_PROJ, COMPUTE, _text("GEMM [T, Hq d/tp] x [Hq d/tp, D]"), ("attn",), ("o_out",),
           ((ATTN_DECODE, 0), (ATTN_PREFILL, 0)), cost=_o_cost, gemm=_o_dims, family=GEMM,
           weight="w_o", fp8=True, hf=((5, "module", "*.o_proj", None),)),
    OpSpec(AR_ATTN, NETWORK, _ALL_REDUCE_TEXT, ("o_out",), ("o_out",), ((O_PROJ, 0),),
           cost=_all_reduce_cost, collective="attn"),
    OpSpec(ADD_NORM_FFN, OTHER, _text("residual add + RMSNorm"), ("o_out", "residual"),
           ("residual", "normed"), ((O_PROJ, 0),), cost=_norm_cost, bytes=_norm_bytes,
           family=ELEMENTWISE, weight="w_gate_up",
           hf=((6, "module", "*.post_attention_layernorm", None),)),
    OpSpec(UG, COMPUTE, _text("GEMM [T, D] x [D, 2I/tp]"), ("normed",), ("gate_up",),
           ((ADD_NORM_FFN, 0),), models="dense", cost=_ug_cost, gemm=_ug_dims, family=GEMM,
           weight="w_gate_up", fp8=True, hf=((7, "module", "*.mlp.gate_proj", None),
                                             (8, "module", "*.mlp.up_proj", None))),
    OpSpec(EXPERTS_UG, COMPUTE, _text("router + grouped GEMM [T k, D] x [D, 2I/tp]"),
           ("normed",), ("gate_up", "router"), ((ADD_NORM_FFN, 0),), models="moe",
           cost=_ug_cost, gemm=_ug_dims, family=GROUPED, weight="w_gate_up", fp8=True,
           hf=((12, "module", "*.mlp.gate", None), (13, "op", "EXPERTS_UG", None))),
    OpSpec(ACT, OTHER, _text("SiLU(gate) * up"), ("gate_up",), ("act",),
           ((UG, 0), (EXPERTS_UG, 0)),
           cost=_act_cost, bytes=_act_bytes, family=ELEMENTWISE, weight="w_down",
           hf=((9, "module", "*.mlp.act_fn", None), (10, "func", "mul", "*.mlp"),
               (14, "func", "_default_apply_gate", None))),
    OpSpec(D, COMPUTE, _text("GEMM [T, I/tp] x [I/tp, D]"), ("act",), ("ffn_out",), ((ACT, 0),),
           models="dense", cost=_d_cost, gemm=_d_dims, family=GEMM, weight="w_down", fp8=True,
           hf=((11, "module", "*.mlp.down_proj", None),)),
    OpSpec(EXPERTS_D, COMPUTE, _text("grouped GEMM [T k, I/tp] x [I/tp, D]"), ("act", "router"),
           ("ffn_out",), ((ACT, 0),), models="moe", cost=_d_cost, gemm=_d_dims, family=GROUPED,
           weight="w_down", fp8=True, hf=((15, "op", "EXPERTS_D", None),)),
    OpSpec(AR_FFN, NETWORK, _ALL_REDUCE_TEXT, ("ffn_out",), ("ffn_out",),
           ((D, 0), (EXPERTS_D, 0)),
           cost=_all_reduce_cost, collective="ffn"),
    OpSpec(ADD_NORM_ATTN, OTHER, _text("residual add + RMSNorm feeding the next layer's kqv"),
           ("ffn_out", "residual"), ("residual", "normed"), ((D, 0), (EXPERTS_D, 0)),
           cost=_norm_cost,
           bytes=_norm_bytes, family=ELEMENTWISE, weight="w_qkv",
           hf=((16, "module", "*.input_layernorm", None),
               (17, "module", "*.norm", None))),  # the final norm closes the last layer
)

# Alternative form of each all-reduce (tp > 1): reduce-scatter after the producing GEMM, the
# norm on the scattered shard, all-gather before the consuming GEMM (NanoFlow §4.1.2,
# "operation transformations"). The search picks one form per collective.
COLLECTIVE_FORMS: dict[str, tuple[OpDef, OpDef]] = {
    AR_ATTN: (OpDef(RS_ATTN, NETWORK, "reduce-scatter of [T, D] after o"),
              OpDef(AG_ATTN, NETWORK, "all-gather of [T, D] before the FFN")),
    AR_FFN: (OpDef(RS_FFN, NETWORK, "reduce-scatter of [T, D] after d"),
             OpDef(AG_FFN, NETWORK, "all-gather of [T, D] before the next kqv")),
}
FORM_COST = {RS_ATTN: _half_collective_cost(True), RS_FFN: _half_collective_cost(True),
             AG_ATTN: _half_collective_cost(False), AG_FFN: _half_collective_cost(False)}
BY_NAME: dict[str, OpSpec] = {op.name: op for op in OPS}
def all_names(table: tuple[OpSpec, ...]) -> tuple[str, ...]:
    """Every name a schedule may give an op of `table`: its own and its collectives' forms."""
    return tuple(n for op in table
                 for n in (op.name, *(f.name for f in COLLECTIVE_FORMS.get(op.name, ()))))


ALL_NAMES = all_names(OPS)
GEMM_OPS = tuple(op.name for f in (GEMM, GROUPED) for op in OPS if op.family == f)  # dense, MoE
FP8_GEMM_OPS = tuple(op.name for op in OPS if op.fp8)
GEMM_WEIGHT = {op.name: op.weight for op in OPS if op.fp8}  # the e4m3 weight of each FP8 GEMM
WEIGHT_OF = {op.name: op.weight for op in OPS if op.weight}  # the weight each op reads first
OP_FAMILY = {op.name: op.family for op in OPS if op.family}
COLLECTIVES = tuple(op.name for op in OPS if op.collective)  # all-reduces: no-ops at tp = 1


def spec_of(name: str) -> OpSpec | None:
    return BY_NAME.get(name)


def domain_of(name: str) -> str:
    """The batch rows op `name` works on: "decode", "prefill" or "all" (any other name)."""
    op = BY_NAME.get(name)
    return op.domain if op is not None else "all"


def ffn_ops(spec: ModelSpec) -> tuple[str, str]:
    """(up/gate GEMM, down GEMM) of `spec`'s FFN: dense or grouped experts."""
    return (EXPERTS_UG, EXPERTS_D) if spec.is_moe else (UG, D)


def layer_ops(spec: ModelSpec, tp: int = 1) -> list[OpDef]:
    """The ops of one decoder layer of `spec` at tensor parallelism `tp`, in program order."""
    return [OpDef(op.name, op.resource, op.description(spec)) for op in OPS
            if op.holds(spec) and (tp > 1 or op.resource != NETWORK)]
