"""`nanosched profile show`: a profile's tables as text (pandas) and its curves as a PNG.

Tables: identity and ceilings; the best time per op and token count on all SMs; how the GEMMs'
best time scales with SMs at the middle token count; the mean SM clock and board power of the
kernel rows per op; the co-run pairs with their clock and power; the R->P tables, each point
with the clock its pairs ran at and whether that was throttled (under 97% of the GPU's maximum);
whether the pairs were timed sustained; the notes. The plot (lazy
matplotlib import, Agg backend) has the R->P curves per class and kernel time vs SMs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from nanosched.profiler.format import Profile
from nanosched.profiler.shapes import GEMM_OPS


def _frames(prof: Profile) -> dict[str, object]:
    import pandas as pd

    kernels = pd.DataFrame([k.__dict__ for k in prof.kernels])
    full = kernels[kernels.sms == prof.identity.num_sms]
    best = full.groupby(["op", "tokens"]).time_us.min().unstack("tokens")
    tokens = sorted(kernels.tokens.unique())
    mid = tokens[len(tokens) // 2]
    gemm = kernels[kernels.op.isin(GEMM_OPS) & (kernels.tokens == mid)]
    by_sms = gemm.groupby(["op", "sms"]).time_us.min().unstack("sms")
    rp = pd.DataFrame([{"class": c, **p.__dict__, "throttled": prof.throttled(p.clock_mhz)}
                       for c, pts in prof.rp.items() for p in pts])
    clocks = (kernels.dropna(subset=["clock_mhz"]).groupby("op")[["clock_mhz", "power_w"]]
              .agg(["min", "mean", "max"]) if kernels.clock_mhz.notna().any() else None)
    pairs = pd.DataFrame([{**p.__dict__, "p_compute": p.p_compute, "p_other": p.p_other,
                           "p_sum": p.p_compute + p.p_other} for p in prof.pairs])
    return {"best": best, "by_sms": by_sms, "mid": mid, "rp": rp, "clocks": clocks,
            "pairs": pairs}


def show_profile(prof: Profile, echo: Callable[[str], None] = print) -> None:
    import pandas as pd

    i, c = prof.identity, prof.ceilings
    echo(f"{prof.model.name} tp {prof.tp} on {i.gpu_name} ({i.num_sms} SMs), {i.date}; "
         f"torch {i.torch}, CUDA {i.cuda}, triton {i.triton}, driver {i.driver}")
    net = (f", all-reduce {c.allreduce_busbw_gbs:.0f} GB/s bus + {c.allreduce_latency_us:.1f} us"
           f"{' (modelled)' if c.allreduce_modelled else ''}"
           if c.allreduce_busbw_gbs is not None and c.allreduce_latency_us is not None else "")
    echo(f"ceilings: GEMM {c.gemm_tflops_8192:.0f} TFLOP/s at 8192^3, "
         f"{c.gemm_tflops_model:.0f} at the model's shapes; copy {c.copy_gbs:.0f} GB/s{net}")
    f = _frames(prof)
    with pd.option_context("display.width", 200, "display.max_columns", 40,
                           "display.float_format", "{:.1f}".format):
        echo(f"\nbest time (us) on all SMs, per op x tokens:\n{f['best']}")
        echo(f"\nGEMM best time (us) per SMs at {f['mid']} tokens:\n{f['by_sms']}")
        if f["clocks"] is not None:
            echo(f"\nkernel rows: SM clock (MHz) and board power (W) while timed, per op "
                 f"(max clock {i.max_clock_mhz:.0f} MHz, power limit {i.power_limit_w:.0f} W):"
                 f"\n{f['clocks']}")
        pairs = f["pairs"]
        if len(pairs):  # type: ignore[arg-type]
            cols = ["other_class", "compute_op", "tokens", "mechanism", "compute_impl",
                    "compute_sms", "other_sms", "p_compute", "p_other", "p_sum", "clock_mhz",
                    "power_w", "settle_ms", "window_ms"]
            table = pairs[cols].to_string(index=False, float_format="{:.2f}".format)  # type: ignore
            echo(f"\nco-run pairs (P against each kernel alone on all SMs):\n{table}")
        rp = f["rp"]
        if len(rp):  # type: ignore[arg-type]
            cols = ["class", "r", "p_other", "p_compute", "mechanism", "compute_impl",
                    "compute_sms", "other_sms", "std_rel", "clock_mhz", "throttled"]
            table = rp[cols].to_string(index=False, float_format="{:.3f}".format)  # type: ignore
            echo(f"\nR->P tables:\n{table}")
    why = prof.unsettled()
    echo(f"\npairs: {why}" if why else "\npairs: timed sustained (clock settled under the "
         "power cap)" if prof.pairs else "\npairs: none")
    for note in prof.notes:
        echo(f"note: {note}")


def plot_profile(prof: Profile, out: str | os.PathLike[str]) -> Path:
    """Write R->P curves and GEMM time vs SMs to a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = _frames(prof)
    fig, (ax_rp, ax_sm) = plt.subplots(1, 2, figsize=(12, 4.5))
    for cls, pts in sorted(prof.rp.items()):
        pts = sorted(pts, key=lambda p: p.r)
        ax_rp.plot([p.r for p in pts], [p.p_other for p in pts], "o-", label=f"P {cls}")
        ax_rp.plot([p.r for p in pts], [p.p_compute for p in pts], "s--",
                   label=f"P compute beside {cls}")
    ax_rp.set(xlabel="R (share given to the non-compute kernel)", ylabel="P (vs alone)",
              title="R->P", xlim=(0, 1), ylim=(0, 1.1))
    ax_rp.legend(fontsize=8)
    by_sms = f["by_sms"]
    for op, row in by_sms.iterrows():  # type: ignore[attr-defined]
        ax_sm.plot(row.index, row.values, "o-", label=op)
    ax_sm.set(xlabel="SMs", ylabel="best time (us)", title=f"GEMMs at {f['mid']} tokens")
    ax_sm.legend(fontsize=8)
    fig.suptitle(f"{prof.model.name} tp {prof.tp} on {prof.identity.gpu_name}")
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
