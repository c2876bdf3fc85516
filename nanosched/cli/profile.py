"""`nanosched profile` and its subcommands: measure a GPU's kernels alone and in pairs (the
group's own callback), `show` a profile, add its `forward` table, `rederive` its R->P tables."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from nanosched.cli.common import (
    gpu_index,
    literal,
    reports_errors,
    require_matplotlib,
    sigterm_as_interrupt,
)
from nanosched.cli.options import (
    MeanInputLen,
    MeanOutputLen,
    NoProgress,
    ProfileOut,
    WorkloadName,
    model_option,
)
from nanosched.errors import ConfigError

EXIT_TIME_LIMIT = 75  # EX_TEMPFAIL: not done, run again with --resume

profile_app = typer.Typer(
    help="Measure this GPU's kernels and their interference (`nanosched profile --gpu 0 "
    "--model llama3-8b`), or show a profile (`nanosched profile show FILE`).",
    no_args_is_help=False, add_completion=False, pretty_exceptions_enable=False)


@profile_app.callback(invoke_without_command=True)
@reports_errors
def profile(
    ctx: typer.Context,
    gpu: str = typer.Option("0", "--gpu", help="GPU to measure: a CUDA device index, or a "
                            "GPU name (h100, h200, ...: the first such GPU here)."),
    model: str | None = model_option("Model name or HF config.", default=None),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree: kernels are measured at "
                           "tp-sharded shapes; network rows on min(tp, visible GPUs)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Profile file to write "
                                    "(default profile-MODEL-tpN.json)."),
    quick: bool = typer.Option(False, "--quick", help="Coarse grid: fewer SM partitions, "
                               "implementations, contexts and pairs (about 2 minutes)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT.partial.json."),
    time_limit: float | None = typer.Option(None, "--time-limit", help="Seconds this command "
                                            "may run: it stops before the next piece that "
                                            "would end later, saves OUT.partial.json and exits "
                                            "75; --resume goes on (a full grid in parts)."),
    dense_batch: int | None = typer.Option(None, "--dense-batch", help="Largest token count "
                                           "(default: what fits, capped at 2048)."),
    input_len: MeanInputLen = None,
    output_len: MeanOutputLen = None,
    workload: WorkloadName = None,
    no_progress: NoProgress = False,
    fake_gpu: bool = typer.Option(False, "--fake-gpu", help="Dry run on a simulated GPU "
                                  "(deterministic numbers, no CUDA needed)."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="KV cache the attention "
                                       "and rope_append rows run on: 'auto' (the model's dtype) "
                                       "or 'fp8'. A schedule searched on the profile runs only "
                                       "on that cache (serve/bench --kv-cache-dtype)."),
    quantization: str = typer.Option("none", "--quantization", help="Layer weights the GEMM "
                                     "rows and co-run pairs run on: 'none' (the model dtype) "
                                     "or 'fp8' (W8A8: e4m3 weights with a scale per output "
                                     "row, e4m3 inputs with one per token; `o` timed with the "
                                     "kernel that quantises its input). A schedule searched "
                                     "on the profile runs only on those weights "
                                     "(serve/bench --quantization)."),
    frontend: str | None = typer.Option(None, "--frontend", help="FILE.py:FUNCTION: measure "
                                        "the ops of the frontend model FUNCTION(device) builds "
                                        "(an unmodified torch model partitioned by rules, "
                                        "docs/usage.md) instead of a named model's; --model "
                                        "names it (default: FUNCTION)."),
) -> None:
    """Profile kernels alone and in pairs on a GPU and write the profile (nanosched.profile/1).

    Measures ceilings, then every op of the model's layer at 128..dense-batch tokens on every
    SM partition and implementation, then compute x memory (and x network, tp > 1) pairs, and
    derives the R->P tables. Ctrl-C leaves OUT.partial.json; --resume continues it. With
    --time-limit each call measures what fits and the call that finishes writes OUT.
    """
    if ctx.invoked_subcommand is not None:
        return
    started = time.monotonic()  # --time-limit counts from here
    from nanosched.profiler.command import ProfileConfig, profile_gpu
    from nanosched.profiler.runner import ProfileInterrupted, ProfileStopped
    from nanosched.workloads import resolve_workload

    index, spec, registry = gpu_index(gpu, fake_gpu), None, None
    if frontend is not None:
        from nanosched.frontend.profiling import FrontendImpls, load_frontend, model_spec

        if not fake_gpu:  # the model is built on the GPU: say it is missing before that
            from nanosched.profiler.gpu_backend import check_device

            check_device(index)
        fm = load_frontend(frontend, "cpu" if fake_gpu else f"cuda:{index}")
        model = model or frontend.rpartition(":")[2]
        spec, registry = model_spec(fm, model), FrontendImpls(fm)
    if model is None:
        raise ConfigError("nanosched profile needs --model (e.g. --model llama3-8b) or "
                          "--frontend FILE.py:FUNCTION")
    cfg = ProfileConfig(index, model, tp, resolve_workload(workload, input_len, output_len),
                        out, quick, resume, dense_batch, not no_progress, fake_gpu,
                        kv_dtype=kv_cache_dtype, quantization=quantization, spec=spec,
                        registry=registry,
                        time_limit=time_limit, started=started)
    try:
        with sigterm_as_interrupt():
            profile_gpu(cfg, log=typer.echo)
    except ProfileInterrupted as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(code=130) from None
    except ProfileStopped as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(code=EXIT_TIME_LIMIT) from None


def named_profile(file: Path) -> Path:
    """A profile FILE, or the name of a shipped one (as `search --profile NAME` takes it)."""
    from nanosched.profiler.catalog import shipped_profiles

    if file.exists() or file.suffix == ".json" or len(file.parts) != 1:
        return file
    names = shipped_profiles()
    if str(file) not in names:
        raise ConfigError(f"profile {file}: neither a file nor a shipped profile; shipped: "
                          f"{', '.join(names) or 'none'}")
    return names[str(file)]


@profile_app.command("show")
@reports_errors
def profile_show(
    file: Path = typer.Argument(..., help="Profile JSON to show, or a shipped profile's name "
                                "(as search --profile takes it)."),
    plot: Path | None = typer.Option(None, "--plot", help=literal(
        "Also write R->P curves and kernel time vs SMs to this .png, .svg or .pdf (needs the "
        "[plot] extra: matplotlib).")),
) -> None:
    """Print a profile's ceilings, kernel tables, R->P tables and notes."""
    from nanosched.fileio import PLOT_SUFFIXES, check_input_file, check_output_file
    from nanosched.profiler.format import load_profile
    from nanosched.profiler.show import plot_profile, show_profile

    file = named_profile(file)
    check_input_file(file, "profile")
    if plot is not None:
        check_output_file(plot, "--plot", PLOT_SUFFIXES)
        require_matplotlib()
    prof = load_profile(file)
    show_profile(prof, echo=typer.echo)
    if plot is not None:
        typer.echo(f"wrote {plot_profile(prof, plot)}")


