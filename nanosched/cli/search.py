"""The schedule commands: `search` (two-stage CP-SAT → a schedule set), `verify` (each pipeline
of a set timed against Sequential on the GPU) and `show` (a set's entries or one pipeline,
optionally as a Gantt chart)."""

from __future__ import annotations

import sys

import typer

from nanosched.cli.common import default_gpu, literal, require_matplotlib, sigterm_as_interrupt
from nanosched.cli.options import MeanInputLen, MeanOutputLen, WorkloadName, model_option
from nanosched.cli.report import VERIFY_COLUMNS, print_search_report, print_table, verdict_lines


def search(
    model: str | None = model_option("Model name or HF config.json; default: the model the "
                                     "--profile FILE was measured for (a frontend model's).",
                                     default=None),
    tp: int | None = typer.Option(None, "--tp", help="Tensor-parallel degree; default: the "
                                  "profile's, or the smallest that fits the dense batch."),
    profile: str | None = typer.Option(None, "--profile", help="Profile FILE or shipped NAME; "
                                       "default: the closest shipped one, else synthetic."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU for a synthetic profile and the "
                                   "memory fit; a shipped profile is picked only for it "
                                   "(default: the GPU present, else h100, said)."),
    input_len: MeanInputLen = None,
    output_len: MeanOutputLen = None,
    workload: WorkloadName = None,
    dense_batch: str = typer.Option("auto", "--dense-batch", help="Tokens per iteration "
                                    "(multiple of 128) or 'auto'."),
    time_limit: float | None = typer.Option(None, "--time-limit", help="Solver work for the "
                                            "whole search in CP-SAT deterministic seconds "
                                            "(about a second each on an idle core; the same "
                                            "work gives the same schedules and verdict on any "
                                            "machine; default 120 for every batch shape, 20 "
                                            "with --buckets dense)."),
    buckets: str = typer.Option("all", "--buckets", help="'all': an entry for every batch "
                                "shape the engine runs (D decode of T rows, multiples of 128 "
                                "up to the dense batch), so ramp and tail batches have one "
                                "too; 'dense': only the steady state's full batch."),
    min_gain: float | None = typer.Option(None, "--min-gain", help="Keep a pipeline only where "
                                          "it predicts at least this gain over Sequential "
                                          "(default 1.05); elsewhere the set says sequential."),
    workers: int = typer.Option(2, "--workers", help="CP-SAT worker threads."),
    max_nano_ops: int = typer.Option(4, "--max-nano-ops", help="Most nano-ops per op."),
    max_period_us: float | None = typer.Option(None, "--max-period-us", help="Refuse layer "
                                               "periods above this."),
    out: str | None = typer.Option(None, "--out", "-o", help="Schedule file to write."),
    allow_unsettled: bool = typer.Option(
        False, "--allow-unsettled", help="Search on a profile whose co-run pairs were timed in "
        "bursts, before the SM clock settled under the power cap (refused by default: its "
        "R->P points overstate overlap)."),
    allow_rs_ag: bool = typer.Option(
        False, "--allow-rs-ag", help="At tp > 1 let the search choose reduce-scatter + "
        "all-gather for an all-reduce (the runtime replays all-reduce only: bench and serve "
        "refuse such a set; for studying the search)."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="KV cache the schedule "
                                       "will run on: picks (or checks) a profile measured on "
                                       "it ('auto' = the model's dtype, 'fp8')."),
    quantization: str = typer.Option("none", "--quantization", help="Layer weights the "
                                     "schedule will run on: picks (or checks) a profile "
                                     "measured on them ('none', or 'fp8': W8A8, `nanosched "
                                     "profile --quantization fp8`); without one, a synthetic "
                                     "profile of FP8 GEMMs."),
) -> None:
    """Search nano-batch pipelines (two-stage CP-SAT) and write them as a schedule set.

    Each batch shape (D decode rows of T rows) gets an entry: a searched pipeline where it
    predicts at least --min-gain over Sequential, else 'sequential' with the reason (a bound
    shows no schedule can gain there, or the best one found does not). The pipeline table is
    the steady state's: stream, issue order (#), layer offset k (the nano-op of layer l - k is
    issued in period l), tokens, predicted start and duration, share R of the GPU and the
    performance P it keeps there, the allocation (mechanism:SMs or CTAs) and dependencies.
    Ctrl-C or SIGTERM stops the search and writes nothing (exit 130)."""
    from nanosched.autosearch.command import search_command
    from nanosched.autosearch.request import SearchRequest

    req = SearchRequest(model=model, tp=tp, profile=profile,
                        gpu=default_gpu(gpu, assume=False), workload=workload,
                        input_len=input_len, output_len=output_len, dense_batch=dense_batch,
                        time_limit=time_limit, workers=workers, max_nano_ops=max_nano_ops,
                        max_period_us=max_period_us, out=out,
                        command=" ".join(["nanosched", *sys.argv[1:]]),
                        allow_unsettled=allow_unsettled, allow_rs_ag=allow_rs_ag,
                        kv_dtype=kv_cache_dtype, buckets=buckets, min_gain=min_gain,
                        quantization=quantization)
    try:
        with sigterm_as_interrupt():
            done = search_command(req, typer.echo)
    except KeyboardInterrupt:
        typer.echo("search interrupted: no schedule written (an earlier file is untouched)",
                   err=True)
        raise typer.Exit(code=130) from None
    print_search_report(done.sset, dense_only=done.dense_only, synthetic=done.synthetic)
    typer.echo(f"schedule set written to {done.path}")
    for line in verdict_lines(done.sset, done.path, done.what, done.work, done.wall_s,
                              done.synthetic):
        typer.echo(line)


