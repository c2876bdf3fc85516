"""Helpers of the hostile-input suites: run a real CLI command on a file a user handed in and
require the refusal the issue asks for (exit 2, one `error:` line naming the file and the
field, no traceback)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from nanosched.cli import app

RUNNER = CliRunner()


def refused(args: list[str], *needles: str) -> str:
    """Run `nanosched ARGS`; assert exit 2 with one `error:` line holding every needle."""
    r = RUNNER.invoke(app, args)
    out = r.output
    assert "Traceback" not in out, out
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2, (r.exit_code, out)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def mutated(base: dict[str, Any], mutate: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    data = copy.deepcopy(base)
    mutate(data)
    return data


def write(path: Path, data: Any) -> Path:
    """JSON as Python writes it: Infinity and NaN included, as a hand-edited file may hold."""
    path.write_text(json.dumps(data))
    return path
