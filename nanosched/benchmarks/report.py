"""What `nanosched bench` prints: the results table (one column per run, one row per metric, as
`vllm bench` reports them) and the warnings a ratio between two runs carries.

Both read only plain dicts (a run's `results` and its counters), so a new figure is one more
row in `REPORT_ROWS` and the JSON report keeps its keys. Units: the JSON holds seconds; the table
shows latencies in ms and throughput in tokens (or requests) per second.
"""

from __future__ import annotations

from typing import Any

from nanosched.constants import SEQUENTIAL

# (key in a run's "results", label, scale, format); a row "" starts a section named by label.
# A row whose value is None in every run is left out (% of optimal needs a measured GEMM peak:
# a GPU), and so is throughput per GPU on one GPU.
REPORT_ROWS: list[tuple[str, str, float, str]] = [
    ("requests", "Successful requests", 1, "d"),
    ("elapsed_s", "Benchmark duration (s)", 1, ".2f"),
    ("prompt_tokens", "Total input tokens", 1, "d"),
    ("output_tokens", "Total generated tokens", 1, "d"),
    ("requests_per_s", "Request throughput (req/s)", 1, ".2f"),
    ("output_tokens_per_s", "Output token throughput (tok/s)", 1, ".1f"),
    ("tokens_per_s", "Total token throughput (tok/s)", 1, ".1f"),
    ("tokens_per_s_per_gpu", "Total token throughput per GPU (tok/s)", 1, ".1f"),
    ("percent_of_optimal", "% of optimal (GEMM peak / 2 x params)", 1, ".1f"),
    ("", "Time to First Token", 1, ""),
    ("ttft_mean_s", "Mean TTFT (ms)", 1e3, ".2f"),
    ("ttft_median_s", "Median TTFT (ms)", 1e3, ".2f"),
    ("ttft_p99_s", "P99 TTFT (ms)", 1e3, ".2f"),
    ("", "Time per Output Token (excl. 1st token)", 1, ""),
    ("tpot_mean_s", "Mean TPOT (ms)", 1e3, ".2f"),
    ("tpot_median_s", "Median TPOT (ms)", 1e3, ".2f"),
    ("tpot_p99_s", "P99 TPOT (ms)", 1e3, ".2f"),
    ("", "Inter-token Latency", 1, ""),
    ("itl_mean_s", "Mean ITL (ms)", 1e3, ".2f"),
    ("itl_median_s", "Median ITL (ms)", 1e3, ".2f"),
    ("itl_p99_s", "P99 ITL (ms)", 1e3, ".2f"),
]

# a row that repeats another on one GPU (left out there)
SAME_ON_ONE_GPU = {"tokens_per_s_per_gpu": "tokens_per_s"}

# a ratio between two runs is flagged when the run compared replayed its strategy in fewer
# iterations than these, or when either run was shorter than MIN_RATIO_SECONDS
MIN_REPLAYED_ITERATIONS = 20
MIN_REPLAYED_SHARE = 0.5
MIN_RATIO_SECONDS = 2.0


def _cell(value: Any, scale: float, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "d":
        return f"{int(value):,}"
    return format(value * scale, fmt)


def results_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The table's lines: `results` maps a run's name to its metrics (a run's "results")."""
    names = list(results)
    rows: list[list[str] | str] = []
    for key, label, scale, fmt in REPORT_ROWS:
        if not key:
            rows.append(label)
            continue
        values = [results[n].get(key) for n in names]
        if all(v is None for v in values) or key in SAME_ON_ONE_GPU and all(
                v == results[n].get(SAME_ON_ONE_GPU[key]) for n, v in zip(names, values,
                                                                           strict=True)):
            continue
        rows.append([label, *(_cell(v, scale, fmt) for v in values)])
    body = [r for r in rows if isinstance(r, list)]
    header = ["", *names]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    total = sum(widths) + 2 * len(names)
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                       for i, (h, w) in enumerate(zip(header, widths, strict=True))),
             "=" * total]
    for n, r in enumerate(rows):
        if isinstance(r, str):
            nxt = rows[n + 1] if n + 1 < len(rows) else None
            if isinstance(nxt, list):  # a section with at least one row
                lines.append(f" {r} ".center(total, "-"))
            continue
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    lines.append("=" * total)
    return lines


def ratio_warnings(run: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """Why the ratio of `run` over `base` (two runs of a bench report) may be noise: `run`'s
    strategy replayed in few of its iterations (the rest ran Sequential), or a short run."""
    out = []
    if run.get("strategy") != SEQUENTIAL:
        iters, fell = run.get("iterations", 0), run.get("fallbacks", 0)
        replayed = run.get("pipelined_iterations", iters - fell)
        if replayed < MIN_REPLAYED_ITERATIONS or replayed < MIN_REPLAYED_SHARE * iters:
            out.append(f"{run.get('strategy')} pipelined only {replayed} of {iters} iterations "
                       f"(the rest ran Sequential)" if replayed < iters else
                       f"{run.get('strategy')} ran only {iters} iterations")
    short = min(run["results"]["elapsed_s"], base["results"]["elapsed_s"])
    if short < MIN_RATIO_SECONDS:
        out.append(f"a run took {short:.2f} s (under {MIN_RATIO_SECONDS:g} s)")
    return out


AFTER = f"{SEQUENTIAL}-after"  # --compare: Sequential again after the strategy


def run_ratio(runs: dict[str, dict[str, Any]], a: str, b: str) -> dict[str, Any]:
    """Run `a`'s tokens/s over run `b`'s: over the mean of `b` and the Sequential run after
    the strategy when `b` is Sequential and that run is there (A-B-A: a drift of the GPU over
    the runs falls on both sides), with the drift between the two and why it may be noise."""
    tps = {name: run["results"]["tokens_per_s"] for name, run in runs.items()}
    warnings = ratio_warnings(runs[a], runs[b])
    after = AFTER + b.removeprefix(SEQUENTIAL) if b.startswith(SEQUENTIAL) else None
    if after not in tps:
        return {"of": f"{a} / {b}", "tokens_per_s": tps[a] / tps[b], "warnings": warnings}
    drift = tps[after] / tps[b]
    value = tps[a] / ((tps[b] + tps[after]) / 2)
    if abs(value - 1) <= abs(drift - 1):
        warnings.append(f"the two Sequential runs differ by {100 * abs(drift - 1):.1f}%, "
                        f"as much as the strategy differs from them")
    return {"of": f"{a} / mean({b}, {after})", "tokens_per_s": value,
            "sequential_drift": drift, "warnings": warnings}


def header_lines(out: dict[str, Any], model: str, tp: int, seed: int) -> list[str]:
    """The report's first lines: device, model, batch and weights, then the results table and
    what optimal is where a GEMM peak was measured."""
    env, conf = out["environment"], out["config"]
    weights_used = "random weights" if conf["weights"] == "random" else conf["weights"]
    fp8 = " (FP8 W8A8)" if conf.get("quantization") == "fp8" else ""
    lines = [f"{env['device']}: {model} tp={tp}, dense batch {conf['dense_batch']}, "
             f"{weights_used}" + (f" (seed {seed})" if conf["weights"] == "random" else "")
             + fp8 + (f"; {out['warmup_prompts']} untimed warm-up requests before each run"
                if out.get("warmup_prompts") else "; no warm-up (--warmup-prompts 0): the first "
                "requests' times include the first calls' costs")]
    if out.get("weight_bytes"):
        held = out.get("gpu_bytes_after_load")
        lines.append(f"weights: {out['weight_bytes'] / 1e9:.2f} GB per rank"
                     + (f" ({held / 1e9:.2f} GB allocated once loaded)" if held else ""))
    lines += results_table({name: run["results"] for name, run in out["runs"].items()})
    optimal = next(iter(out["runs"].values()))["results"].get("optimal_tokens_per_s_per_gpu")
    if optimal:
        lines.append(f"optimal: {optimal:,.0f} tokens/s per GPU = "
                     f"{out.get('gemm_precision', 'bf16')} GEMM peak "
                     f"{out['gemm_tflops_8192']:.0f} TFLOP/s (8192^3, 50 ms from an idle GPU) / "
                     f"(2 x active parameters)")
    return lines


RECOMPUTE_HINT = 0.10  # tokens computed again by preemption, of the prompts', that earn a hint


def run_lines(name: str, run: dict[str, Any]) -> list[str]:
    """A run's counters under the results table: iterations (pipelined, sequential by the
    strategy's decision, no entry), batches, preemptions, graphs, the full-batch forward and
    the most-run batch shapes (ms throughout)."""
    p = run["preemptions"]
    lines = [f"[{name}] strategy {run['strategy']}: {run['iterations']} iterations "
             f"({run['pipelined_iterations']} pipelined, {run['sequential_iterations']} "
             f"sequential by the strategy's decision, {run['no_entry_iterations']} with no "
             f"entry: fallback), {run['tokens_per_iteration']:.1f} tokens per iteration, "
             f"{100 * run['full_batch_share']:.1f}% at the dense batch; admission "
             f"{run['admission']}: {p['preemptions']} preemptions ({p['recomputed']} "
             f"recomputed, {p['swapped']} swapped)"]
    prompts = run["results"].get("prompt_tokens") or 0
    share = p.get("recomputed_tokens", 0) / prompts if prompts else 0.0
    if share >= RECOMPUTE_HINT:
        lines.append(f"  preemption computed {p['recomputed_tokens']:,} tokens again "
                     f"({100 * share:.0f}% of the prompts' tokens): the cache holds fewer "
                     f"requests than were admitted; --admission reserve admits a request only "
                     f"when its pages to max_tokens fit (TensorRT-LLM's default policy), "
                     f"--kv-headroom keeps a share free")
    c = run.get("prefix_cache")
    if c is not None:
        lines.append(f"  prefix cache: {100 * c['hit_rate']:.1f}% of prompt tokens hit "
                     f"({c['hits_tokens']} of {c['queries_tokens']}), {c['evicted_pages']} "
                     f"pages evicted" if c["enabled"] else "  prefix cache: off")
    m = run.get("gpu_memory")
    if m is not None:
        lines.append(f"  GPU memory: {m['kv_bytes'] / 1e9:.1f} GB of KV pages, "
                     f"{m['reserve_bytes'] / 1e9:.1f} GB kept beside them; torch's peak "
                     f"{m['peak_reserved_bytes'] / 1e9:.1f} GB, {m['used_bytes_end'] / 1e9:.1f} "
                     f"GB in use at the end, of a {m['budget_bytes'] / 1e9:.1f} GB budget "
                     f"(--gpu-memory-utilization of {m['total_bytes'] / 1e9:.1f} GB)")
    if "gpu_timeline" in run:
        t, wall = run["gpu_timeline"], run["results"]["elapsed_s"]
        lines.append(f"  GPU: {t['busy_s']:.1f} s on {t['iterations']} iterations' work, "
                     f"{t['idle_s']:.1f} s between them waiting for the CPU "
                     f"({100 * t['idle_s'] / wall:.0f}% of the {wall:.1f} s run)")
    if "tp_messages" in run:
        m = run["tp_messages"]
        lines.append(f"  tensor parallel: rank 0 sent {m['steps']} steps to the other ranks, "
                     f"{m['host_us_per_step']:.0f} us and {m['bytes_per_step'] / 1e3:.1f} KB "
                     f"per step")
    if "graph_stats" in run:
        g = run["graph_stats"]
        lines.append(f"  CUDA graphs: {g['replays']} replays, {g['captures']} captures "
                     f"({g['capture_s']:.1f} s) over {g['buckets']} buckets, "
                     f"{g['eager_bucket'] + g['unbucketed']} eager iterations, "
                     f"{g['padded_rows']} padded rows")
        lines += [f"  graph capture failed for {key}: {err}"
                  for key, err in run.get("graph_errors", {}).items()]
    line = f"  full-batch forward ({'graph' if run.get('graphs') else 'eager'}) " \
           f"{run['forward_ms_full_batch']:.2f} ms = " \
           f"{run['layer_us_full_batch'] / 1e3:.3f} ms per layer"
    if "predicted_period_us" in run:
        line += f" (schedule predicted {run['predicted_period_us'] / 1e3:.3f} ms)"
    lines.append(line)
    return lines + [_shape_line(row) for row in run.get("shapes", [])
                    if "forward_ms" in row or "entry" in row]


def _shape_line(row: dict[str, Any]) -> str:
    """One most-run batch shape: its iterations, the set's entry and prediction there, and the
    median of the run's forwards at that shape."""
    text = f"  shape D={row['num_decode']} T={row['num_tokens']}: {row['iterations']} iterations"
    if "entry" in row:
        text += f", entry {row['entry']}"
        if row["entry"] != "none":
            text += f" (key {row['key'][0]},{row['key'][1]})"
            if row.get("predicted_forward_ms") is not None:
                text += f", predicted {row['predicted_forward_ms']:.2f} ms"
    if "forward_ms" in row:
        text += f", measured {row['forward_ms']:.2f} ms (median of the run's " \
                f"{row['forward_iterations']} forwards there)"
    return text


def ratio_lines(out: dict[str, Any]) -> list[tuple[str, str | None]]:
    """Per ratio between runs: its line, and the warning for stderr when it may be noise."""
    lines = []
    for ratio in out["ratios"].values():
        warning = None
        if ratio["warnings"]:
            warning = (f"warning: ratio {ratio['of']} may be noise: "
                       f"{'; '.join(ratio['warnings'])}. Serve more or longer requests "
                       f"(--num-prompts, --output-len)")
        lines.append((f"ratio {ratio['of']}: {ratio['tokens_per_s']:.3f}x tokens/s "
                      f"(same requests, same process)", warning))
    return lines
