"""Paths a user can type: folders where files are expected, missing folders and wrong suffixes
for --plot, matplotlib missing, files written with the user's umask, strict JSON. Each ends in
one `error: ...` line (exit 2) or works, never in a traceback."""

import json
import os
import sys

import pytest
from repo import DATA, PROFILES
from typer.testing import CliRunner

from nanosched.cli import app
from nanosched.fileio import finite_json, write_json_atomic

PROFILE = str(PROFILES / "llama3-8b-tp1-h200.json")
SCHEDULE = str(DATA / "llama3-8b-tp1-h200-b2048-single.json")


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def no_traceback(r):
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.output


@pytest.mark.parametrize("cmd", [["show"], ["profile", "show"]])
def test_a_folder_or_a_missing_file_is_refused_in_one_line(cmd, tmp_path):
    r = run(*cmd, tmp_path)
    no_traceback(r)
    assert r.exit_code == 2 and "is a folder, expected a file" in r.output
    r = run(*cmd, tmp_path / "nothing.json")
    no_traceback(r)
    assert r.exit_code == 2 and "does not exist" in r.output


@pytest.mark.parametrize("cmd, path", [(["show"], SCHEDULE), (["profile", "show"], PROFILE)])
def test_plot_suffix_and_folder_are_checked_before_the_table(cmd, path, tmp_path):
    r = run(*cmd, path, "--plot", tmp_path / "chart.txt")
    no_traceback(r)
    assert r.exit_code == 2 and "--plot" in r.output and ".png" in r.output
    assert r.output.count("\n") == 1  # refused before the table is printed
    r = run(*cmd, path, "--plot", tmp_path)
    assert r.exit_code == 2 and "is a folder" in r.output


def test_plot_into_a_missing_folder_creates_it(tmp_path):
    out = tmp_path / "new" / "deeper" / "gantt.png"
    r = run("show", SCHEDULE, "--plot", out)
    no_traceback(r)
    assert r.exit_code == 0, r.output
    assert out.stat().st_size > 0


@pytest.mark.parametrize("cmd, path", [(["show"], SCHEDULE), (["profile", "show"], PROFILE)])
def test_plot_without_matplotlib_names_the_extra(cmd, path, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    r = run(*cmd, path, "--plot", tmp_path / "p.png")
    no_traceback(r)
    assert r.exit_code == 2 and ".[plot]" in r.output
    assert not (tmp_path / "p.png").exists()


def test_json_files_get_the_users_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "a.json", {"x": 1})
        os.umask(0o077)
        write_json_atomic(tmp_path / "b.json", {"x": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o600


def test_json_output_onto_a_folder_is_refused(tmp_path):
    from nanosched.errors import ConfigError

    with pytest.raises(ConfigError, match="is a folder"):
        write_json_atomic(tmp_path, {"x": 1})
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        write_json_atomic(tmp_path / "file" / "x.json", {"x": 1})


def test_finite_json_is_strict():
    data = finite_json({"a": float("inf"), "b": [float("nan"), 1.5], "c": (2, -float("inf"))})
    assert data == {"a": None, "b": [None, 1.5], "c": [2, None]}
    json.dumps(data, allow_nan=False)


def test_bench_json_into_a_folder_is_refused_before_any_work(tmp_path):
    r = run("bench", "--model", "smollm2-135m", "--input-len", "4", "--output-len", "2",
            "--num-prompts", "1", "--json", tmp_path)
    no_traceback(r)
    assert r.exit_code == 2 and "--json" in r.output and "is a folder" in r.output
