"""Turn a run's measurements (`RunState`) into a `Profile`: best rows, network rows, R->P tables.

The all-reduce ceilings are the bus bandwidth and latency of the ring formula fitted to NCCL's
default all-reduce over all token counts (bandwidth term: the large-message limit).
Network rows: measured on `world` GPUs when `world == tp`; when fewer GPUs were visible, fitted
with NCCL's ring formulas (network_model.py) on the measured GPUs and evaluated at tp, marked
`modelled`; with one GPU visible, modelled from the GPU's prior link bandwidth (hardware.py)
and a latency taken from a two-H200 measurement (docs/measurements.md). Every modelled row is noted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nanosched.constants import DEFAULT_GPU
from nanosched.errors import ProfileError
from nanosched.hardware import GPUS, prior_for
from nanosched.models.ops import NETWORK
from nanosched.profiler.backend import NetworkRequest, NetworkResult, ProfilerBackend
from nanosched.profiler.format import Ceilings, KernelRow, PairRow, Profile
from nanosched.profiler.interference import FIT_LIMIT, AloneTime, derive_rp
from nanosched.profiler.network_model import (
    CE_ALL_REDUCE,
    COLLECTIVE_KINDS,
    IMPL_OF_KIND,
    OPS_OF_KIND,
    PRIOR_LATENCY_US,
    fit_ring,
    ring_time_us,
)
from nanosched.profiler.plan import ImplInfo, ProfileSettings, network_pair_tasks
from nanosched.profiler.state import RunState


def network_request(settings: ProfileSettings, backend: ProfilerBackend, num_sms: int,
                    impls: dict[str, list[ImplInfo]], state: RunState,
                    best: Callable[..., str | None] | None = None) -> NetworkRequest | None:
    """What to measure on several GPUs, or None (tp 1, or a single GPU visible); `best` picks
    the pairs' GEMMs (`plan.network_pair_tasks`)."""
    if settings.tp == 1:
        return None
    world = min(settings.tp, backend.visible_gpus())
    if world < 2:
        state.note(f"only one GPU visible: network rows for tp {settings.tp} are modelled from "
                   f"the GPU's prior link bandwidth, not measured; profile on {settings.tp} "
                   f"GPUs to measure them")
        return None
    ce_ctas = settings.copy_engine_ctas() if world == settings.tp else ()
    missing = backend.copy_engine_missing() if ce_ctas else None
    if missing:
        state.note(f"copy-engine all-reduce not measured: {missing}")
        ce_ctas = ()
    elif world < settings.tp:
        state.note(f"copy-engine all-reduce not measured: it runs on all {settings.tp} GPUs, "
                   f"{world} are visible")
    return NetworkRequest(world, tuple(settings.token_grid()), (0, *settings.nccl_ctas()),
                          tuple(network_pair_tasks(settings, num_sms, impls, ce_ctas, best)),
                          (0, *ce_ctas) if ce_ctas else ())


def record_network(state: RunState, result: NetworkResult) -> None:
    """A network measurement into the run: its collective rows (the first time), its pairs."""
    if state.network is None:
        state.network = {"world": result.world, "times": [
            [k, t, c, us] for (k, t, c), us in sorted(result.times_us.items())]}
    for pair in result.pairs:
        task, timing = pair.task, pair.timing
        state.pairs[task.key] = PairRow(
            compute_op=task.compute_op, other_op=task.other_op, other_class=NETWORK,
            tokens=task.tokens, mechanism=task.mechanism, compute_impl=task.compute_impl,
            compute_sms=task.compute_sms, other_sms=task.other_sms,
            compute_alone_us=pair.compute_alone_us, other_alone_us=pair.other_alone_us,
            compute_us=timing.compute_us, other_us=timing.other_us, context=task.context,
            settle_ms=pair.settle_ms, window_ms=pair.window_ms, clock_mhz=timing.clock_mhz,
            power_w=timing.power_w, compute_alone_clock_mhz=pair.compute_alone_clock_mhz,
            other_impl=task.other_impl)


