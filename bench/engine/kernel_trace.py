"""Kernels of a traced forward, attributed to the layer's ops (bench/engine/graph_kernels.py).

A CUPTI trace (torch.profiler) of one Sequential forward lists its kernels in launch order,
named by the library or Triton function that ran, not by op. The layer's program order
(`models.ops.layer_ops`: kqv, rope_append, attn_decode, attn_prefill, o, add_norm_ffn, ug, act,
d, add_norm_attn) and the kernels' names give each its op:

- a layer starts at its first GEMM (kqv): the trace is cut at every fourth GEMM, so everything
  before the first is the embedding (its RMSNorm included), and the last layer keeps what
  follows it (the final norm is its add_norm_attn; a fifth GEMM there is the LM head);
- GEMMs (cuBLAS `nvjet`/`xmma`/`gemm`, Triton `_persistent_gemm_kernel`) are kqv, o, ug, d in
  that order;
- the RMSNorm + residual kernel before ug is add_norm_ffn, after d add_norm_attn;
- decode attention is every kernel named `decode` (partials, split merge, `decode_bulk`),
  prefill attention `prefill`, `rope` rope_append, `silu` act; the FP8 row kernel (`rows_fp8`)
  is act after ug (SiLU·mul writing e4m3) and o before o (its input's quantisation, which the
  FP8 profile's `o` row holds); anything else is `other`.

Dense models at tp = 1 only (no all-reduce, no experts): `attribute` says why it cannot
attribute a trace rather than guessing.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

GEMMS = ("kqv", "o", "ug", "d")
_GEMM = re.compile(r"nvjet|gemm|cutlass|xmma", re.IGNORECASE)
_BY_NAME = (("decode", "attn_decode"), ("prefill", "attn_prefill"), ("rope", "rope_append"),
            ("silu", "act"), ("rms_norm", "norm"), ("rows_fp8", "rows_fp8"))


@dataclass(frozen=True)
class TracedKernel:
    name: str
    start_us: float
    duration_us: float


def kind_of(name: str) -> str:
    """'gemm', an op name, 'norm' or 'rows_fp8' (which op depends on its place) or 'other'."""
    if _GEMM.search(name):
        return "gemm"
    return next((op for key, op in _BY_NAME if key in name), "other")


@dataclass(frozen=True)
class Attribution:
    """Per layer, each op's GPU time (us, all its kernels summed) and the kernel names seen."""

    per_layer: list[dict[str, float]]
    names: dict[str, list[str]]
    embed_us: float
    lm_head_us: float

    def median_us(self) -> dict[str, float]:
        ops = sorted({op for layer in self.per_layer for op in layer})
        return {op: statistics.median(layer.get(op, 0.0) for layer in self.per_layer)
                for op in ops}


def attribute(kernels: list[TracedKernel], num_layers: int) -> Attribution | str:
    """Attribute one forward's kernels (in any order: sorted by start here) to ops; a string
    saying why when the trace is not `num_layers` dense layers."""
    order = sorted(kernels, key=lambda k: k.start_us)
    gemm_at = [i for i, k in enumerate(order) if kind_of(k.name) == "gemm"]
    want = 4 * num_layers
    if len(gemm_at) not in (want, want + 1):
        return (f"{len(gemm_at)} GEMM kernels in the forward, expected {want} (4 per layer, "
                f"{num_layers} layers) or {want + 1} with the LM head")
    starts = gemm_at[0:want:4]
    embed_us = sum(k.duration_us for k in order[:starts[0]])
    per_layer: list[dict[str, float]] = []
    names: dict[str, set[str]] = defaultdict(set)
    lm_head_us = 0.0
    for layer, begin in enumerate(starts):
        end = starts[layer + 1] if layer + 1 < len(starts) else len(order)
        times: dict[str, float] = defaultdict(float)
        gemms = 0
        for k in order[begin:end]:
            kind = kind_of(k.name)
            if kind == "gemm":
                if gemms == 4:  # past the last layer's d: the LM head
                    lm_head_us += k.duration_us
                    continue
                op = GEMMS[gemms]
                gemms += 1
            elif kind == "norm":
                op = "add_norm_ffn" if gemms < 3 else "add_norm_attn"
            elif kind == "rows_fp8":
                op = "act" if gemms == 3 else "o"
            else:
                op = kind
            times[op] += k.duration_us
            names[op].add(k.name)
        per_layer.append(dict(times))
    return Attribution(per_layer, {op: sorted(v) for op, v in names.items()}, embed_us,
                       lm_head_us)


def layer_gaps(kernels: list[TracedKernel], num_layers: int) -> tuple[float, int]:
    """(idle GPU time between consecutive kernels, in us, and the kernels) from the first
    layer's first GEMM to the last layer's last kernel before the LM head: what a forward
    spends between its kernels, which the rows (each kernel timed alone) do not hold."""
    order = sorted(kernels, key=lambda k: k.start_us)
    gemm = [i for i, k in enumerate(order) if kind_of(k.name) == "gemm"]
    end = gemm[4 * num_layers] if len(gemm) > 4 * num_layers else len(order)
    part = order[gemm[0]:end] if gemm else []
    idle = sum(max(0.0, b.start_us - (a.start_us + a.duration_us))
               for a, b in zip(part, part[1:], strict=False))
    return idle, len(part)


def cuda_kernels(prof: Any) -> list[TracedKernel]:
    """The GPU kernels of a finished torch.profiler run (memcpy and memset left out)."""
    import torch

    out = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.device_time_total <= 0:
            continue
        if "Memcpy" in ev.name or "Memset" in ev.name:
            continue
        out.append(TracedKernel(ev.name, float(ev.time_range.start), float(ev.device_time_total)))
    return sorted(out, key=lambda k: k.start_us)
