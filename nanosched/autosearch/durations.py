"""Nano-op durations and allocation options read from a profile; shared by search and checks.

Time is integer ticks of 1 us inside the solvers (`TICKS_PER_US`). A share is the part of
the GPU, in per-mille, that a nano-op is given (R for a memory or network kernel, 1 - R for the
compute kernel beside it); its duration is t_alone / P with P from the profile's R->P table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanosched.models.ops import COMPUTE, NETWORK
from nanosched.profiler.format import Profile

TICKS_PER_US = 1
FULL_SHARE = 1000


def to_ticks(us: float) -> int:
    return max(1, math.ceil(us * TICKS_PER_US - 1e-9))


def op_context(op: str, decode_context: float, prompt_len: float) -> float | None:
    """The context an attention op's profile rows are keyed by: the decode tokens' mean KV
    context, or the prompt length of prefill chunks (None for non-attention ops)."""
    return {"attn_decode": decode_context, "attn_prefill": prompt_len}.get(op)


def tick_table(profile: Profile, op: str, max_tokens: int, context: float | None,
               quantum: int = 128) -> list[int]:
    """Ticks of `op` alone at 0, 128, ..., max_tokens tokens (index = tokens / 128)."""
    return [0] + [to_ticks(profile.kernel_time_us(op, q * quantum, None, context))
                  for q in range(1, max_tokens // quantum + 1)]


@dataclass(frozen=True)
class AllocOption:
    """One way to run a nano-op: its share of the GPU and the P it then reaches."""

    share: int  # per-mille of the GPU
    p: float  # performance relative to running alone
    mechanism: str  # "full" | "green_ctx" | "cta_bound" | "stream_priority"
    units: int  # SMs (green_ctx, full) or CTAs (cta_bound)
    impl: str = "default"
    table: str = ""  # R->P table the point came from ("" for full)

    def ticks(self, alone_us: float) -> int:
        """Ticks of a nano-op that takes `alone_us` alone, under this option: t / P."""
        return to_ticks(alone_us / self.p)


def alloc_options(profile: Profile, resource: str) -> list[AllocOption]:
    """Full GPU, plus every R->P point of the class's table (both tables for compute)."""
    full = AllocOption(FULL_SHARE, 1.0, "full", profile.identity.num_sms)
    out: dict[int, AllocOption] = {FULL_SHARE: full}
    if resource == COMPUTE:
        for table, points in sorted(profile.rp.items()):
            for pt in points:
                opt = AllocOption(FULL_SHARE - round(pt.r * FULL_SHARE), pt.p_compute,
                                  pt.mechanism, pt.compute_sms, pt.compute_impl, table)
                if opt.share not in out or out[opt.share].p < opt.p:
                    out[opt.share] = opt
    else:
        table = "network" if resource == NETWORK else "memory"
        for pt in profile.rp.get(table, ()):
            opt = AllocOption(round(pt.r * FULL_SHARE), pt.p_other, pt.mechanism, pt.other_sms,
                              "default", table)
            if opt.share not in out or out[opt.share].p < opt.p:
                out[opt.share] = opt
    return [out[s] for s in sorted(out, reverse=True)]
