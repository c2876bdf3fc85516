"""Kernel dispatch: the one place that chooses an op's implementation.

Models call only these functions. Each takes an optional `launch` dict (impls.py: the launch
contract and the implementation names); its `impl` picks the implementation, and without one
`KernelOptions` does: `backend` is "auto" (Triton for CUDA tensors when triton imports, torch
otherwise), "torch" or "triton" (Triton even for CPU tensors, which needs TRITON_INTERPRET=1);
`gemm` is "torch" (= `cublas`), "triton" (= `triton_persistent_128x128`) or any GEMM name.
A Triton implementation on CPU tensors needs TRITON_INTERPRET=1; `cublaslt` on CPU tensors is
the torch reference (there is no SM target to set).

triton is imported lazily, the first time a Triton kernel is used, so `import nanosched.models`
works on machines without it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.kernels import impls
from nanosched.kernels import reference as ref
from nanosched.kernels.common import (
    PIPELINED,
    CascadeGroups,
    PrefillSegments,
    Segment,
    is_interpret,
    num_sms,
)

BACKENDS = ("auto", "torch", "triton")
GEMM_ALIASES = {"torch": "cublas", "triton": impls.persistent_name(128, 128)}
Launch = Mapping[str, Any] | None


@dataclass(frozen=True)
class KernelOptions:
    """Which implementation the models' ops launch when a launch dict names none."""

    backend: str = "auto"  # auto | torch | triton
    gemm: str = "torch"  # torch (cuBLAS/CPU BLAS) | triton (persistent GEMM) | a GEMM impl name
    # auto: cuda_bulk on an FP8 cache where it can run the call, else DEFAULT_DECODE (impls);
    # one of impls.DECODE_CONFIGS; or cascade (impls.CASCADE_DECODE)
    decode_impl: str = impls.AUTO_DECODE
    # the all-reduce of ar_attn / ar_ffn at tp > 1: nccl | copy_engine (impls: network family)
    network: str = "nccl"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"kernel backend {self.backend!r} is not one of {BACKENDS}")
        if self.decode_impl not in impls.DECODE_OPTIONS:
            raise ConfigError(f"decode implementation {self.decode_impl!r} is not one of "
                              f"{impls.DECODE_OPTIONS}")
        impls.network_impl(self.network)
        if self.gemm not in GEMM_ALIASES and not impls.is_known(self.gemm, impls.GEMM):
            raise ConfigError(f"gemm implementation {self.gemm!r} is not one of "
                              f"{tuple(GEMM_ALIASES)} or {impls.known_names(impls.GEMM)}")

    @property
    def gemm_impl(self) -> str:
        """The GEMM implementation name this option stands for."""
        return GEMM_ALIASES.get(self.gemm, self.gemm)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether triton imports on this machine."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(opts: KernelOptions, x: torch.Tensor) -> bool:
    """Whether an op on tensor `x` runs the Triton kernel under `opts`."""
    if opts.backend == "torch":
        return False
    if opts.backend == "triton":
        if not triton_available():
            raise ConfigError("kernel backend 'triton' needs the triton package; "
                              "install nanosched[gpu] or use backend 'torch'")
        if x.device.type != "cuda" and not is_interpret():
            raise ConfigError("kernel backend 'triton' on CPU tensors needs TRITON_INTERPRET=1")
        return True
    return x.device.type == "cuda" and triton_available()


def _chosen(launch: dict[str, Any], family: str, default: Callable[[], str]) -> str:
    """The launch's impl (checked against `family`), or `default()` when it names none."""
    name = launch["impl"]
    return default() if name is None else impls.check_impl(name, family)


def network_args(opts: KernelOptions, launch: Launch) -> tuple[str, int | None]:
    """(implementation, CTA bound) of an all-reduce: the launch dict's, else `opts.network`."""
    args = impls.read_launch(launch)
    return impls.network_impl(_chosen(args, impls.NETWORK, lambda: opts.network),
                              args["max_ctas"])


def _triton_ok(x: torch.Tensor) -> None:
    """Refuse a Triton implementation that cannot run on `x` here."""
    use_triton(KernelOptions("triton"), x)


