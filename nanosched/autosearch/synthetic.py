r"""A synthetic profile (`nanosched.profile/1`) built from the cost model: not a measurement.

Used by the tests and as the development profile until measured profiles ship. Per op and
token count T (128, 256, ..., dense batch), on one of the tp GPUs:

    t(T) = max(F / (tp C eff(T)), M / (tp W)) + t_launch         compute-class ops
    t(T) = max(F / (tp C), M / (tp W)) + t_launch                 memory- and other-class ops
    t(T) = t_lat + X / (tp W_bus)                                 network ops

More in docs/search.md, module notes.
"""

from __future__ import annotations

import math
from dataclasses import replace

from nanosched.autosearch.opgraph import layer_graph
from nanosched.constants import TOKEN_QUANTUM
from nanosched.errors import ConfigError
from nanosched.hardware import GPUSpec
from nanosched.models import ops as optable
from nanosched.models.costmodel import FP8_GEMM_SPEEDUP, fp8_gemm, nano_mix, op_demands
from nanosched.models.ops import COMPUTE, MEMORY, NETWORK
from nanosched.models.spec import ModelSpec
from nanosched.profiler.format import Ceilings, Identity, KernelRow, Profile, RPPoint

LAUNCH_US = 3.0
NET_LATENCY_US = 8.0
GEMM_HALF_TOKENS = 64.0
DEFAULT_SMS = 132
MEMORY_RP = ((0.1, 0.2), (0.2, 0.3), (0.3, 0.55), (0.4, 0.8), (0.5, 0.82), (0.6, 0.83),
             (0.7, 0.84), (0.8, 0.85), (0.9, 0.95))
NETWORK_RP = ((0.1, 0.3), (0.2, 0.5), (0.3, 0.6), (0.4, 0.7), (0.5, 0.75), (0.6, 0.8),
              (0.7, 0.85), (0.8, 0.9), (0.9, 1.0))
NO_FP8 = ("v100", "a100-40g", "a100", "mi250")  # no FP8 tensor cores: W8A8 cannot run there


def synthetic_ceilings(gpu: GPUSpec, tp: int, quantization: str = "none") -> Ceilings:
    """`bf16_ceilings`, the GEMM figures times FP8_GEMM_SPEEDUP for fp8 weights."""
    ceil = bf16_ceilings(gpu, tp)
    if not fp8_gemm(optable.KQV, quantization):
        return ceil
    return replace(ceil, gemm_tflops_8192=round(ceil.gemm_tflops_8192 * FP8_GEMM_SPEEDUP, 3),
                   gemm_tflops_model=round(ceil.gemm_tflops_model * FP8_GEMM_SPEEDUP, 3))


def bf16_ceilings(gpu: GPUSpec, tp: int) -> Ceilings:
    """Ceilings as fractions of the datasheet: GEMM 77% / 72%, copy 90%, bus 70% one way."""
    tflops = gpu.compute_gflops / 1e3
    return Ceilings(gemm_tflops_8192=0.77 * tflops, gemm_tflops_model=0.72 * tflops,
                    copy_gbs=0.9 * gpu.mem_bw_gbs,
                    allreduce_busbw_gbs=0.7 * gpu.net_bw_one_way_gbs if tp > 1 else None,
                    allreduce_latency_us=NET_LATENCY_US if tp > 1 else None,
                    allreduce_modelled=tp > 1)


def _time_us(spec: ModelSpec, tp: int, ceil: Ceilings, op: str, resource: str, tokens: int,
             context: float, quantization: str = "none") -> float:
    if op == "lm_head":
        f = 2 * tokens * spec.hidden_size * spec.vocab_size
        m = (spec.vocab_size * spec.hidden_size + tokens * spec.hidden_size) * spec.dtype_bytes
        m += tokens * spec.vocab_size * 4
        x = 0.0
    else:
        num_decode = tokens if op == optable.ATTN_DECODE else 0
        # attention rows are keyed by the decode context or, for prefill, the prompt length,
        # whose causal mean context is (p + 1) / 2
        mix = nano_mix(tokens, num_decode, context, (context + 1) / 2)
        f, m, x = op_demands(spec, tp, mix, op, quantization)
    if resource == NETWORK:
        return (ceil.allreduce_latency_us or NET_LATENCY_US) + x / tp / (
            (ceil.allreduce_busbw_gbs or 1.0) * 1e3)
    eff = tokens / (tokens + GEMM_HALF_TOKENS) if resource == COMPUTE else 1.0
    rate = ceil.gemm_tflops_model * (FP8_GEMM_SPEEDUP if fp8_gemm(op, quantization) else 1.0)
    t_flops = f / tp / (rate * 1e6 * eff)
    t = max(t_flops, m / tp / (ceil.copy_gbs * 1e3)) + LAUNCH_US
    if op == optable.O_PROJ and fp8_gemm(op, quantization):  # its input rows quantised first
        t += LAUNCH_US + tokens * spec.q_size * (spec.dtype_bytes + 1) / tp / (
            ceil.copy_gbs * 1e3)
    return t


