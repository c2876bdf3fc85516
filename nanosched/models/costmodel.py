r"""Analytic cost model of one serving iteration (NanoFlow §3).

For a model, tensor parallelism N = tp, a dense batch of B tokens and a workload with mean prompt
length p and mean output length d, the steady-state batch holds

    n_d = B d / (p + d)   decode tokens (one per running request), context c_d = p + d/2,
    n_p = B - n_d         prefill tokens, causal context c_p = (p + 1)/2 on average.

Per op (summed over L layers, logical tensors counted once across the N GPUs, as NanoFlow's
Table 2 does): FLOPs F, bytes loaded M (weights + activations in + out), network bytes X
(ring all-reduce: 2 (N-1) B D S per all-reduce, summed over GPUs), priced against aggregate
ceilings; an op's bottleneck is its largest time.

More in docs/design.md, module notes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from nanosched.constants import QUANTIZATIONS, TOKEN_QUANTUM
from nanosched.errors import ConfigError
from nanosched.hardware import GPUSpec
from nanosched.models.ops import (
    COMPUTE,
    FORM_COST,
    FP8_GEMM_OPS,
    MEMORY,
    NETWORK,
    layer_ops,
    spec_of,
)
from nanosched.models.spec import ModelSpec
from nanosched.workloads import Workload

DEFAULT_MAX_DENSE_BATCH = 2048  # `auto` caps here: NanoFlow's best for 70B on 8 GPUs
# the W8A8 GEMM's rate over the bf16 GEMM's at large batches: on an H200 the FP8 GEMM of
# kernels/dispatch.linear_fp8 ran 1.65-1.71x torch.mm's at 1,024-2,048 rows and 1.15-1.69x at
# 256 (bench/kernels/kernels_fp8.py, as issue 46 reports it), not the datasheet's 2x; the
# low end of the large batches
FP8_GEMM_SPEEDUP = 1.65


def fp8_gemm(name: str, quantization: str) -> bool:
    """Whether op `name` is an e4m3 GEMM under `quantization` (none | fp8)."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}; got "
                          f"{quantization!r}")
    return quantization == "fp8" and name in FP8_GEMM_OPS


def weight_bytes(spec: ModelSpec, quantization: str = "none") -> float:
    """Bytes of all the model's weights: the model dtype's, the layer GEMM weights at a byte
    an element under fp8 (kqv, o, and ug and d, or every MoE expert's)."""
    total = spec.num_params() * spec.dtype_bytes
    if not any(fp8_gemm(op, quantization) for op in FP8_GEMM_OPS):
        return total
    D, q = spec.hidden_size, spec.q_size
    per_layer = D * (q + 2 * spec.kv_size) + q * D + \
        3 * D * spec.intermediate_size * max(spec.num_experts, 1)
    return total - spec.num_layers * per_layer * (spec.dtype_bytes - 1)


@dataclass(frozen=True)
class BatchMix:
    """Composition of a steady-state dense batch."""

    dense_batch: int
    num_decode: float
    num_prefill: float
    decode_context: float
    prefill_context: float
    num_sampled: float  # tokens that need logits: decode tokens + prompts finishing prefill


def batch_mix(workload: Workload, dense_batch: int) -> BatchMix:
    n_d = dense_batch * workload.decode_fraction
    n_p = dense_batch - n_d
    return BatchMix(dense_batch, n_d, n_p, workload.input_len + workload.output_len / 2,
                    (workload.input_len + 1) / 2, n_d + n_p / workload.input_len)


@dataclass(frozen=True)
class OpCost:
    name: str
    resource: str
    flops: float
    mem_bytes: float
    net_bytes: float
    t_compute_s: float
    t_mem_s: float
    t_net_s: float

    @property
    def time_s(self) -> float:
        return max(self.t_compute_s, self.t_mem_s, self.t_net_s)

    @property
    def bottleneck(self) -> str:
        times = {COMPUTE: self.t_compute_s, MEMORY: self.t_mem_s, NETWORK: self.t_net_s}
        return max(times, key=times.__getitem__)


def nano_mix(tokens: int, num_decode: float, decode_context: float,
             prefill_context: float) -> BatchMix:
    """The mix of one nano-batch of `tokens` tokens, `num_decode` of them decode tokens."""
    return BatchMix(tokens, num_decode, tokens - num_decode, decode_context, prefill_context,
                    num_decode)