def _elementwise(opts: KernelOptions, x: torch.Tensor, args: dict[str, Any]) -> bool:
    """Whether an elementwise op runs its Triton kernel (`args`: the read launch dict)."""
    name = _chosen(args, impls.ELEMENTWISE, lambda: "triton" if use_triton(opts, x) else "torch")
    if name == "triton":
        _triton_ok(x)
    return name == "triton"


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           opts: KernelOptions, launch: Launch = None) -> None:
    """out = x @ w.T (+ bias). x [n, K], w [N, K], out [n, N]; launch: impl, num_sms."""
    args = impls.read_launch(launch)
    impl = impls.parse_gemm(_chosen(args, impls.GEMM, lambda: opts.gemm_impl))
    if impl.kind == NARROW:
        raise ConfigError(f"{NARROW} is the W8A8 GEMM only; a {x.dtype} GEMM runs cublas, "
                          f"cublaslt or {impls.PERSISTENT}_<BM>x<BN>")
    if impl.kind == impls.PERSISTENT:
        _triton_ok(x)
        from nanosched.kernels.gemm import GemmConfig, persistent_linear

        cfg = GemmConfig(num_sms=args["num_sms"], block_m=impl.block_m, block_n=impl.block_n)
        persistent_linear(x, w, bias, out, cfg)
    elif impl.kind == "cublaslt" and x.device.type == "cuda":
        with impls.cublaslt_sm_target(impls.sm_target(args), num_sms(x.device)):
            ref.linear(x, w, bias, out)
    else:
        ref.linear(x, w, bias, out)


def linear_fp8(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, out: torch.Tensor, opts: KernelOptions,
               launch: Launch = None) -> None:
    """out = (x @ w.T) * x_scale[:, None] * w_scale[None, :] (+ bias): the W8A8 GEMM. x [n, K]
    e4m3 with one scale per row, w [N, K] e4m3 with one per output channel, out [n, N] in the
    model dtype. On a GPU `torch._scaled_mm` with rowwise scales (CUTLASS on Hopper; launch:
    a `cublaslt` impl's SM target applies), the narrow Triton GEMM (`triton_narrow`) at the
    shapes and rows of NARROW_LAUNCHES or where a launch names it, or the persistent Triton
    GEMM where the launch or `opts.gemm` names it (128-deep K steps: a byte an element);
    elsewhere the exact emulation of `reference`."""
    if x.shape[0] == 0:
        return
    args = impls.read_launch(launch)
    name = _chosen(args, impls.GEMM, lambda: fp8_default_gemm(opts, x, w))
    impl = impls.parse_gemm(name)
    if impl.kind == NARROW:
        _triton_ok(x)
        from nanosched.kernels.gemm_narrow import narrow_linear_fp8

        narrow_linear_fp8(x, x_scale, w, w_scale, bias, out, narrow_config(x.shape[0], *w.shape))
        return
    if impl.kind == impls.PERSISTENT:
        _triton_ok(x)
        from nanosched.kernels.gemm import GemmConfig, persistent_linear

        cfg = GemmConfig(num_sms=args["num_sms"], block_m=impl.block_m, block_n=impl.block_n,
                         block_k=128)
        persistent_linear(x, w, bias, out, cfg, x_scale, w_scale)
        return
    if x.device.type != "cuda":
        ref.linear_fp8(x, x_scale, w, w_scale, bias, out)
        return
    target = impls.cublaslt_sm_target(impls.sm_target(args), num_sms(x.device)) \
        if name == "cublaslt" else contextlib.nullcontext()
    def mm(b: torch.Tensor | None) -> None:
        torch._scaled_mm(x, w.t(), scale_a=x_scale.view(-1, 1), scale_b=w_scale.view(1, -1),
                         bias=b, out_dtype=out.dtype, use_fast_accum=FP8_FAST_ACCUM, out=out)

    with target:
        bias_epilogue_or_add(mm, (x.shape[0], w.shape[0], w.shape[1]), bias, out)