def _sm_rows(op: str, resource: str, tokens: int, context: int, t_full: float,
             num_sms: int) -> list[KernelRow]:
    rows = [KernelRow(op, tokens, round(t_full, 3), num_sms, "full", "default", context, True,
                      True)]
    if resource == NETWORK:
        return rows
    for sms in (s for s in (100, 68, 32) if s < num_sms):
        if resource == COMPUTE:
            t = t_full * num_sms / (0.97 * sms)
            impl = "torch" if op == optable.ATTN_PREFILL else "cublaslt"
        else:
            t = LAUNCH_US + (t_full - LAUNCH_US) / min(1.0, sms / (0.75 * num_sms))
            impl = "triton_paged" if op == optable.ATTN_DECODE else "triton"
        rows.append(KernelRow(op, tokens, round(t, 3), sms, "green_ctx", impl, context, True,
                              True))
    return rows


def _rp_tables(num_sms: int) -> dict[str, tuple[RPPoint, ...]]:
    mem = tuple(RPPoint(r, p, round(1 - r - 0.02, 3), "green_ctx", num_sms - round(r * num_sms),
                        round(r * num_sms), "cublaslt") for r, p in MEMORY_RP)
    net = tuple(RPPoint(r, p, round(1 - r - 0.02, 3), "cta_bound", num_sms,
                        max(2, round(r * 32)), "cublas") for r, p in NETWORK_RP)
    return {MEMORY: mem, NETWORK: net}


def synthetic_profile(spec: ModelSpec, gpu: GPUSpec, tp: int, dense_batch: int,
                      contexts: list[int], quantization: str = "none") -> Profile:
    """A valid Profile for every op of `layer_graph(spec, tp)` plus `lm_head`, all synthetic.

    Attention rows are tabulated at each of `contexts` (mean KV context lengths); the layer
    GEMMs are W8A8 under `quantization` fp8 (module docstring).
    """
    spec.check_tp(tp)
    if fp8_gemm(optable.KQV, quantization) and gpu.name in NO_FP8:
        raise ConfigError(f"--quantization fp8: a {gpu.name} has no FP8 tensor cores, so W8A8 "
                          f"GEMMs do not run there; pass --gpu of a Hopper (h100, h200) or "
                          f"newer GPU")
    if dense_batch < TOKEN_QUANTUM or dense_batch % TOKEN_QUANTUM:
        raise ConfigError(f"--dense-batch must be a positive multiple of {TOKEN_QUANTUM}, "
                          f"got {dense_batch}")
    if not contexts or min(contexts) < 1:
        raise ConfigError(f"synthetic profile: contexts must be positive, got {contexts}")
    num_sms = gpu.num_sms or DEFAULT_SMS
    ceil = bf16_ceilings(gpu, tp)  # the rows' rates (FP8 GEMMs FP8_GEMM_SPEEDUP times it)
    ops = [(o.name, o.resource) for o in layer_graph(spec, tp).ops] + [("lm_head", COMPUTE)]
    rows: list[KernelRow] = []
    for op, resource in ops:
        ctxs = sorted(set(contexts)) if op.startswith("attn_") else [0]
        for context in ctxs:
            for tokens in range(TOKEN_QUANTUM, dense_batch + 1, TOKEN_QUANTUM):
                t = _time_us(spec, tp, ceil, op, resource, tokens, context, quantization)
                rows.extend(_sm_rows(op, resource, tokens, context, t, num_sms))
    notes = ("SYNTHETIC profile: roofline times from the NanoFlow cost model and GPU priors, "
             "NanoFlow Table 3 R->P; nothing here was measured",
             f"launch floor {LAUNCH_US} us, GEMM efficiency T/(T+{GEMM_HALF_TOKENS:g})"
             + ("" if gpu.num_sms else f"; SM count unknown, assumed {DEFAULT_SMS}"))
    if quantization == "fp8":
        notes += (f"FP8 weights (W8A8): layer GEMMs on e4m3 weights and inputs at "
                  f"{FP8_GEMM_SPEEDUP}x the bf16 GEMM peak (measured ratio, not the "
                  f"datasheet's)",)
    # No date: the profile is a function of its arguments, so its digest (which schedules
    # record) is the same on every day it is made again.
    identity = Identity(f"synthetic-{gpu.name}", num_sms, int(gpu.mem_bytes),
                        command="synthetic_profile")
    return Profile(identity, spec, tp, dense_batch, synthetic_ceilings(gpu, tp, quantization),
                   tuple(rows),
                   rp=_rp_tables(num_sms), notes=notes, quantization=quantization)


def context_grid(*contexts: float) -> list[int]:
    """Multiples of 64 just below and above each context, so lookups interpolate."""
    grid = set()
    for c in contexts:
        grid.update({max(1, math.floor(c / 64) * 64), max(1, math.ceil(c / 64) * 64)})
    return sorted(grid)
