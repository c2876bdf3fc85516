"""Present a schedule: the pipeline as rows, a summary, and a per-stream Gantt chart; a
schedule set as a table of its keys (decision, predicted times and gain) and a summary.

The chart follows NanoFlow's Figure 6: one lane per stream, one box per nano-op of the
steady-state period (two layers unrolled), labelled with the op, its nano-batch and its share R
where the label fits inside the box (the others are listed under the chart, so no two labels
overlap). matplotlib is imported only when a chart is drawn (the `plot` extra).
"""

from __future__ import annotations

import os
from typing import Any

from nanosched.constants import SEQUENTIAL
from nanosched.errors import ConfigError
from nanosched.schedules.format import Schedule
from nanosched.schedules.sets import GAP_PROVEN, PROOFS, ScheduleSet, SetEntry

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
             f"{s.profile_digest}"
             f"{'' if s.quantization == 'none' else f' ({s.quantization} weights)'}; "
             f"dense batch {b.dense_batch} = {b.num_decode} decode + "
             f"{b.dense_batch - b.num_decode} prefill tokens ({b.workload})",
             f"collectives: {s.forms or 'none (tp=1)'}"]
    for st in s.stages:
        lines.append(f"{st.stage}: {st.status}, period {st.objective_us:.1f} us, bound "
                     f"{st.bound_us:.1f} us, gap {100 * st.gap:.1f}%, {st.wall_s:.1f} s "
                     f"(limit {st.time_limit_s:g} s, {st.num_workers} workers)")
    lines += [f"layer period: {p.period_us:.1f} us replayed (solver {p.solver_period_us:.1f}),"
              f" sequential {p.sequential_period_us:.1f} us",
              f"iteration: {p.iteration_us / 1e3:.2f} ms vs sequential "
              f"{p.sequential_iteration_us / 1e3:.2f} ms: predicted speedup {p.speedup:.2f}x "
              f"(this pipeline over Sequential)",
              f"throughput: {p.tokens_per_s:.0f} tokens/s/GPU = "
              f"{100 * p.tokens_per_s / p.optimal_tokens_per_s:.1f}% of optimal "
              f"({p.optimal_tokens_per_s:.0f})"]
    if p.speedup < 1:
        lines.append("NO GAIN: the sequential schedule is predicted faster at this batch; "
                     "run the Sequential scheduler (or a larger dense batch)")
    return lines + [f"note: {n}" for n in s.notes]


def proof_text(e: SetEntry, min_gain: float) -> str:
    """Whether a sequential entry's NO GAIN is proven, and by what (autosearch/proof.py); ""
    for a pipeline or an entry of a set searched before proofs were recorded."""
    if e.kind != SEQUENTIAL or e.proof is None:
        return ""
    gaps = "/".join("-" if g is None else f"{100 * g:.1f}%" for g in (e.stage1_gap,
                                                                      e.stage2_gap))
    ceiling = "?" if e.ceiling is None else f"{e.ceiling:.3f}x"
    bound = "" if e.structure_bound is None else f"{e.structure_bound:.3f}x"
    stage1 = "-" if e.stage1_gap is None else f"{100 * e.stage1_gap:.1f}%"
    structure = (f"stands: stage II's bound {bound} < {min_gain:.2f}x, stage I's gap "
                 f"{stage1} <= {100 * GAP_PROVEN:.0f}%" if bound else
                 f"stands: stage I/II gaps {gaps} <= {100 * GAP_PROVEN:.0f}%")  # older sets
    return {"small": "proven: no two nano-batches",
            "bound": "proven by the bound",
            "ceiling": f"proven: ceiling {ceiling} < {min_gain:.2f}x",
            "gap": structure,
            }.get(e.proof, f"NOT proven: ceiling {ceiling} >= {min_gain:.2f}x, "
                           f"{'stage II bound ' + bound + ', ' if bound else ''}"
                           f"stage I/II gaps {gaps}")


def set_rows(s: ScheduleSet) -> list[dict[str, Any]]:
    """One row per key, by rows then decode rows."""
    return [{"t": e.num_tokens, "d": e.num_decode, "kind": e.kind,
             "seq": e.sequential_us / 1e3, "fwd": e.forward_us / 1e3, "gain": e.speedup,
             "proof": proof_text(e, s.min_gain), "reason": e.reason}
            for e in sorted(s.entries, key=lambda e: (e.num_tokens, e.num_decode))]