def op_demands(spec: ModelSpec, tp: int, mix: BatchMix, name: str,
               quantization: str = "none") -> tuple[float, float, float]:
    """(FLOPs, bytes loaded, network bytes) of op `name` for one layer, logical tensors.

    `mix` may be a whole dense batch or one nano-batch (`nano_mix`): the formulas hold for any
    token count; the formulas are the op table's (models/ops.py `OpSpec.cost`). Under
    `quantization` fp8 a layer GEMM's weight and input are e4m3 (module docstring).
    """
    op = spec_of(name)
    cost = op.cost if op is not None else FORM_COST.get(name)
    if cost is None:
        raise ConfigError(f"cost model has no formula for op {name!r}")
    return cost(spec, tp, mix, 1 if fp8_gemm(name, quantization) else spec.dtype_bytes)


def _timed(name: str, resource: str, flops: float, mem: float, net: float, gpu: GPUSpec,
           tp: int, speedup: float = 1.0) -> OpCost:
    return OpCost(name, resource, flops, mem, net,
                  flops / (tp * gpu.compute_gflops * speedup * 1e9),
                  mem / (tp * gpu.mem_bw_gbs * 1e9),
                  net / (tp * gpu.net_bw_one_way_gbs * 1e9) if net else 0.0)


def op_costs(spec: ModelSpec, gpu: GPUSpec, tp: int, mix: BatchMix,
             quantization: str = "none") -> list[OpCost]:
    """Every op of the layer, times L, then the LM head over the sampled tokens (fp8: the
    layer GEMMs e4m3, at FP8_GEMM_SPEEDUP times the GPU's GEMM peak)."""
    costs = []
    for op in layer_ops(spec, tp):
        f, m, x = op_demands(spec, tp, mix, op.name, quantization)
        L = spec.num_layers
        speedup = FP8_GEMM_SPEEDUP if fp8_gemm(op.name, quantization) else 1.0
        costs.append(_timed(op.name, op.resource, f * L, m * L, x * L, gpu, tp, speedup))
    sampled = mix.num_sampled
    V, D, S = spec.vocab_size, spec.hidden_size, spec.dtype_bytes
    costs.append(_timed("lm_head", COMPUTE, 2 * sampled * D * V,
                        (V * D + sampled * D) * S + sampled * V * 4, 0.0, gpu, tp))
    return costs


def activation_bytes_per_gpu(spec: ModelSpec, tp: int, dense_batch: int) -> float:
    """Working activations of one forward on one GPU (two nano-batch buffers of the widest op)."""
    widest = 2 * spec.hidden_size + (spec.q_size + 2 * spec.kv_size) // tp + \
        2 * spec.intermediate_size * max(1, spec.num_experts_per_tok) // tp
    return 2 * dense_batch * widest * spec.dtype_bytes


def kv_capacity_tokens(spec: ModelSpec, tp: int, memory_bytes: float, dense_batch: int,
                       mem_util: float = 0.85, kv_dtype: str = "auto",
                       quantization: str = "none") -> float:
    """KV-cache tokens one GPU of `memory_bytes` holds beside its weights (`quantization`'s)
    and the working activations of a `dense_batch` forward (the engine's default `mem_util`),
    in a cache of `kv_dtype` ("fp8" holds about twice the tokens of a bf16 one)."""
    budget = (mem_util * memory_bytes - weight_bytes(spec, quantization) / tp
              - activation_bytes_per_gpu(spec, tp, dense_batch))
    return max(0.0, budget / spec.kv_bytes_per_token(tp, kv_dtype=kv_dtype))


