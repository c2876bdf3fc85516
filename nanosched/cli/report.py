"""What the commands print besides their library's own lines: aligned text tables, the
report of `nanosched analyze` and that of a finished search (`print_search_report`)."""

from __future__ import annotations

from typing import Any

import typer

VERIFY_COLUMNS = [("num_decode", "D", ""), ("num_tokens", "T", ""),
                  ("predicted_gain", "predicted", ".3f"),
                  ("sequential_ms", "sequential ms", ".2f"),
                  ("predicted_sequential_ms", "(predicted)", ".2f"),
                  ("pipeline_ms", "pipeline ms", ".2f"),
                  ("predicted_pipeline_ms", "(predicted)", ".2f"),
                  ("gain", "measured", ".3f"),
                  ("decode_context", "context", ""),
                  ("kept", "kept", "")]
MODEL_COLUMNS = [("name", "model", ""), ("arch", "arch", ""),
                 ("params_b", "params (B)", ".3f"), ("bf16_gib", "bf16 GiB", ".1f"),
                 ("fp32_gib", "fp32 GiB", ".1f"), ("kv_kib_per_token", "KV KiB/token", ".0f")]
ANALYSIS_COLUMNS = [("op", "op", ""), ("class", "class", ""), ("gflop", "GFLOP", ".1f"),
                    ("gb", "mem GB", ".2f"), ("net", "net GB", ".2f"),
                    ("tc", "T_comp ms", ".2f"), ("tm", "T_mem ms", ".2f"),
                    ("tn", "T_net ms", ".2f"), ("bound", "bottleneck", "")]