SET_COLUMNS = [("t", "T rows", ""), ("d", "D decode", ""), ("kind", "runs", ""),
               ("seq", "sequential ms", ".2f"), ("fwd", "predicted ms", ".2f"),
               ("gain", "gain", ".3f"), ("proof", "NO GAIN", ""), ("reason", "why", "")]


def proof_lines(s: ScheduleSet) -> list[str]:
    """How many sequential entries have their NO GAIN proven, by what, and where it is not."""
    seq = [e for e in s.entries if e.kind == SEQUENTIAL]
    if not seq:
        return []
    if all(e.proof is None for e in seq):
        return ["NO GAIN proofs: not recorded (a set searched before they were)"]
    by = {p: [e for e in seq if e.proof == p] for p in PROOFS}
    labels = {"small": "too small", "bound": "by the bound", "ceiling": "by the ceiling",
              "gap": "by the kept structure's bound"}
    how = ", ".join(f"{len(by[p])} {label}" for p, label in labels.items() if by[p])
    lines = [f"NO GAIN proven at {len(seq) - len(by['unproven'])} of {len(seq)} sequential "
             f"shapes{': ' + how if how else ''}"]
    if by["unproven"]:
        top = max(by["unproven"], key=lambda e: e.ceiling or 0.0)
        lines.append(f"NOT proven at {len(by['unproven'])}: ceilings up to "
                     f"{top.ceiling or 0:.3f}x (D={top.num_decode}, T={top.num_tokens}) >= "
                     f"{s.min_gain:.2f}x and the kept structure's bound does not settle it, "
                     f"so a longer search (--time-limit) may still find a pipeline there")
    return lines


def set_summary_lines(s: ScheduleSet) -> list[str]:
    """What the set decides, in a few lines; says so when it is all sequential."""
    pipes = s.pipelines
    lines = [f"{s.model['name']} tp={s.tp} on {s.gpu_name}, profile {s.profile_digest}, "
             f"KV {s.kv_dtype}"
             f"{'' if s.quantization == 'none' else f', {s.quantization} weights'}; "
             f"dense batch {s.dense_batch} ({s.workload}): {len(s.entries)} "
             f"batch shapes, {len(pipes)} pipelined (each predicts >= {s.min_gain:.2f}x)"]
    if s.search:
        x = s.search
        bounded, ceiling = x.get("bounded", 0), x.get("ceiling", 0)
        lines.append(f"search: {x.get('searched', 0)} shapes searched, {bounded + ceiling} "
                     f"ruled out below {s.min_gain:.2f}x without a solve ({bounded} by the "
                     f"bound, {ceiling} by the ceiling), {x.get('small', 0)} "
                     f"too small, {x.get('failed', 0)} failed"
                     + (f", {x['unsearched']} not searched (the time limit ran out)"
                        if x.get("unsearched") else "")
                     + (f"; solver work {x.get('time_limit_s', 0):g} (CP-SAT deterministic "
                        f"time), took {x.get('wall_s', 0):.0f} s" if x.get("deterministic") else
                        f"; {x.get('wall_s', 0):.0f} s of {x.get('time_limit_s', 0):g} s"))
    full = s.full
    if full is not None:
        proof = proof_text(full, s.min_gain)
        lines.append(f"steady state (D={full.num_decode}, T={full.num_tokens}): {full.kind}, "
                     f"predicted {full.forward_us / 1e3:.2f} ms vs sequential "
                     f"{full.sequential_us / 1e3:.2f} ms ({full.speedup:.2f}x: what the set "
                     f"runs there{', Sequential' if full.kind == SEQUENTIAL else ''})"
                     + (f"; NO GAIN {proof}" if proof else ""))
    lines += proof_lines(s)
    if not pipes:
        unproven = any(e.proof == "unproven" for e in s.entries)
        lines.append(f"NO GAIN{' found (not proven everywhere: above)' if unproven else ''}: "
                     "no batch shape is predicted to gain from a pipeline; the set "
                     "runs Sequential everywhere (keep --schedule sequential; a profile taken "
                     "with the GPU's fastest few-SM kernels, e.g. cuda_bulk on Hopper, gives the "
                     "search the most to work with: docs/findings.md)")
    else:
        best = max(pipes, key=lambda e: e.speedup)
        lines.append(f"pipelined shapes gain {min(e.speedup for e in pipes):.2f}x.."
                     f"{best.speedup:.2f}x (best at D={best.num_decode}, "
                     f"T={best.num_tokens}); `nanosched show FILE --key D,T` shows one")
    return lines


