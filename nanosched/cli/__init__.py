"""The `nanosched` command line: each command parses flags into a config and calls one function.

`app` is assembled here from one module per command group (models, generate, bench, search,
serve, profile); shared flags live in `options`, what every command shares (errors as
`error: ...` with exit code 2, the default GPU) in `common`, tables and reports in `report`.
`main` is the console-script entry point; `python -m nanosched.cli` runs it too.
"""

from __future__ import annotations

import signal
import sys

import typer

from nanosched.cli import bench, generate, models, search, serve
from nanosched.cli.common import reports_errors, unwrap_help
from nanosched.cli.profile import profile_app

app = typer.Typer(
    name="nanosched",
    help=(
        "Find and run nano-batch pipelines for LLM inference: profile a GPU's kernels and their "
        "interference, search the pipeline with OR-Tools, and replay it when serving.\n\n"
        "Start where the README does: `nanosched search --model llama3-70b --buckets dense` "
        "searches a pipeline from a shipped profile and says whether overlap pays; "
        "`nanosched analyze --model llama3-70b --gpu h100 --tp 8` shows where an iteration's "
        "time goes."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from nanosched import __version__

        typer.echo(f"nanosched {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Find and run nano-batch pipelines for LLM inference."""


# the order of `nanosched --help`
for command in (models.models, models.analyze, generate.generate, bench.bench, search.search,
                search.verify, search.show, serve.serve):
    app.command()(reports_errors(command))
app.add_typer(profile_app, name="profile")
unwrap_help(app)


def main() -> None:
    """Console-script entry point. Once the command has decided its exit code, a Ctrl-C no
    longer changes it (SIGINT is ignored while the process winds down); a Ctrl-C that reaches
    here unhandled ends with exit 130, not a death by SIGINT (-2)."""
    try:
        app(prog_name="nanosched")
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.exit(130)
    except SystemExit:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise
