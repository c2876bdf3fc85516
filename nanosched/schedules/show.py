"""Present a schedule: the pipeline as rows, a summary, and a per-stream Gantt chart.

The chart follows NanoFlow's Figure 6: one lane per stream, one box per nano-op of the
steady-state period (two layers unrolled), labelled with the op, its nano-batch and its share R.
matplotlib is imported only when a chart is drawn (the `plot` extra).
"""

from __future__ import annotations

import os
from typing import Any

from nanosched.errors import ConfigError
from nanosched.schedules.format import Schedule

COLORS = {"compute": "#f2c14e", "memory": "#7bc67e", "network": "#6fa8dc", "other": "#c9c9c9"}


def pipeline_rows(s: Schedule) -> list[dict[str, Any]]:
    """One row per nano-op, by stream and issue order."""
    rows = []
    for n in sorted(s.nano_ops, key=lambda n: (n.stream, n.order)):
        rows.append({"stream": n.stream, "order": n.order, "k": n.layer_offset, "nano_op": n.id,
                     "tokens": f"{n.start}-{n.end}", "start": n.start_us,
                     "dur": n.duration_us, "share": n.alloc.share, "p": n.alloc.p,
                     "how": f"{n.alloc.mechanism}:{n.alloc.units}",
                     "deps": ",".join(d.id + ("'" if d.shift else "") for d in n.deps)})
    return rows


PIPELINE_COLUMNS = [("stream", "stream", ""), ("order", "#", ""), ("k", "k", ""),
                    ("nano_op", "nano-op", ""), ("tokens", "tokens", ""),
                    ("start", "start us", ".1f"), ("dur", "dur us", ".1f"),
                    ("share", "R", ".2f"), ("p", "P", ".2f"), ("how", "alloc", ""),
                    ("deps", "deps (' = previous layer)", "")]


def summary_lines(s: Schedule) -> list[str]:
    p, b = s.prediction, s.batch
    lines = [f"{s.model['name']} tp={s.tp} on {s.gpu_name} ({s.num_sms} SMs), profile "
             f"{s.profile_digest}; dense batch {b.dense_batch} = {b.num_decode} decode + "
             f"{b.dense_batch - b.num_decode} prefill tokens ({b.workload})",
             f"collectives: {s.forms or 'none (tp=1)'}"]
    for st in s.stages:
        lines.append(f"{st.stage}: {st.status}, period {st.objective_us:.1f} us, bound "
                     f"{st.bound_us:.1f} us, gap {100 * st.gap:.1f}%, {st.wall_s:.1f} s "
                     f"(limit {st.time_limit_s:g} s, {st.num_workers} workers)")
    lines += [f"layer period: {p.period_us:.1f} us replayed (solver {p.solver_period_us:.1f}),"
              f" sequential {p.sequential_period_us:.1f} us",
              f"iteration: {p.iteration_us / 1e3:.2f} ms vs sequential "
              f"{p.sequential_iteration_us / 1e3:.2f} ms: predicted speedup {p.speedup:.2f}x",
              f"throughput: {p.tokens_per_s:.0f} tokens/s/GPU = "
              f"{100 * p.tokens_per_s / p.optimal_tokens_per_s:.1f}% of optimal "
              f"({p.optimal_tokens_per_s:.0f})"]
    if p.speedup < 1:
        lines.append("NO GAIN: the sequential schedule is predicted faster at this batch; "
                     "run the Sequential scheduler (or a larger dense batch)")
    return lines + [f"note: {n}" for n in s.notes]


def plot_gantt(s: Schedule, path: str | os.PathLike[str]) -> None:
    """Draw the steady-state pipeline (layers l and l + 1) per stream to `path` (PNG/SVG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'nanosched[plot]'") from None
    period = s.prediction.solver_period_us
    lanes = [st.name for st in s.streams]
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.9 * len(lanes)))
    for n in s.nano_ops:
        for layer in (0, 1):
            x0 = n.start_us + layer * period
            ax.broken_barh([(x0, n.duration_us)], (lanes.index(n.stream) - 0.4, 0.8),
                           facecolors=COLORS.get(n.resource, "#999"), edgecolors="black",
                           alpha=1.0 if layer == 0 else 0.55, hatch=None if n.start == 0 else "//")
            if n.duration_us > 0.03 * period:
                ax.text(x0 + n.duration_us / 2, lanes.index(n.stream),
                        f"{n.id}\nR={n.alloc.share:g}", ha="center", va="center", fontsize=7)
    for t in (period, 2 * period):
        ax.axvline(t, color="red", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("time (us); layer l solid, layer l+1 faded; red lines: period boundaries")
    ax.set_title(f"{s.model['name']} tp={s.tp} on {s.gpu_name}: period {period:.0f} us, "
                 f"B={s.batch.dense_batch}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