def max_dense_batch(spec: ModelSpec, gpu: GPUSpec, tp: int, workload: Workload,
                    mem_util: float = 0.9, quantization: str = "none") -> int:
    """Largest multiple of 128 tokens whose weights (`quantization`'s), KV cache and
    activations fit each GPU."""
    if not 0 < mem_util <= 1:
        raise ConfigError(f"--mem-util must be in (0, 1], got {mem_util}")
    budget = mem_util * gpu.mem_bytes - weight_bytes(spec, quantization) / tp
    kv_per_batch_token = (workload.decode_fraction *
                          (workload.input_len + workload.output_len / 2) *
                          spec.kv_bytes_per_token(tp))
    per_token = kv_per_batch_token + activation_bytes_per_gpu(spec, tp, 1)
    if budget <= 0 or budget < TOKEN_QUANTUM * per_token:
        raise ConfigError(
            f"model {spec.name!r} does not fit {tp} x {gpu.name} ({gpu.mem_gib:g} GiB each) with "
            f"a {TOKEN_QUANTUM}-token batch: raise --tp or use a GPU with more memory")
    return int(budget // per_token) // TOKEN_QUANTUM * TOKEN_QUANTUM


def choose_tp(spec: ModelSpec, gpu: GPUSpec, workload: Workload, dense_batch: int | None = None,
              mem_util: float = 0.9, max_tp: int = 64, quantization: str = "none") -> int:
    """Smallest tp whose GPUs hold the weights and the KV cache of the dense batch.

    The dense batch defaults to 2048 tokens (NanoFlow's for 70B models).
    """
    target = DEFAULT_MAX_DENSE_BATCH if dense_batch is None else dense_batch
    tried = []
    for tp in range(1, max_tp + 1):
        if not spec.tp_ok(tp):
            continue
        tried.append(tp)
        try:
            if max_dense_batch(spec, gpu, tp, workload, mem_util, quantization) >= target:
                return tp
        except ConfigError:
            continue
    raise ConfigError(f"no tp in {tried} fits a {target}-token dense batch of {spec.name!r} on "
                      f"{gpu.name}: lower --dense-batch or give --tp")


def optimal_tokens_per_s_per_gpu(spec: ModelSpec, compute_gflops: float) -> float:
    """NanoFlow Eq. 5: compute / (2 P), P = parameters a token touches."""
    return compute_gflops * 1e9 / (2 * spec.num_params(active=True))


@dataclass(frozen=True)
class Analysis:
    model: ModelSpec
    gpu: GPUSpec
    tp: int
    workload: Workload
    mix: BatchMix
    max_dense_batch: int
    ops: list[OpCost] = field(default_factory=list)

    def total(self, attr: str) -> float:
        return sum(getattr(op, attr) for op in self.ops)

    @property
    def bottleneck(self) -> str:
        totals = {COMPUTE: self.total("t_compute_s"), MEMORY: self.total("t_mem_s"),
                  NETWORK: self.total("t_net_s")}
        return max(totals, key=totals.__getitem__)

    @property
    def t_r(self) -> float:
        """Eq. 4 with the exact iteration compute time: (MemSize / MemBW) / T_compute."""
        t_compute = 2 * self.mix.dense_batch * self.model.num_params(active=True) / (
            self.tp * self.gpu.compute_gflops * 1e9)
        return self.gpu.mem_bytes / (self.gpu.mem_bw_gbs * 1e9) / t_compute

    @property
    def sequential_iteration_s(self) -> float:
        """Each op alone at its own bottleneck, one after another."""
        return sum(op.time_s for op in self.ops)

    @property
    def optimal_tokens_per_s_per_gpu(self) -> float:
        return optimal_tokens_per_s_per_gpu(self.model, self.gpu.compute_gflops)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model.name, "gpu": self.gpu.to_json(), "tp": self.tp,
            "workload": self.workload.to_json(), "mix": asdict(self.mix),
            "max_dense_batch": self.max_dense_batch,
            "params": self.model.num_params(), "active_params": self.model.num_params(True),
            "ops": [{**asdict(op), "bottleneck": op.bottleneck} for op in self.ops],
            "totals": {"flops": self.total("flops"), "mem_bytes": self.total("mem_bytes"),
                       "net_bytes": self.total("net_bytes"),
                       "t_compute_s": self.total("t_compute_s"),
                       "t_mem_s": self.total("t_mem_s"), "t_net_s": self.total("t_net_s")},
            "bottleneck": self.bottleneck, "t_r": self.t_r,
            "sequential_iteration_s": self.sequential_iteration_s,
            "optimal_tokens_per_s_per_gpu": self.optimal_tokens_per_s_per_gpu,
        }


def analyze(spec: ModelSpec, gpu: GPUSpec, tp: int, workload: Workload,
            dense_batch: int | None = None, mem_util: float = 0.9) -> Analysis:
    """Price one iteration; `dense_batch=None` takes the largest that fits, capped at 2048."""
    spec.check_tp(tp)
    fit = max_dense_batch(spec, gpu, tp, workload, mem_util)
    if dense_batch is None:
        dense_batch = min(fit, DEFAULT_MAX_DENSE_BATCH)
    elif not isinstance(dense_batch, int) or dense_batch < 1:
        raise ConfigError(f"--dense-batch must be a positive integer, got {dense_batch!r}")
    mix = batch_mix(workload, dense_batch)
    return Analysis(spec, gpu, tp, workload, mix, fit, op_costs(spec, gpu, tp, mix))


__all__ = ["Analysis", "BatchMix", "OpCost", "analyze", "batch_mix", "choose_tp",
           "max_dense_batch", "nano_mix", "op_costs", "op_demands",
           "optimal_tokens_per_s_per_gpu", "FP8_GEMM_SPEEDUP", "fp8_gemm", "weight_bytes"]
