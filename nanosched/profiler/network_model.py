"""NCCL cost formulas: fit bus bandwidth and latency, model collectives on N GPUs. Pure.

For a collective over N GPUs moving a tensor of S bytes (the full [T, D] tensor) with bus
bandwidth B (NCCL's busbw, roughly independent of N on one NVLink host), a fixed latency a0
(launch and synchronisation, paid once) and a latency h per ring step (one NVLink hop), as in
NCCL's own tuning model (latency = base + steps x per-hop):

    all-reduce (ring):       t = 2 (N-1)/N * S / B + a0 + 2 (N-1) h
    reduce-scatter (ring):   t =   (N-1)/N * S / B + a0 +   (N-1) h
    all-gather (ring):       t =   (N-1)/N * S / B + a0 +   (N-1) h

More in docs/profiler.md, module notes.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanosched.errors import ProfileError
from nanosched.models import ops as optable

# NCCL's collectives, priced by the ring formula
COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather")
CE_ALL_REDUCE = "ce_all_reduce"  # the copy-engine all-reduce (kernels/ce_allreduce.py): no ring
_FORMS = [optable.COLLECTIVE_FORMS[ar] for ar in optable.COLLECTIVES]
OPS_OF_KIND = {"all_reduce": optable.COLLECTIVES,
               "reduce_scatter": tuple(rs.name for rs, _ in _FORMS),
               "all_gather": tuple(ag.name for _, ag in _FORMS), CE_ALL_REDUCE: optable.COLLECTIVES}
IMPL_OF_KIND = {"all_reduce": "nccl", "reduce_scatter": "nccl", "all_gather": "nccl",
                CE_ALL_REDUCE: "copy_engine"}
NVLINK_HOP_US = 1.9  # NCCL tuning.cc, hwLat[NVLINK][RING][LL128]
# Two H200s, NCCL 2.28 (docs/measurements.md): 33 us for a 4 MiB all-reduce at 228 GB/s busbw leaves
# about 15 us of latency: two ring steps and the fixed rest. Used only when no second GPU could
# be measured.
PRIOR_LATENCY_US = 15.0 - 2 * NVLINK_HOP_US


def _factors(kind: str, world: int) -> tuple[float, float]:
    """(bytes factor, latency steps) of `kind` on `world` GPUs."""
    if kind not in COLLECTIVE_KINDS:
        raise ProfileError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVE_KINDS)}")
    if world < 2:
        raise ProfileError(f"a collective needs at least 2 GPUs, got {world}")
    if kind == "all_reduce":
        return 2 * (world - 1) / world, 2 * (world - 1)
    return (world - 1) / world, world - 1


def ring_time_us(kind: str, size_bytes: float, world: int, busbw_gbs: float,
                 latency_us: float, hop_us: float = NVLINK_HOP_US) -> float:
    """Time of one collective by the ring formula (`latency_us`: the fixed a0)."""
    volume, steps = _factors(kind, world)
    return volume * size_bytes / (busbw_gbs * 1e3) + latency_us + steps * hop_us


def fit_ring(kind: str, world: int, sizes_bytes: Sequence[float],
             times_us: Sequence[float], max_busbw_gbs: float | None = None,
             hop_us: float = NVLINK_HOP_US) -> tuple[float, float]:
    """(busbw GB/s, fixed latency a0 us) fitting measured times of `kind` on `world` GPUs.

    Over sizes where latency dominates, the slope is nearly flat and the fitted bandwidth can
    exceed what the link carries (two H200s timed by Python's launch rate: 1,601 GB/s from
58-71 us at 2-15 MB); with
    `max_busbw_gbs` the bandwidth is capped there and the latency refitted under the cap.
    """
    if len(sizes_bytes) != len(times_us) or len(sizes_bytes) < 2:
        raise ProfileError(f"fitting {kind} needs at least two sizes, got {len(sizes_bytes)}")
    volume, steps = _factors(kind, world)
    xs = [volume * s for s in sizes_bytes]
    n = len(xs)
    mx, my = sum(xs) / n, sum(times_us) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ProfileError(f"fitting {kind} needs different sizes")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, times_us, strict=True)) / sxx
    if slope <= 0 and max_busbw_gbs is not None:
        slope = 1e-3 / max_busbw_gbs  # flat within noise: latency-bound, the link's bandwidth
    if slope <= 0:
        raise ProfileError(f"{kind} times do not grow with size ({list(times_us)} us): "
                           f"the measurement is noise; re-run the profile on an idle machine")
    if max_busbw_gbs is not None and 1e-3 / slope > max_busbw_gbs:
        slope = 1e-3 / max_busbw_gbs
    intercept = max(my - slope * mx, 0.0)
    return 1e-3 / slope, max(intercept - steps * hop_us, 0.0)


def busbw_gbs(kind: str, size_bytes: float, world: int, time_us: float) -> float:
    """NCCL's bus bandwidth of one measurement (what nccl-tests prints as busbw)."""
    volume, _ = _factors(kind, world)
    return volume * size_bytes / (time_us * 1e3)