NARROW = impls.NARROW
# The narrow Triton GEMM's launches (block_n, block_k, warps, stages, split_k) for the [N, K]
# weights where it was measured faster than torch._scaled_mm, each for rows up to its bound;
# a W8A8 GEMM that names no implementation runs it for NARROW_ABOVE < rows <= the last bound.
# CUTLASS's 128-row tiles compute 256 rows for 129-255; on an H200 under the power cap the
# narrow GEMM takes Llama-3-70B's layer (tp = 1) in 335-359 us at 160 rows and 386-400 at 192
# against _scaled_mm's 454 and 434, and loses at 128 and from 224 (docs/quantization.md).
NARROW_ABOVE = 128
NARROW_LAUNCHES: dict[tuple[int, int], tuple[tuple[int, tuple[int, ...]], ...]] = {
    (10240, 8192): ((160, (64, 128, 4, 4, 1)), (192, (128, 128, 8, 4, 1))),
    (8192, 8192): ((160, (64, 128, 4, 4, 2)), (192, (64, 128, 4, 4, 1))),
    (57344, 8192): ((160, (64, 128, 4, 4, 1)), (192, (256, 128, 8, 3, 1))),
    (8192, 28672): ((160, (64, 128, 4, 4, 2)), (192, (128, 128, 8, 3, 2))),
}


def narrow_launch(rows: int, n: int, k: int) -> tuple[int, ...] | None:
    """The measured narrow launch for `rows` rows of an [n, k] weight, or None where the
    narrow GEMM was not measured faster (any shape, rows outside the bounds)."""
    if rows <= NARROW_ABOVE:
        return None
    for bound, launch in NARROW_LAUNCHES.get((n, k), ()):
        if rows <= bound:
            return launch
    return None


def fp8_default_gemm(opts: KernelOptions, x: torch.Tensor, w: torch.Tensor) -> str:
    """The W8A8 GEMM of `x`'s rows by `w` where no launch names one: `opts.gemm`'s, except
    that the default (cublas) gives way to the narrow Triton GEMM where NARROW_LAUNCHES holds
    the shape and row count, on a Hopper GPU (where it was measured) with triton."""
    name = opts.gemm_impl
    if (name == "cublas" and narrow_launch(x.shape[0], *w.shape) is not None and x.is_cuda
            and _hopper(x.device.index) and triton_available()):
        return NARROW
    return name


@functools.cache
def _hopper(index: int | None) -> bool:
    """Whether CUDA device `index` (None: the current one) is a Hopper GPU (sm_90)."""
    return torch.cuda.get_device_capability(index) == (9, 0)


def narrow_config(rows: int, n: int, k: int):
    """The narrow GEMM's launch for `rows` rows of an [n, k] weight: the measured one of
    NARROW_LAUNCHES, else NarrowConfig's defaults (a named launch at any shape)."""
    from nanosched.kernels.gemm_narrow import NarrowConfig

    launch = narrow_launch(rows, n, k)
    if launch is None:
        return NarrowConfig()
    bn, bk, warps, stages, split = launch
    return NarrowConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                        split_k=split)


# (rows, N, K) of the FP8 GEMMs whose bias epilogue cuBLASLt has refused in this process
_UNFUSED_BIAS: set[tuple[int, int, int]] = set()