def _net_row(op: str, tokens: int, us: float, ctas: int, num_sms: int,
             modelled: bool, impl: str = "nccl") -> KernelRow:
    if ctas == 0:
        return KernelRow(op, tokens, us, num_sms, "full", impl, modelled=modelled)
    return KernelRow(op, tokens, us, ctas, "cta_bound", f"{impl}_ctas{ctas}", modelled=modelled)


def network_rows(settings: ProfileSettings, state: RunState, num_sms: int
                 ) -> tuple[list[KernelRow], dict[str, Any]]:
    """Rows of every network op and the all-reduce ceilings (busbw, latency, modelled)."""
    if settings.tp == 1:
        return [], {}
    size = settings.model.hidden_size * settings.model.dtype_bytes  # bytes per token of [T, D]
    tp = settings.tp
    series: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
    if state.network is None:
        bw, lat = _prior_busbw(state.identity.gpu_name), PRIOR_LATENCY_US
        for t in settings.token_grid():
            for kind in COLLECTIVE_KINDS:
                series[(kind, 0)].append((t, ring_time_us(kind, t * size, tp, bw, lat)))
        world, modelled = tp, True
        ceil = {"allreduce_busbw_gbs": bw, "allreduce_latency_us": lat}
    else:
        world = state.network["world"]
        for kind, t, c, us in state.network["times"]:
            series[(kind, c)].append((t, us))
        modelled = world < tp
        cap = _prior_busbw(state.identity.gpu_name)  # the link's one-way bandwidth
        bw, lat = fit_ring("all_reduce", world, *_xy(series[("all_reduce", 0)], size), cap)
        ceil = {"allreduce_busbw_gbs": bw, "allreduce_latency_us": lat}
    rows = []
    for (kind, ctas), points in sorted(series.items()):
        if kind == CE_ALL_REDUCE:  # measured on all tp GPUs only (network_request)
            rows += [_net_row(op, t, us, ctas, num_sms, False, IMPL_OF_KIND[kind])
                     for op in OPS_OF_KIND[kind] for t, us in points]
            continue
        if modelled and state.network is not None:
            bw_k, lat_k = fit_ring(kind, world, *_xy(points, size), cap)
            points = [(t, ring_time_us(kind, t * size, tp, bw_k, lat_k)) for t, _ in points]
        for op in OPS_OF_KIND[kind]:
            rows += [_net_row(op, t, us, ctas, num_sms, modelled) for t, us in points]
    if modelled and state.network is not None:
        state.note(f"network rows for tp {tp} are modelled with NCCL's ring formulas from "
                   f"measurements on {world} GPUs")
    return rows, {**ceil, "allreduce_modelled": modelled}


def _xy(points: list[tuple[int, float]], size: int) -> tuple[list[float], list[float]]:
    return [t * size for t, _ in points], [us for _, us in points]


def _prior_busbw(gpu_name: str) -> float:
    """One-way link bandwidth of the GPU's prior (the default GPU's when the GPU is unknown)."""
    return (prior_for(gpu_name) or GPUS[DEFAULT_GPU]).net_bw_one_way_gbs


def mark_best(rows: list[KernelRow]) -> list[KernelRow]:
    """Set `best` on the fastest row of every (op, tokens, context, sms)."""
    fastest: dict[tuple[str, int, int, int], float] = {}
    for r in rows:
        key = (r.op, r.tokens, r.context, r.sms)
        fastest[key] = min(fastest.get(key, r.time_us), r.time_us)
    marked, seen = [], set()
    for r in rows:
        key = (r.op, r.tokens, r.context, r.sms)
        is_best = r.time_us == fastest[key] and key not in seen
        seen.update([key] if is_best else [])
        marked.append(replace(r, best=is_best))
    return marked


P_VALID = 1.05  # a kernel never runs faster beside another than alone, beyond timing noise