@profile_app.command("forward")
@reports_errors
def profile_forward(
    file: Path = typer.Argument(..., help="Profile JSON (or a shipped profile's name) to "
                                "measure the forward table of."),
    gpu: str = typer.Option("0", "--gpu", help="The GPU the profile was measured on: a CUDA "
                            "device index, or a GPU name (the first such GPU here)."),
    out: ProfileOut = None,
    input_len: float | None = typer.Option(None, "--input-len", help="Mean prompt tokens p "
                                           "the profile was measured for (default 1024)."),
    output_len: float | None = typer.Option(None, "--output-len", help="Mean output tokens d "
                                            "(default 512)."),
    workload: WorkloadName = None,
    no_progress: NoProgress = False,
    fake_gpu: bool = typer.Option(False, "--fake-gpu", help="Dry run on a simulated GPU."),
) -> None:
    """Measure the forward table of a finished profile (a few seconds) and add it.

    A Sequential layer of the profile's fastest kernels on all SMs is looped at the workload's
    mix at half the dense batch and at the dense batch, and decode only at a quarter of it (the
    tail of a run), until the SM clock settles under the power cap, and each op's time inside
    it is set beside its row. The search multiplies a
    row by that factor for an op alone on the whole GPU inside a forward. `nanosched profile`
    measures the table itself; this adds it to a profile taken before it did. Sets searched on
    the old file name its digest: search them again."""
    from nanosched.fileio import in_package
    from nanosched.profiler.command import add_forward
    from nanosched.workloads import resolve_workload

    file = named_profile(file)
    if out is None and in_package(file):
        raise ConfigError(f"profile {file} is shipped in the installed nanosched package; "
                          f"pass --out to write it with its forward table (--out {file} to "
                          f"replace the shipped file)")

    add_forward(file, gpu_index(gpu, fake_gpu), resolve_workload(workload, input_len, output_len),
                out, fake_gpu, not no_progress, log=typer.echo)


@profile_app.command("rederive")
@reports_errors
def profile_rederive(
    file: Path = typer.Argument(..., help="Profile JSON (or a shipped profile's name) to "
                                "derive again."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Profile to write (default: "
                                    "FILE's name with .rederived.json, beside FILE, or in the "
                                    "current folder for a profile shipped in the package; "
                                    "FILE itself only when named here)."),
) -> None:
    """Derive a profile's R->P tables again from its measured pairs and kernel rows (no GPU).

    R->P points give each kernel's P against the profile's own row of that kernel alone, so
    that the search's row / P is the time the kernel took in the pair. Profiles taken before
    this rule gave P against the pair's own alone time, which for a GEMM under the power cap is
    12-15% slower than its row: their pipelines were predicted that much too fast."""
    from nanosched.fileio import check_input_file, check_output_file, in_package
    from nanosched.profiler.build import rederive_rp
    from nanosched.profiler.format import load_profile, save_profile

    file = named_profile(file)
    check_input_file(file, "profile")
    name = f"{file.name.removesuffix('.json')}.rederived.json"
    target = out or (Path(name) if in_package(file) else file.with_name(name))
    if out is None and in_package(target):
        raise ConfigError(f"{target} would be inside the installed nanosched package: run "
                          f"from another folder or pass --out")
    check_output_file(target, "--out")
    prof = load_profile(file)
    fresh = rederive_rp(prof)
    save_profile(fresh, target)
    typer.echo(f"R->P tables derived again from {len(prof.pairs)} pairs "
               f"({'changed' if fresh != prof else 'unchanged'}); wrote {target}")