def bias_epilogue_or_add(mm: Callable[[torch.Tensor | None], None], key: tuple[int, int, int],
                         bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """Run `mm(bias)` (the GEMM with its bias in the epilogue); where cuBLASLt finds no
    algorithm for that (CUBLAS_STATUS_NOT_SUPPORTED: on an H200, 7 rows x K 14,336 with a bf16
    bias), `mm(None)` and the bias added after, and that shape goes that way from then on. The
    refusal comes from the host-side heuristic query before any launch, so an eager warm-up
    run meets it before a CUDA graph captures the shape."""
    if bias is not None and key not in _UNFUSED_BIAS:
        try:
            mm(bias)
            return
        except RuntimeError as exc:
            if "NOT_SUPPORTED" not in str(exc):
                raise
            _UNFUSED_BIAS.add(key)
    mm(None)
    if bias is not None:
        out.add_(bias)


# Hopper's FP8 MMA accumulates in reduced precision unless CUTLASS promotes the partial sums
# to fp32 every few K steps; fast accumulation skips that promotion, as vLLM's CUTLASS FP8
# kernels do. On an H200 at Llama-3-8B's shapes (1,024-2,048 rows) it is 1.07-1.15x faster,
# its error against the exact emulation 2.4-3.7e-3 (6.9e-4 promoted), a tenth of e4m3's own
# rounding (bench/results/kernels_fp8-*.json).
FP8_FAST_ACCUM = True


def quantize_rows(x: torch.Tensor, out: torch.Tensor, out_scale: torch.Tensor,
                  opts: KernelOptions, launch: Launch = None) -> None:
    """out [n, K] e4m3 and out_scale [n] fp32: x [n, K] with one dynamic scale per row (an FP8
    GEMM's input that no earlier kernel wrote in e4m3); launch: impl, max_ctas or num_sms."""
    args = impls.read_launch(launch)
    if _elementwise(opts, x, args):
        from nanosched.kernels.elementwise import rows_fp8

        rows_fp8(x, out, out_scale, silu=False,
                 max_ctas=impls.elementwise_ctas(args, "silu_mul"))
    else:
        ref.quantize_rows(x, out, out_scale)


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor, residual_out: torch.Tensor,
                 opts: KernelOptions, launch: Launch = None,
                 out_scale: torch.Tensor | None = None) -> None:
    """residual_out = x (+ residual); out = RMSNorm(residual_out) * weight. All [n, D]; an
    e4m3 `out` gets each row quantised, its scale in `out_scale` [n] (an FP8 GEMM's input);
    launch: impl, max_ctas or num_sms (impls.elementwise_ctas)."""
    args = impls.read_launch(launch)
    if _elementwise(opts, x, args):
        from nanosched.kernels.elementwise import rms_norm_add as kernel

        kernel(x, residual, weight, eps, out, residual_out, out_scale,
               max_ctas=impls.elementwise_ctas(args, "rms_norm_add"))
    else:
        ref.rms_norm_add(x, residual, weight, eps, out, residual_out, out_scale)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor, opts: KernelOptions,
             launch: Launch = None, out_scale: torch.Tensor | None = None) -> None:
    """out [n, I] = SiLU(gate_up[:, :I]) * gate_up[:, I:]; an e4m3 `out` gets each row
    quantised, its scale in `out_scale` [n]; launch: impl, max_ctas or num_sms."""
    args = impls.read_launch(launch)
    if _elementwise(opts, gate_up, args):
        ctas = impls.elementwise_ctas(args, "silu_mul")
        if out.dtype == torch.float8_e4m3fn:
            from nanosched.kernels.elementwise import rows_fp8

            rows_fp8(gate_up, out, out_scale, silu=True, max_ctas=ctas)
        else:
            from nanosched.kernels.elementwise import silu_mul as kernel

            kernel(gate_up, out, max_ctas=ctas)
    else:
        ref.silu_mul(gate_up, out, out_scale)