def invalid_pairs(pairs: list[PairRow]) -> list[PairRow]:
    """The pairs whose P are not physical. A kernel that ran faster beside another kernel than
    alone (P > P_VALID, against the pair's own alone time) had its alone time bounded by the
    CPU's launch rate, not by the GPU: such a pair stays in the profile's raw pairs but is left
    out of the R->P table, with a note."""
    return [p for p in pairs if p.p_compute > P_VALID or p.p_other > P_VALID]


def row_alone(profile: Profile) -> AloneTime:
    """The profile's kernel rows as `derive_rp`'s alone times (None where it has no row)."""
    def alone(op: str, tokens: int, context: int) -> float | None:
        try:
            return profile.kernel_time_us(op, tokens, None, context or None)
        except ProfileError:
            return None
    return alone


RP_NOTE = "R->P "  # notes of the R->P derivation start with this


def with_rp(profile: Profile, note: Callable[[str], None]) -> Profile:
    """`profile` with its R->P tables derived from its pairs (the valid ones), P against its
    kernel rows (interference.py). `note` receives what the derivation says."""
    alone = row_alone(profile)
    rp, rp_shapes = {}, {}
    for cls in ("memory", "network"):
        pairs = [p for p in profile.pairs if p.other_class == cls]
        bad = invalid_pairs(pairs)
        if bad:
            what = sorted({f"{p.compute_op}@{p.tokens}" for p in bad})
            note(f"{RP_NOTE}{cls}: {len(bad)} pair(s) left out: a kernel ran faster beside "
                 f"another than alone (P > {P_VALID}), so its alone time was bounded by the "
                 f"CPU's launch rate ({', '.join(what)})")
        pairs = [p for p in pairs if p not in bad]
        if not pairs:
            continue
        table = derive_rp(pairs, profile.identity.num_sms, alone)
        rp[cls] = table.points
        note(f"{RP_NOTE}{cls}: {len(table.points)} Pareto points from {len(pairs)} pairs over "
             f"{table.num_shapes} shapes, P against the kernel rows; largest spread of P across "
             f"shapes {100 * table.fit:.1f}% (NanoFlow: within {100 * FIT_LIMIT:.0f}%)")
        if not table.fits:
            rp_shapes[cls] = table.per_shape
            note(f"{RP_NOTE}{cls}: one table does not fit every shape; per-shape tables kept")
    return replace(profile, rp=rp, rp_shapes=rp_shapes)


def rederive_rp(profile: Profile) -> Profile:
    """`profile` with its R->P tables derived again from its pairs and kernel rows, and its
    R->P notes replaced where the first of them stood (else added at the end): for a profile
    taken before the rule changed (no GPU needed)."""
    notes: list[str] = []
    fresh = with_rp(replace(profile, notes=()), notes.append)
    at = next((i for i, n in enumerate(profile.notes) if n.startswith(RP_NOTE)),
              len(profile.notes))
    before = tuple(n for n in profile.notes[:at] if not n.startswith(RP_NOTE))
    after = tuple(n for n in profile.notes[at:] if not n.startswith(RP_NOTE))
    return replace(fresh, notes=before + tuple(notes) + after)


def build_profile(settings: ProfileSettings, state: RunState) -> Profile:
    num_sms = state.identity.num_sms
    net_rows, net_ceil = network_rows(settings, state, num_sms)
    kernels = mark_best(list(state.kernels.values()) + net_rows)
    if state.ceilings is None:
        raise ProfileError("no ceilings were measured; run the profile again")
    ceilings = Ceilings(**{**state.ceilings.__dict__, **net_ceil})
    bare = Profile(identity=state.identity, model=settings.model, tp=settings.tp,
                   dense_batch=settings.dense_batch, ceilings=ceilings, kernels=tuple(kernels),
                   pairs=tuple(state.pairs.values()), rp={}, notes=(),
                   kv_dtype=settings.kv_dtype, quantization=settings.quantization,
                   forward=tuple(r for rows in state.forward.values() for r in rows))
    prof = with_rp(bare, state.note)
    if state.skipped:
        reasons = sorted(set(state.skipped.values()))
        state.note(f"{len(state.skipped)} rows not measured: {'; '.join(reasons[:5])}")
    return replace(prof, notes=tuple(state.notes))
