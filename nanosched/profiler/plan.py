"""What a profile measures: the grid of kernel rows and co-run pairs, as plain tasks.

Pure Python. `ProfileSettings` fixes model, tp, workload, dense batch and `quick`; given the SM
partitions the GPU granted and the implementations available, `kernel_tasks` lists every
(op, tokens, context, sms, mechanism, impl) row and `pair_tasks` every co-run pair. A task's
`key` is the key of the row it produces, so a resumed run measures only the missing keys.

More in docs/profiler.md, module notes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from nanosched.constants import KV_DTYPES, QUANTIZATIONS, TOKEN_QUANTUM
from nanosched.errors import ConfigError
from nanosched.models import ops as optable
from nanosched.models.ops import (
    FP8_GEMM_OPS,
    GEMM,
    GROUPED,
    MEMORY,
    NETWORK,
    OP_FAMILY,
    layer_ops,
)
from nanosched.models.spec import ModelSpec
from nanosched.profiler.shapes import GEMM_OPS
from nanosched.workloads import Workload

PARTITION_SMALL = (16, 32, 48, 64)
PARTITION_SMALL_QUICK = (32,)
MEMORY_CTAS = (8, 16, 32, 48, 64, 96, 128)
MEMORY_CTAS_QUICK = (16, 64)
NCCL_CTAS = (2, 4, 8, 16, 32)
NCCL_CTAS_QUICK = (2, 8)
# the copy-engine all-reduce's reduction bounded to k CTAs beside a GEMM told to leave k SMs:
# on 4xH100 beside the Llama-3-70B tp=4 `ug` GEMM, 8 kept it at full speed for 512 rows and 16
# for 2,048 (bench/results/ce_allreduce-*-4gpu-*.json)
COPY_ENGINE_CTAS = (8, 16)
PAIR_COMPUTE_OPS = GEMM_OPS  # the compute kernels co-run with memory and network kernels
NETWORK_PAIR_LARGE = (1024, 2048)  # GEMM rows also paired with the network ops
# the implementations of the W8A8 GEMM of FP8_GEMM_OPS (kernels/dispatch.linear_fp8:
# torch._scaled_mm, `cublaslt` with its SM target; the persistent Triton GEMM runs W8A8 too
# but has no profiled rows yet; the narrow one runs by default only at 129-192 rows
# (dispatch.NARROW_LAUNCHES), which the grid's multiples of TOKEN_QUANTUM never meet)
FP8_GEMM_IMPLS = ("cublas", "cublaslt")
# and of the MoE experts' grouped one (dispatch.grouped_linear_fp8: the Triton kernel; `torch`
# is the exact emulation, a correctness reference too slow to schedule)
FP8_IMPLS = {GEMM: FP8_GEMM_IMPLS, GROUPED: ("triton",)}


@dataclass(frozen=True)
class ProfileSettings:
    """Everything that decides the grid; two runs with equal settings measure the same rows."""

    model: ModelSpec
    tp: int
    workload: Workload
    dense_batch: int
    quick: bool = False
    pair_settle_ms: float = 300.0  # the clock settles in about 200 ms (hardware/power_settle.py)
    pair_window_ms: float = 1000.0  # about one period of the power controller's ripple
    kv_dtype: str = "auto"  # the KV cache the attention rows read and rope_append writes
    # the layer weights (models/quant.py): fp8 times the W8A8 GEMMs and the kernels that write
    # their e4m3 inputs, as the model built with --quantization fp8 runs them
    quantization: str = "none"

    def __post_init__(self) -> None:
        self.model.check_tp(self.tp)
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-cache-dtype {self.kv_dtype!r} is not one of {KV_DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization {self.quantization!r} is not one of "
                              f"{QUANTIZATIONS}")
        if not (self.pair_settle_ms >= 0 and self.pair_window_ms > 0):
            raise ConfigError(f"pair settle ({self.pair_settle_ms} ms) must be >= 0 and pair "
                              f"window ({self.pair_window_ms} ms) > 0")
        if self.dense_batch < TOKEN_QUANTUM or self.dense_batch % TOKEN_QUANTUM:
            raise ConfigError(f"--dense-batch must be a positive multiple of {TOKEN_QUANTUM}, "
                              f"got {self.dense_batch}")

    def token_grid(self) -> list[int]:
        return list(range(TOKEN_QUANTUM, self.dense_batch + 1, TOKEN_QUANTUM))

    def decode_contexts(self) -> list[int]:
        p, d = self.workload.input_len, self.workload.output_len
        points = (p / 2, p + d) if self.quick else (p / 2, p, p + d / 2, p + d)
        return sorted({max(1, round(c)) for c in points})

    def prefill_contexts(self) -> list[int]:
        p = self.workload.input_len
        points = (p,) if self.quick else (p / 2, p, 2 * p)
        cap = self.model.max_position_embeddings
        return sorted({min(cap, max(1, round(c))) for c in points})

    def partition_requests(self) -> tuple[int, ...]:
        return PARTITION_SMALL_QUICK if self.quick else PARTITION_SMALL

    def memory_ctas(self, num_sms: int) -> list[int]:
        grid = MEMORY_CTAS_QUICK if self.quick else MEMORY_CTAS
        return [c for c in grid if c < num_sms]

    def nccl_ctas(self) -> tuple[int, ...]:
        return NCCL_CTAS_QUICK if self.quick else NCCL_CTAS

    def copy_engine_ctas(self) -> tuple[int, ...]:
        return COPY_ENGINE_CTAS

    def pair_shapes(self) -> list[tuple[str, int]]:
        """(compute op, tokens) of the co-run pairs: every GEMM at a few sizes / two shapes."""
        gemms = [op.name for op in layer_ops(self.model, 1) if op.name in PAIR_COMPUTE_OPS]
        grid = self.token_grid()
        if self.quick:
            return [(gemms[-2], grid[len(grid) // 2]), (gemms[0], grid[len(grid) // 4])]
        sizes = sorted({grid[len(grid) // 4], grid[len(grid) // 2], grid[-1]})
        return [(op, t) for op in gemms for t in sizes]

    def network_pair_shapes(self) -> list[tuple[str, int]]:
        """(compute op, tokens) of the GEMM x all-reduce pairs: the pair shapes, and each of
        their GEMMs at 1,024 and 2,048 rows where the grid reaches (a GEMM long enough to hide
        an all-reduce: there the copy engine's P_sum was 1.84 on 4xH100)."""
        grid, shapes = self.token_grid(), self.pair_shapes()
        ops = list(dict.fromkeys(op for op, _ in shapes))
        more = [(op, t) for op in ops for t in NETWORK_PAIR_LARGE if t in grid]
        return list(dict.fromkeys([*shapes, *more]))

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model.name, "tp": self.tp, "workload": self.workload.to_json(),
                "dense_batch": self.dense_batch, "quick": self.quick,
                "pair_settle_ms": self.pair_settle_ms, "pair_window_ms": self.pair_window_ms,
                "kv_dtype": self.kv_dtype, "quantization": self.quantization}


