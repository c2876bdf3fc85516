"""The named ops of a decoder layer, in order, with their resource class (docs/design.md, op graph).

This list is the single source of op names: models implement them, the cost model prices them,
the profiler measures them, the search splits them and the runtime launches them.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanosched.models.spec import ModelSpec

COMPUTE, MEMORY, NETWORK, OTHER = "compute", "memory", "network", "other"
RESOURCE_CLASSES = (COMPUTE, MEMORY, NETWORK, OTHER)


@dataclass(frozen=True)
class OpDef:
    name: str
    resource: str  # one of RESOURCE_CLASSES
    description: str


def layer_ops(spec: ModelSpec, tp: int = 1) -> list[OpDef]:
    """The ops of one decoder layer of `spec` at tensor parallelism `tp`, in program order."""
    moe = spec.is_moe
    ops = [
        OpDef("kqv", COMPUTE, "GEMM [T, D] x [D, (Hq+2Hkv)d/tp]" + (" + bias" if spec.qkv_bias
                                                                    else "")),
        OpDef("rope_append", OTHER, "rotary embedding; write K/V into the paged cache"),
        OpDef("attn_decode", MEMORY, "decode tokens: read each request's KV (GQA)"),
        OpDef("attn_prefill", COMPUTE, "prefill tokens: causal attention over the prompt"),
        OpDef("o", COMPUTE, "GEMM [T, Hq d/tp] x [Hq d/tp, D]"),
        OpDef("ar_attn", NETWORK, "all-reduce of [T, D]"),
        OpDef("add_norm_ffn", OTHER, "residual add + RMSNorm"),
        OpDef("experts_ug" if moe else "ug", COMPUTE,
              "router + grouped GEMM [T k, D] x [D, 2I/tp]" if moe else "GEMM [T, D] x [D, 2I/tp]"),
        OpDef("act", OTHER, "SiLU(gate) * up"),
        OpDef("experts_d" if moe else "d", COMPUTE,
              "grouped GEMM [T k, I/tp] x [I/tp, D]" if moe else "GEMM [T, I/tp] x [I/tp, D]"),
        OpDef("ar_ffn", NETWORK, "all-reduce of [T, D]"),
        OpDef("add_norm_attn", OTHER, "residual add + RMSNorm feeding the next layer's kqv"),
    ]
    if tp == 1:
        ops = [op for op in ops if op.resource != NETWORK]
    return ops


# Alternative form of each all-reduce (tp > 1): reduce-scatter after the producing GEMM, the
# norm on the scattered shard, all-gather before the consuming GEMM (NanoFlow §4.1.2,
# "operation transformations"). The search picks one form per collective.
COLLECTIVE_FORMS: dict[str, tuple[OpDef, OpDef]] = {
    "ar_attn": (OpDef("rs_attn", NETWORK, "reduce-scatter of [T, D] after o"),
                OpDef("ag_attn", NETWORK, "all-gather of [T, D] before the FFN")),
    "ar_ffn": (OpDef("rs_ffn", NETWORK, "reduce-scatter of [T, D] after d"),
               OpDef("ag_ffn", NETWORK, "all-gather of [T, D] before the next kqv")),
}
