"""`nanosched profile show`: a profile's tables as text (pandas) and its curves as a PNG.

Tables: identity and ceilings; the best time per op and token count on all SMs; how the GEMMs'
best time scales with SMs at the middle token count; the mean SM clock and board power of the
kernel rows per op; the co-run pairs with their clock and power; the R->P tables, each point
with the clock its pairs ran at and whether that was throttled (under 97% of the GPU's maximum);
the forward table (each op's settled factor per layer size, the layer's clock and power);
whether the pairs were timed sustained; the notes. The plot (lazy matplotlib import, Agg
backend) shows, per class, every co-run pair as a point coloured by its SM-allocation mechanism
(R against P, and P_other against P_compute with the P_compute + P_other = 1 line that overlap
must beat), and GEMM time against SMs.
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
    kv = "FP8 KV cache (e4m3 + scales)" if prof.kv_dtype == "fp8" else "KV cache in the model dtype"
    weights = ("FP8 weights (W8A8: e4m3 weights and inputs with row scales)"
               if prof.quantization == "fp8" else "weights in the model dtype")
    when = i.date or "no date (not measured)"
    echo(f"{prof.model.name} tp {prof.tp} on {i.gpu_name} ({i.num_sms} SMs), {kv}, {weights}, "
         f"{when}; "
         f"torch {i.torch}, CUDA {i.cuda}, triton {i.triton}, driver {i.driver}")
    net = (f", all-reduce {c.allreduce_busbw_gbs:.0f} GB/s bus + {c.allreduce_latency_us:.1f} us"
           f"{' (modelled)' if c.allreduce_modelled else ''}"
           if c.allreduce_busbw_gbs is not None and c.allreduce_latency_us is not None else "")
    precision = "FP8 " if prof.quantization == "fp8" else ""
    echo(f"ceilings: {precision}GEMM {c.gemm_tflops_8192:.0f} TFLOP/s at 8192^3, "
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
            echo(f"\nco-run pairs (P against each kernel's own sustained time alone on all "
                 f"SMs: the interference):\n{table}")
        rp = f["rp"]
        if len(rp):  # type: ignore[arg-type]
            cols = ["class", "r", "p_other", "p_compute", "mechanism", "compute_impl",
                    "compute_sms", "other_sms", "std_rel", "clock_mhz", "throttled"]
            table = rp[cols].to_string(index=False, float_format="{:.3f}".format)  # type: ignore
            echo(f"\nR->P tables (P against the kernel rows above, which the search divides "
                 f"by P: row / P is the time in the pair):\n{table}")
    for line in forward_lines(prof):
        echo(line)
    why = prof.unsettled()
    echo(f"\npairs: {why}" if why else "\npairs: timed sustained (clock settled under the "
         "power cap)" if prof.pairs else "\npairs: none")
    for note in prof.notes:
        echo(f"note: {note}")


def forward_lines(prof: Profile) -> list[str]:
    """The forward table: per layer size, each op's F = time inside the looped layer / its row
    (the mean of the layers of one size, as the search reads it); per layer, the whole layer's
    F and the clock and power it settled at."""
    import pandas as pd

    if not prof.forward:
        return ["\nforward: none (`nanosched profile forward FILE` measures it; the search "
                "prices ops alone on the whole GPU at their rows)"]
    rows = pd.DataFrame([{**r.__dict__, "F": r.factor} for r in prof.forward])
    table = rows.pivot_table(index="op", columns="batch_tokens", values="F", sort=False)
    out = ["\nforward: a Sequential layer looped until the clock settled; F = each op's time "
           "in it / its row (the search prices an op alone on the whole GPU at F x row):",
           table.to_string(float_format="{:.3f}".format, na_rep="-")]
    for (t, d), layer in rows.groupby(["batch_tokens", "num_decode"], sort=False):
        first = layer.iloc[0]
        clock = "" if pd.isna(first.clock_mhz) else f", {first.clock_mhz:.0f} MHz"
        power = "" if pd.isna(first.power_w) else f", {first.power_w:.0f} W"
        out.append(f"  layer of {t} rows ({d} decode): {layer.time_us.sum():.1f} "
                   f"us against {layer.row_us.sum():.1f} us of rows, F "
                   f"{layer.time_us.sum() / layer.row_us.sum():.3f}{clock}{power}")
    return out


MECH_STYLE = {"green_ctx": ("#1f77b4", "o"), "cta_bound": ("#d62728", "^"),
              "stream_priority": ("#2ca02c", "s")}
DIAGONAL_LABEL = "P_compute + P_other = 1"


def _style(mechanism: str, index: int) -> tuple[str, str]:
    return MECH_STYLE.get(mechanism, (f"C{3 + index}", "D"))


def _rp_data(prof: Profile, cls: str) -> dict[str, list[tuple[float, float, float]]]:
    """(R, P_other, P_compute) per mechanism: every measured pair of the class, else the table."""
    from nanosched.profiler.interference import r_of

    n = prof.identity.num_sms
    by_mech: dict[str, list[tuple[float, float, float]]] = {}
    pairs = [p for p in prof.pairs if p.other_class == cls]
    if pairs:
        for p in pairs:
            by_mech.setdefault(p.mechanism, []).append((r_of(p, n), p.p_other, p.p_compute))
    else:
        for q in prof.rp.get(cls, ()):
            by_mech.setdefault(q.mechanism, []).append((q.r, q.p_other, q.p_compute))
    return by_mech


def plot_rp(prof: Profile, ax_r: object, ax_p: object, cls: str) -> None:
    """Draw class `cls` on two axes, one colour and marker per mechanism, points not lines.

    `ax_r`: R (share given to the non-compute kernel) against P, P_other filled and P_compute
    hollow. `ax_p`: P_other against P_compute with the line P_compute + P_other = 1: a point
    above it means the pair together beat running the two kernels one after the other. The
    R->P table's points (the Pareto front the search uses) are ringed in black.
    """
    by_mech = _rp_data(prof, cls)
    for i, (mech, pts) in enumerate(sorted(by_mech.items())):
        color, marker = _style(mech, i)
        r, p_other, p_compute = zip(*pts, strict=True)
        ax_r.scatter(r, p_other, color=color, marker=marker, alpha=0.7, s=22,  # type: ignore
                     label=f"{mech}: P_{cls}")
        ax_r.scatter(r, p_compute, facecolors="none", edgecolors=color,  # type: ignore
                     marker=marker, alpha=0.7, s=22, label=f"{mech}: P_compute")
        ax_p.scatter(p_other, p_compute, color=color, marker=marker, alpha=0.7,  # type: ignore
                     s=22, label=mech)
    top = max([1.15] + [v + 0.05 for pts in by_mech.values() for _, a, b in pts for v in (a, b)])
    table = prof.rp.get(cls, ())
    if table:
        ax_p.scatter([q.p_other for q in table], [q.p_compute for q in table],  # type: ignore
                     facecolors="none", edgecolors="black", s=90, linewidths=1.2,
                     label="R->P table (Pareto)")
    ax_p.plot([0, 1], [1, 0], color="grey", linestyle="--", linewidth=1,  # type: ignore
              label=DIAGONAL_LABEL)
    ax_r.set(xlabel=f"R (share of the GPU given to {cls})", ylabel="P (vs alone)",  # type: ignore
             title=f"R->P, {cls} beside a GEMM", xlim=(0, 1), ylim=(0, top))
    ax_p.set(xlabel=f"P_{cls}", ylabel="P_compute", xlim=(0, top), ylim=(0, top),  # type: ignore
             title=f"P_compute vs P_{cls} (above the line: overlap pays)")
    ax_p.set_aspect("equal")  # type: ignore[attr-defined]
    ax_r.legend(fontsize=7)  # type: ignore[attr-defined]
    ax_p.legend(fontsize=7)  # type: ignore[attr-defined]


def profile_figure(prof: Profile) -> object:
    """The figure `plot_profile` saves: per R->P class a row (R vs P, P vs P), then GEMMs vs SMs.

    Needs matplotlib with a backend already chosen (plot_profile picks Agg).
    """
    import matplotlib.pyplot as plt

    classes = sorted(set(prof.rp) | {p.other_class for p in prof.pairs})
    rows = max(1, len(classes))
    fig, axes = plt.subplots(rows, 3, figsize=(16, 4.8 * rows), squeeze=False)
    for row, cls in enumerate(classes):
        plot_rp(prof, axes[row][0], axes[row][1], cls)
    f = _frames(prof)
    ax_sm = axes[0][2]
    for op, row_ in f["by_sms"].iterrows():  # type: ignore[attr-defined]
        ax_sm.plot(row_.index, row_.values, "o-", label=op)
    ax_sm.set(xlabel="SMs", ylabel="best time (us)", title=f"GEMMs at {f['mid']} tokens")
    ax_sm.legend(fontsize=8)
    for row in range(len(classes), rows):
        for ax in axes[row][:2]:
            ax.set_axis_off()
    for row in range(1, rows):
        axes[row][2].set_axis_off()
    fig.suptitle(f"{prof.model.name} tp {prof.tp} on {prof.identity.gpu_name}: every measured "
                 "pair, one colour and marker per mechanism")
    fig.tight_layout()
    return fig


def plot_profile(prof: Profile, out: str | os.PathLike[str]) -> Path:
    """Write the R->P plots and GEMM time vs SMs to a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = profile_figure(prof)
    path = Path(out)
    fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path