def verify(
    file: str = typer.Argument(..., help="Schedule set written by `nanosched search`."),
    out: str = typer.Option(..., "--out", "-o", help="Verified set to write (may be FILE)."),
    device: str = typer.Option("auto", "--device", help="auto, cuda or cpu (cpu: a dry run "
                               "of the logic; its times mean nothing)."),
    settle: float = typer.Option(1.0, "--settle", help="Seconds each strategy replays untimed "
                                 "first, so the SM clock settles under the power cap."),
    window: float = typer.Option(2.0, "--window", help="Seconds each strategy is timed."),
    rounds: int = typer.Option(3, "--rounds", help="Times Sequential and the pipeline "
                               "alternate (the median of each is kept)."),
) -> None:
    """Time each pipeline of a schedule set against Sequential on this GPU (CUDA graphs, the
    clock settled under the power cap) and write the set with every pipeline that does not
    reach the set's --min-gain made sequential; each checked entry records the times, SM clock
    and board power. The table sets each measured time beside its prediction (at the context
    the key was searched at: a key timed at a shorter one, where its decode rows do not fit,
    says so in the context column)."""
    from nanosched.benchmarks.verify import VerifyConfig, run_verify

    _, rows = run_verify(file, out, device, VerifyConfig(settle, window, rounds), typer.echo)
    if rows:
        print_table(rows, VERIFY_COLUMNS)
    typer.echo(f"verified set written to {out}")


def show(
    file: str = typer.Argument(..., help="Schedule JSON written by `nanosched search` (a set, "
                               "or a single schedule)."),
    key: str | None = typer.Option(None, "--key", help="D,T: show the pipeline of that entry "
                                   "of a set (default: the table of every entry)."),
    plot: str | None = typer.Option(None, "--plot", help=literal(
        "Also draw a Gantt chart to this .png, .svg or .pdf (needs the [plot] extra: "
        "matplotlib) of the entry --key names, else of the steady state's.")),
) -> None:
    """Print a schedule set's entries (batch shape, decision, predicted gain), or one entry's
    pipeline and prediction; optionally draw a pipeline per stream."""
    from nanosched.fileio import PLOT_SUFFIXES, check_input_file, check_output_file
    from nanosched.schedules.sets import (
        SINGLE_FORMAT,
        entry_schedule,
        load_schedule_set,
        not_run_note,
    )
    from nanosched.schedules.show import (
        PIPELINE_COLUMNS,
        SET_COLUMNS,
        pipeline_rows,
        plot_gantt,
        set_rows,
        set_summary_lines,
        summary_lines,
    )

    check_input_file(file, "schedule")
    if plot:
        check_output_file(plot, "--plot", PLOT_SUFFIXES)
        require_matplotlib()
    sset = load_schedule_set(file)
    if key is not None or sset.source_format == SINGLE_FORMAT:
        sched = entry_schedule(sset, key)
        print_table(pipeline_rows(sched), PIPELINE_COLUMNS)
        for line in summary_lines(sched):
            typer.echo(line)
        if note := not_run_note(sset, key):
            typer.echo(note)
    else:
        print_table(set_rows(sset), SET_COLUMNS)
        for line in set_summary_lines(sset):
            typer.echo(line)
    if plot:
        sched = entry_schedule(sset, key)
        note = not_run_note(sset, key)
        plot_gantt(sched, plot, note)
        typer.echo(f"chart written to {plot}" + (" (a pipeline the set does not run: its "
                                                 "title says so)" if note else ""))