def rope_append(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                sin_table: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, q_out: torch.Tensor, opts: KernelOptions,
                launch: Launch = None, *, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> None:
    """Rotary embedding of q and k; q → q_out [n, Hq, d], k and v → the paged cache (quantised
    to e4m3 with per-(token, KV head) scales into `k_scale`, `v_scale` for an FP8 cache);
    launch: impl, max_ctas or num_sms."""
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    args = impls.read_launch(launch)
    if _elementwise(opts, qkv, args):
        from nanosched.kernels.elementwise import rope_append as kernel

        kernel(qkv, positions, cos_table, sin_table, slot_mapping, k_cache, v_cache, q_out,
               max_ctas=impls.elementwise_ctas(args, "rope_append"), **scales)
    else:
        ref.rope_append(qkv, positions, cos_table, sin_table, slot_mapping, k_cache, v_cache,
                        q_out, **scales)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     max_context_len: int, scale: float, out: torch.Tensor,
                     opts: KernelOptions, launch: Launch = None, *,
                     k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None,
                     groups: CascadeGroups | None = None) -> None:
    """Paged GQA decode attention. q, out [n, Hq, d]; launch: impl, max_ctas or num_sms,
    num_splits; k_scale, v_scale [P, S, Hkv] for an FP8 cache. With `opts.decode_impl`
    "cascade" and `groups` (the rows' prefix groups, models/cascade.py), the cascade kernel
    runs whatever the launch names (its grid bound kept; the suffix read by cuda_bulk over an
    FP8 cache where that runs); on torch, the reference over each row's whole context, which
    is what cascade computes."""
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    args = impls.read_launch(launch)
    if groups is not None and opts.decode_impl == impls.CASCADE_DECODE:
        if use_triton(opts, q):
            from nanosched.kernels.cascade_attn import cascade_decode_attention

            bound = impls.grid_bound(args["max_ctas"], args["num_sms"], PIPELINED.ctas_per_sm)
            # the rows' own tokens read as the default would read them: cuda_bulk over an
            # FP8 cache where it runs
            bulk = k_scale is not None and _bulk_runs(q, k_cache, v_cache, k_scale, v_scale)
            cascade_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                     max_context_len, scale, out, groups, max_ctas=bound,
                                     suffix_impl="cuda_bulk" if bulk else "triton", **scales)
        else:
            ref.decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                 max_context_len, scale, out, **scales)
        return
    name = _chosen(args, impls.DECODE,
                   lambda: _default_decode(opts, q, k_cache, v_cache, k_scale, v_scale))
    if name in impls.DECODE_CONFIGS:
        _triton_ok(q)
        from nanosched.kernels.decode_attn import decode_attention as kernel

        config = impls.DECODE_CONFIGS[name]
        kernel(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, out,
               max_ctas=impls.grid_bound(args["max_ctas"], args["num_sms"], config.ctas_per_sm),
               num_splits=args["num_splits"], config=config, **scales)
    elif name == impls.BULK_DECODE:
        from nanosched.kernels.decode_attn_bulk import decode_attention as bulk

        # a CTA bound, or the SMs it fills (the kernel's CTAs per SM on each: launch())
        bulk(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, out,
             max_ctas=args["max_ctas"], num_splits=args["num_splits"], sms=args["num_sms"],
             **scales)
    else:
        ref.decode_attention(q, k_cache, v_cache, block_tables, context_lens, max_context_len,
                             scale, out, **scales)