@dataclass(frozen=True)
class ImplInfo:
    """What the plan needs to know of an implementation (impls.py holds how to launch it)."""

    name: str
    mechanisms: tuple[str, ...]  # of "full", "green_ctx", "cta_bound"
    quick: bool = True  # also measured by --quick
    targets_sms: bool = False  # a GEMM told how many SMs to use (persistent grid, SM target)


@dataclass(frozen=True)
class KernelTask:
    op: str
    tokens: int
    context: int
    sms: int  # SMs (full, green_ctx) or CTAs (cta_bound)
    mechanism: str
    impl: str

    @property
    def key(self) -> tuple[str, int, int, int, str, str]:
        return (self.op, self.tokens, self.context, self.sms, self.mechanism, self.impl)


@dataclass(frozen=True)
class PairTask:
    compute_op: str
    tokens: int
    other_op: str
    other_class: str
    context: int
    mechanism: str
    compute_impl: str
    compute_sms: int
    other_sms: int  # partition SMs (green_ctx), CTAs (cta_bound), all SMs (stream_priority)
    other_impl: str

    @property
    def key(self) -> tuple[Any, ...]:
        return tuple(asdict(self).values())


def sm_grid(num_sms: int, partitions: list[tuple[int, int]]) -> list[int]:
    """All SMs plus both sides of every granted partition, ascending."""
    return sorted({num_sms, *(s for pair in partitions for s in pair)})


def op_contexts(settings: ProfileSettings, op: str) -> list[int]:
    domain = optable.domain_of(op)
    if domain == "decode":
        return settings.decode_contexts()
    if domain == "prefill":
        return settings.prefill_contexts()
    return [0]


def quantized_impls(settings: ProfileSettings, impls: dict[str, list[ImplInfo]]
                    ) -> tuple[dict[str, list[ImplInfo]], list[str]]:
    """`impls` less the GEMM implementations that have no FP8 kernel, under quantization fp8
    (unchanged otherwise), and a note for each left out."""
    if settings.quantization != "fp8":
        return impls, []
    out, notes = {}, []
    for op, infos in impls.items():
        keep = [i for i in infos
                if op not in FP8_GEMM_OPS or i.name in FP8_IMPLS[OP_FAMILY[op]]]
        notes += [f"{op}/{i.name} not measured: no FP8 GEMM of that implementation "
                  f"(--quantization fp8)" for i in infos if i not in keep]
        out[op] = keep
    return out, notes