def print_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """Print rows as an aligned text table; columns are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([format(row[k], f) if isinstance(row.get(k), (int, float)) and f
                      else str(row.get(k, "-")) for k, _, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for n, r in enumerate(cells):
        typer.echo("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if n == 0:
            typer.echo("  ".join("-" * w for w in widths))


def print_search_report(sset: Any, dense_only: bool, synthetic: bool) -> None:
    """What `nanosched search` found: the steady state's pipeline table and prediction, the
    table of every entry (unless only the steady state was searched), the set's summary, and a
    warning when its profile was synthetic."""
    from nanosched.schedules.show import (
        PIPELINE_COLUMNS,
        SET_COLUMNS,
        pipeline_rows,
        set_rows,
        set_summary_lines,
        summary_lines,
    )

    full = sset.full
    if full is not None and full.schedule is not None:
        print_table(pipeline_rows(full.schedule), PIPELINE_COLUMNS)
        typer.echo(LEGEND)
        for line in summary_lines(full.schedule):
            typer.echo(line)
    if not dense_only:
        print_table(set_rows(sset), SET_COLUMNS)
    for line in set_summary_lines(sset):
        typer.echo(line)
    if synthetic:
        typer.echo("WARNING: predicted from a SYNTHETIC profile, not measurements")


LEGEND = ("(k: the layer a nano-op works on, l - k in period l; R: its share of the GPU, P: the "
          "speed it keeps there, 1 = alone on the whole GPU; alloc full:SMs = every SM, "
          "green_ctx:N = an N-SM partition, cta:N = at most N thread blocks; period / bound / "
          "gap: the solver's layer time, the least it proved possible, the distance between)")


def verdict_lines(s: Any, path: str, what: str, work: float, wall_s: float,
                  synthetic: bool) -> list[str]:
    """The search's last lines, for a reader without the papers: what was searched, the
    verdict, what to run next."""
    pipes = s.pipelines
    gpu = s.gpu_name + (" (a SYNTHETIC profile)" if synthetic else "")
    lines = [f"searched: {s.model['name']} at tp {s.tp} on {gpu}, {what} ({len(s.entries)} "
             f"batch shapes), solver work {work:g} (deterministic), took {wall_s:.0f} s"]
    full = s.full
    best = full.schedule.prediction.speedup if full is not None and \
        full.schedule is not None else None
    found = f"; the best pipeline found at the steady state predicts {best:.2f}x" \
        if best is not None else ""
    if pipes:
        top = max(pipes, key=lambda e: e.speedup)
        lines.append(f"verdict: PIPELINED at {len(pipes)} of {len(s.entries)} batch shapes, up "
                     f"to {top.speedup:.2f}x of Sequential's speed predicted (D={top.num_decode}"
                     f", T={top.num_tokens}); Sequential elsewhere{found}")
        lines.append(f"next: on the GPU, nanosched verify {path} --out {path} (keeps the "
                     f"pipelines that win there), then nanosched bench --model "
                     f"{s.model['name']} --tp {s.tp} --schedule {path} --compare")
        return lines
    unproven = sum(e.proof == "unproven" for e in s.entries)
    proof = "proven" if not unproven else f"NOT proven at {unproven} shapes (a longer " \
        f"--time-limit may find a pipeline there)"
    lines.append(f"verdict: NO GAIN, {proof}: no pipeline reaches the {s.min_gain:.2f}x of "
                 f"Sequential an entry needs{found}; the set runs Sequential")
    lines.append(f"next: serve or bench with --schedule sequential (the default's choice "
                 f"here); nanosched show {path} --plot gantt.png draws the best pipeline found")
    return lines


def print_analysis(a: Any) -> None:
    """`nanosched analyze`'s report of a costmodel Analysis: the setting, one row per op over
    all layers with its bottleneck, then T_R, the sequential iteration and the optimum."""
    mix = a.mix
    typer.echo(f"{a.model.name} on {a.tp} x {a.gpu.name} ({a.gpu.compute_gflops / 1e3:g} TFLOP/s, "
               f"{a.gpu.mem_bw_gbs:g} GB/s, {a.gpu.net_bw_gbs:g} GB/s link; {a.gpu.source})")
    typer.echo(f"workload {a.workload.name}: p={a.workload.input_len:g}, "
               f"d={a.workload.output_len:g}; dense batch {mix.dense_batch} = "
               f"{mix.num_decode:.0f} decode (context {mix.decode_context:g}) + "
               f"{mix.num_prefill:.0f} prefill tokens")
    typer.echo("")
    rows = [{"op": o.name, "class": o.resource, "gflop": o.flops / 1e9, "gb": o.mem_bytes / 1e9,
             "net": o.net_bytes / 1e9, "tc": o.t_compute_s * 1e3, "tm": o.t_mem_s * 1e3,
             "tn": o.t_net_s * 1e3, "bound": o.bottleneck} for o in a.ops]
    rows.append({"op": "total", "class": "", "gflop": a.total("flops") / 1e9,
                 "gb": a.total("mem_bytes") / 1e9, "net": a.total("net_bytes") / 1e9,
                 "tc": a.total("t_compute_s") * 1e3, "tm": a.total("t_mem_s") * 1e3,
                 "tn": a.total("t_net_s") * 1e3, "bound": a.bottleneck})
    print_table(rows, ANALYSIS_COLUMNS)
    typer.echo("")
    params = a.model.num_params(active=True)
    typer.echo(f"parameters used per token: {params / 1e9:.2f} B; "
               f"largest dense batch that fits: {a.max_dense_batch}")
    typer.echo(f"T_R = T_mem / T_compute (Eq. 4): {a.t_r:.3f} "
               f"({'compute' if a.t_r < 1 else 'memory'}-bound)")
    seq = a.sequential_iteration_s
    typer.echo(f"sequential iteration (each op at its bottleneck): {seq * 1e3:.2f} ms = "
               f"{mix.dense_batch / seq / a.tp:.0f} tokens/s/GPU")
    typer.echo(f"optimal throughput (Eq. 5): {a.optimal_tokens_per_s_per_gpu:.0f} tokens/s/GPU")