def _default_decode(opts: KernelOptions, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> str:
    """The decode attention a call runs when its launch names none (`KernelOptions.decode_impl`;
    `auto`, and `cascade` on rows without groups: see impls.AUTO_DECODE)."""
    if not use_triton(opts, q):
        return "torch"
    if opts.decode_impl not in (impls.AUTO_DECODE, impls.CASCADE_DECODE):  # cascade: no groups
        return opts.decode_impl
    if k_scale is not None and _bulk_runs(q, k_cache, v_cache, k_scale, v_scale):
        return impls.BULK_DECODE
    return impls.DEFAULT_DECODE


def _bulk_runs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               k_scale: torch.Tensor, v_scale: torch.Tensor | None) -> bool:
    """Whether `cuda_bulk` can run this call here (GPU, cupy, the cache's layout, and its
    kernel builds: a failed NVRTC build is warned about once and the Triton kernel runs)."""
    if q.device.type != "cuda":
        return False
    from nanosched.kernels import decode_attn_bulk as bulk

    if bulk.missing_dependency() is not None or \
            bulk.unsupported(q, k_cache, v_cache, k_scale, v_scale) is not None:
        return False
    why = bulk.build_error(q, k_cache, k_scale is not None)
    if why is not None:
        _warn_once(f"decode attention 'cuda_bulk' could not be built here ({why}); the FP8 "
                   f"cache is read by {impls.DEFAULT_DECODE} instead (--decode-attention "
                   f"chooses)")
        return False
    return True


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, segments: Sequence[Segment] | PrefillSegments,
                      scale: float, out: torch.Tensor, opts: KernelOptions,
                      launch: Launch = None, *, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Chunked causal prefill attention. q, out [n, Hq, d]; segments: (start, end, first_pos)
    tuples or device `PrefillSegments` (what a CUDA graph captures); launch: impl (`triton` |
    `torch`). `torch` reads the segments' host tuples (the device tensors when it has none).
    k_scale, v_scale [P, S, Hkv] for an FP8 cache."""
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    name = _chosen(impls.read_launch(launch), impls.PREFILL,
                   lambda: "triton" if use_triton(opts, q) else "torch")
    if name == "triton":
        _triton_ok(q)
        from nanosched.kernels.prefill_attn import prefill_attention as kernel

        kernel(q, k_cache, v_cache, block_tables, segments, scale, out, **scales)
    else:
        if isinstance(segments, PrefillSegments):
            segments = segments.as_list()
        ref.prefill_attention(q, k_cache, v_cache, block_tables, list(segments), scale, out,
                              **scales)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor,
                   x_rows: torch.Tensor | None, out: torch.Tensor, opts: KernelOptions,
                   launch: Launch = None) -> None:
    """MoE grouped GEMM: out[i] = x[x_rows[i]] @ w[expert_ids[i]].T. x [m0, K], w [E, N, K],
    expert_ids [m], x_rows [m] or None, out [m, N]; launch: impl (`triton` | `torch`),
    num_sms, max_ctas (impls.grouped_programs)."""
    args = impls.read_launch(launch)
    name = _chosen(args, impls.GROUPED, lambda: "triton" if use_triton(opts, x) else "torch")
    if name == NARROW:
        raise ConfigError(f"{NARROW} is the W8A8 grouped GEMM only; a {x.dtype} grouped GEMM "
                          f"runs triton or torch")
    if name == "triton":
        _triton_ok(x)
        from nanosched.kernels.grouped_gemm import GroupedGemmConfig
        from nanosched.kernels.grouped_gemm import grouped_linear as kernel

        programs = impls.grouped_programs(args, num_sms(x.device))
        kernel(x, w, expert_ids, x_rows, out, GroupedGemmConfig(num_programs=programs))
    else:
        ref.grouped_linear(x, w, expert_ids, x_rows, out)


def grouped_linear_fp8(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                       w_scale: torch.Tensor, expert_ids: torch.Tensor,
                       x_rows: torch.Tensor | None, out: torch.Tensor, opts: KernelOptions,
                       launch: Launch = None) -> None:
    """The W8A8 MoE grouped GEMM: out[i] = (x[x_rows[i]] @ w[e].T) * x_scale[x_rows[i]] *
    w_scale[e], e = expert_ids[i]. x [m0, K] e4m3 with one scale per row, w [E, N, K] e4m3
    with w_scale [E, N], out [m, N] in the model dtype; launch as `grouped_linear`. The Triton
    kernel (e4m3 wgmma on Hopper, sums never promoted, as `torch._scaled_mm`'s fast
    accumulation), the narrow grouped GEMM (`triton_narrow`, each expert's weight slab read
    once by all its rows; only where a launch names it, with its default launch, which was
    not measured; one program per expert and channel block, num_sms and max_ctas unused) or
    the exact emulation of `reference`, which `torch` names."""
    args = impls.read_launch(launch)
    name = _chosen(args, impls.GROUPED, lambda: "triton" if use_triton(opts, x) else "torch")
    if name == NARROW:
        _triton_ok(x)
        from nanosched.kernels.grouped_narrow import grouped_narrow_fp8

        grouped_narrow_fp8(x, x_scale, w, w_scale, expert_ids, x_rows, out)
    elif name == "triton":
        _triton_ok(x)
        from nanosched.kernels.grouped_gemm import FP8_CONFIG
        from nanosched.kernels.grouped_gemm import grouped_linear as kernel

        programs = impls.grouped_programs(args, num_sms(x.device))
        kernel(x, w, expert_ids, x_rows, out, replace(FP8_CONFIG, num_programs=programs),
               x_scale=x_scale, w_scale=w_scale)
    else:
        ref.grouped_linear_fp8(x, x_scale, w, w_scale, expert_ids, x_rows, out)