def kernel_tasks(settings: ProfileSettings, num_sms: int, partitions: list[tuple[int, int]],
                 impls: dict[str, list[ImplInfo]]) -> list[KernelTask]:
    """Every row of the kernel table of a layer on one GPU (network ops excluded)."""
    sms_list = sm_grid(num_sms, partitions)
    tasks = []
    for op in layer_ops(settings.model, settings.tp):
        if op.resource == NETWORK:
            continue
        choices = [i for i in impls.get(op.name, []) if i.quick or not settings.quick]
        if not choices:
            raise ConfigError(f"no implementation registered for op {op.name!r}; see "
                              f"nanosched/profiler/impl_registry.py")
        for context in op_contexts(settings, op.name):  # outer: one KV cache per context
            for tokens in settings.token_grid():
                for impl in choices:
                    tasks += _placements(op.name, tokens, context, impl, num_sms, sms_list,
                                         settings.memory_ctas(num_sms))
    return tasks


def _placements(op: str, tokens: int, context: int, impl: ImplInfo, num_sms: int,
                sms_list: list[int], ctas: list[int]) -> list[KernelTask]:
    out = []
    if "full" in impl.mechanisms:
        out.append(KernelTask(op, tokens, context, num_sms, "full", impl.name))
    if "green_ctx" in impl.mechanisms:
        out += [KernelTask(op, tokens, context, s, "green_ctx", impl.name)
                for s in sms_list if s < num_sms]
    if "cta_bound" in impl.mechanisms:
        out += [KernelTask(op, tokens, context, c, "cta_bound", impl.name) for c in ctas]
    return out


def _pair_impls(settings: ProfileSettings, impls: dict[str, list[ImplInfo]],
                op: str) -> list[ImplInfo]:
    return [i for i in impls.get(op, []) if i.quick or not settings.quick]


def _sharing(task: PairTask, impl: ImplInfo, num_sms: int, ctas: int) -> PairTask:
    """The pair with the GEMM told to leave `ctas` SMs free when it can be told."""
    c_sms = num_sms - ctas if impl.targets_sms else num_sms
    return replace(task, mechanism="cta_bound", compute_impl=impl.name, compute_sms=c_sms,
                   other_sms=ctas)


# best(op, tokens, sms, mechanism, among=None): the implementation fastest alone there, of
# `among` when given; None when no such row was measured
BestImpl = Callable[..., str | None]