def _fit_label(ax: Any, renderer: Any, x0: float, width: float, lane: int,
               candidates: list[tuple[str, int]]) -> Any:
    """Place the first (label, rotation) that fits inside the bar; None when none does."""
    (left, bottom), (right, top) = ax.transData.transform([(x0, lane - 0.4),
                                                           (x0 + width, lane + 0.4)])
    room_w, room_h = right - left - 4, top - bottom - 4  # pixels, a 2-pixel margin
    for label, rotation in candidates:
        text = ax.text(x0 + width / 2, lane, label, ha="center", va="center", fontsize=7,
                       rotation=rotation, rotation_mode="anchor",
                       bbox={"facecolor": "white", "alpha": 0.75, "pad": 1, "linewidth": 0})
        box = text.get_window_extent(renderer)
        if box.width <= room_w and box.height <= room_h:
            return text
        text.remove()
    return None


def gantt_figure(s: Schedule, note: str | None = None) -> Any:
    """The steady-state pipeline (layers l and l + 1) per stream, as a matplotlib Figure.

    Bars are labelled (op and nano-batch, then the share R) only where the label fits inside the
    bar, across or else upright, and only in layer l (layer l + 1 repeats it, faded); so no two
    labels overlap. The nano-ops too narrow for any
    label are listed under the chart, per stream in issue order. Needs matplotlib with a
    backend chosen (plot_gantt picks Agg).
    """
    import matplotlib.pyplot as plt

    period = s.prediction.solver_period_us
    lanes = [st.name for st in s.streams]
    fig, ax = plt.subplots(figsize=(14, 1.6 + 0.9 * len(lanes)))
    end = 0.0
    for n in s.nano_ops:
        for layer in (0, 1):
            x0 = n.start_us + layer * period
            end = max(end, x0 + n.duration_us)
            ax.broken_barh([(x0, n.duration_us)], (lanes.index(n.stream) - 0.4, 0.8),
                           facecolors=COLORS.get(n.resource, "#999"), edgecolors="black",
                           alpha=1.0 if layer == 0 else 0.55, hatch=None if n.start == 0 else "//")
    for t in (period, 2 * period):
        ax.axvline(t, color="red", linestyle="--", linewidth=1)
    ax.set_xlim(min(0.0, min((n.start_us for n in s.nano_ops), default=0.0)) - 0.02 * period,
                max(end, 2 * period) + 0.02 * period)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("time (us); layer l solid, layer l+1 faded; hatched: a nano-batch after the "
                  "first; red lines: period boundaries")
    title = f"{s.model['name']} tp={s.tp} on {s.gpu_name}: period {period:.0f} us, " \
            f"B={s.batch.dense_batch}"
    ax.set_title(title if note is None else f"{note}\n{title}",
                 color="black" if note is None else "firebrick")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    renderer = fig.canvas.get_renderer()
    unlabelled: dict[str, list[str]] = {}
    for n in sorted(s.nano_ops, key=lambda n: (n.stream, n.order)):
        lane = lanes.index(n.stream)
        text = _fit_label(ax, renderer, n.start_us, n.duration_us, lane,
                          [(f"{n.id}\nR={n.alloc.share:g}", 0), (n.id, 0),
                           (f"{n.id} R={n.alloc.share:g}", 90), (n.id, 90)])
        if text is None:
            unlabelled.setdefault(n.stream, []).append(n.id)
    if unlabelled:
        note = "too narrow to label: " + "; ".join(
            f"{lane}: {', '.join(ids)}" for lane, ids in unlabelled.items())
        fig.text(0.01, 0.01, note, fontsize=7, ha="left", va="bottom", wrap=True)
    return fig


def plot_gantt(s: Schedule, path: str | os.PathLike[str], note: str | None = None) -> None:
    """Draw the steady-state pipeline (layers l and l + 1) per stream to `path` (PNG/SVG);
    `note` heads the title (a pipeline the set does not run says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'nanosched[plot]'") from None
    fig = gantt_figure(s, note)
    fig.savefig(path, dpi=120)
    plt.close(fig)