def memory_pair_tasks(settings: ProfileSettings, num_sms: int,
                      partitions: list[tuple[int, int]], impls: dict[str, list[ImplInfo]],
                      memory_impl: str, best: BestImpl,
                      best_memory: BestImpl | None = None) -> list[PairTask]:
    """GEMM x decode attention pairs for every pair shape and every way of sharing the GPU:
    plain prioritised streams, disjoint partitions, and a CTA-bounded attention kernel. `best`
    names the GEMM implementation fastest alone at a placement (None: not measured there);
    `best_memory(tokens, context, sms, mechanism)` the attention implementation fastest alone
    on a partition or CTA bound (None: `memory_impl`, which also runs beside the full GPU)."""
    contexts = settings.decode_contexts()
    context = contexts[len(contexts) // 2]

    def attn(tokens: int, sms: int, mechanism: str) -> str:
        return (best_memory and best_memory(tokens, context, sms, mechanism)) or memory_impl

    tasks = []
    for op, tokens in settings.pair_shapes():
        gemms = {i.name: i for i in _pair_impls(settings, impls, op)}
        full = best(op, tokens, num_sms, "full")
        if full is None:
            continue
        base = PairTask(op, tokens, optable.ATTN_DECODE, MEMORY, context, "stream_priority", full,
                        num_sms, num_sms, memory_impl)
        tasks.append(base)
        for small, rest in partitions:
            impl = best(op, tokens, rest, "green_ctx")
            if impl is not None:
                tasks.append(replace(base, mechanism="green_ctx", compute_impl=impl,
                                     compute_sms=rest, other_sms=small,
                                     other_impl=attn(tokens, small, "green_ctx")))
        told = [n for n, i in gemms.items() if i.targets_sms]
        sharer = gemms.get(best(op, tokens, num_sms, "full", told) or full, gemms[full])
        for small, _ in partitions:
            tasks.append(replace(_sharing(base, sharer, num_sms, small),
                                 other_impl=attn(tokens, small, "cta_bound")))
    return tasks


def network_pair_tasks(settings: ProfileSettings, num_sms: int,
                       impls: dict[str, list[ImplInfo]], copy_engine_ctas: tuple[int, ...] = (),
                       best: BestImpl | None = None) -> list[PairTask]:
    """GEMM x all-reduce pairs at every `network_pair_shapes` shape: NCCL as is beside the GEMM
    fastest alone on all SMs, NCCL bounded to few CTAs and the copy-engine all-reduce with its
    reduction bounded to each of `copy_engine_ctas`, each beside the GEMM fastest alone of
    those that can be told to leave those SMs (beside one that cannot, the reduction waits for
    the GEMM's last wave: 0.3-0.4 of its speed), as the memory pairs choose theirs. `best`
    names the fastest implementation (the kernel rows; None: the registry's first)."""
    if settings.tp == 1:
        return []
    tasks = []
    for op, tokens in settings.network_pair_shapes():
        gemms = {i.name: i for i in _pair_impls(settings, impls, op)}
        told = [n for n, i in gemms.items() if i.targets_sms]
        full = (best and best(op, tokens, num_sms, "full")) or next(iter(gemms))
        told_best = best and told and best(op, tokens, num_sms, "full", told)
        sharer = gemms[told_best or (told[0] if told else full)]
        base = PairTask(op, tokens, optable.AR_FFN, NETWORK, 0, "stream_priority", full,
                        num_sms, num_sms, "nccl")
        tasks.append(base)
        tasks += [replace(_sharing(base, sharer, num_sms, ctas), other_impl=f"nccl_ctas{ctas}")
                  for ctas in settings.nccl_ctas()]
        if sharer.targets_sms:
            tasks += [replace(_sharing(base, sharer, num_sms, ctas),
                              other_impl=f"copy_engine_ctas{ctas}") for ctas in copy_engine_ctas]
    return tasks


@dataclass(frozen=True)
class LayerTask:
    """One Sequential layer of `tokens` rows at the workload's steady mix: `num_decode` decode
    rows at a measured decode context, the rest prompt chunks; `ops` are its kernel rows in
    program order (all SMs, network ops left out: one GPU), each the fastest implementation."""

    tokens: int
    num_decode: int
    ops: tuple[KernelTask, ...]

    @property
    def key(self) -> tuple[Any, ...]:
        return ("layer", self.tokens, self.num_decode)


def layer_sizes(settings: ProfileSettings) -> list[tuple[int, bool]]:
    """The layers of the forward table, (rows, decode only): the two regimes a serving engine
    runs, a decode-only batch (the tail, as requests finish) at a quarter of the dense batch,
    and the workload's steady mix at half the dense batch and at the dense batch."""
    grid = settings.token_grid()
    return [(grid[(len(grid) - 1) // 4], True), *((t, False) for t in sorted(
        {grid[(len(grid) - 1) // 2], grid[-1]}))]


# best(op, tokens, context): the implementation fastest alone on all SMs there, or None
BestFull = Callable[[str, int, int], "str | None"]


def layer_tasks(settings: ProfileSettings, num_sms: int, decode_contexts: list[int],
                best: BestFull) -> list[LayerTask]:
    """The layers of the forward table (`layer_sizes`). Decode rows: every row of a decode-only
    layer, else the workload's share of the batch on the 128-token grid (as the search lays out
    its batch), at the measured decode context nearest the workload's mean
    (`decode_contexts`); prompt rows at the prompt length. A layer with an op that has no row is
    left out."""
    wl = settings.workload
    mean_context = wl.input_len + wl.output_len / 2
    context = min(decode_contexts, key=lambda c: (abs(c - mean_context), c))
    prompt = min(settings.prefill_contexts(), key=lambda c: (abs(c - wl.input_len), c))
    tasks = []
    for t, decode_only in layer_sizes(settings):
        d = t if decode_only else min(
            t, round(t * wl.decode_fraction / TOKEN_QUANTUM) * TOKEN_QUANTUM)
        ops = []
        for op in layer_ops(settings.model, settings.tp):
            if op.resource == NETWORK:
                continue
            domain = optable.BY_NAME[op.name].domain
            rows, ctx = {"decode": (d, context), "prefill": (t - d, prompt)}.get(domain, (t, 0))
            if rows == 0:
                continue
            impl = best(op.name, rows, ctx)
            if impl is None:
                break
            ops.append(KernelTask(op.name, rows, ctx, num_sms, "full", impl))
        else:
            tasks.append(LayerTask(t, d, tuple(ops)))
    return tasks
