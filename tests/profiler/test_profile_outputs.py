"""`nanosched profile -o`: output paths checked before any measurement, and Ctrl-C (a fake
backend's KeyboardInterrupt) ends non-zero with a message, keeps a resumable partial and leaves
an earlier output file untouched (issue 18)."""

from __future__ import annotations

import json

import pytest
from hostile import RUNNER, refused

from nanosched.cli import app
from nanosched.profiler import command
from nanosched.profiler.fake import FakeBackend

ARGS = ["profile", "--fake-gpu", "--model", "llama3-8b", "--quick", "--dense-batch", "256",
        "--no-progress"]


@pytest.fixture
def no_backend(monkeypatch):
    """Fail the test if the backend is started: a bad path must be refused before it."""
    def started(cfg):
        raise AssertionError("the backend started before the output path was checked")

    monkeypatch.setattr(command, "make_backend", started)


def test_profile_refuses_a_folder_as_out(tmp_path, no_backend):
    refused([*ARGS, "--out", str(tmp_path)], "--out", str(tmp_path), "is a folder")


def test_profile_refuses_a_missing_parent(tmp_path, no_backend):
    out = tmp_path / "nope" / "p.json"
    refused([*ARGS, "--out", str(out)], "--out", str(out), "does not exist")


def test_profile_refuses_a_file_as_parent(tmp_path, no_backend):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "p.json"
    refused([*ARGS, "--out", str(out)], "--out", str(out), "not a folder")


def test_profile_refuses_a_parent_it_cannot_write(tmp_path, no_backend):
    """/proc/1 exists and is a folder no one may create files in, root included."""
    refused([*ARGS, "--out", "/proc/1/p.json"], "--out", "/proc/1/p.json", "cannot write")


def test_ctrl_c_exits_non_zero_keeps_the_partial_and_the_earlier_file(tmp_path, monkeypatch):
    out = tmp_path / "p.json"
    earlier = '{"earlier": "profile"}\n'
    out.write_text(earlier)
    monkeypatch.setattr(command, "make_backend", lambda cfg: FakeBackend(interrupt_after=5))
    r = RUNNER.invoke(app, [*ARGS, "--out", str(out)])
    assert r.exit_code == 130, r.output
    assert "Traceback" not in r.output
    assert "interrupted:" in r.stderr and "--resume" in r.stderr
    assert out.read_text() == earlier
    partial = tmp_path / "p.partial.json"
    assert json.loads(partial.read_text())["format"] == "nanosched.profile-partial/1"
    monkeypatch.setattr(command, "make_backend", lambda cfg: FakeBackend())
    r = RUNNER.invoke(app, [*ARGS, "--out", str(out), "--resume"])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["format"] == "nanosched.profile/1"
    assert not partial.exists()


def test_ctrl_c_after_measuring_says_how_to_resume(tmp_path, monkeypatch):
    """A Ctrl-C while the profile is built from the measurements (after the last one): exit 130
    with the --resume line, every measurement in the partial, and --resume writes the profile."""
    from nanosched.profiler import runner

    out = tmp_path / "p.json"
    monkeypatch.setattr(command, "make_backend", lambda cfg: FakeBackend())
    built = runner.build_profile

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "build_profile", interrupted)
    r = RUNNER.invoke(app, [*ARGS, "--out", str(out)])
    assert r.exit_code == 130, r.output
    assert "Traceback" not in r.output and not out.exists()
    assert "interrupted after measuring:" in r.stderr and "--resume" in r.stderr
    partial = json.loads((tmp_path / "p.partial.json").read_text())
    monkeypatch.setattr(runner, "build_profile", built)
    r = RUNNER.invoke(app, [*ARGS, "--out", str(out), "--resume"])
    assert r.exit_code == 0, r.output
    assert f"{len(partial['kernels'])} kernel rows" in r.output  # nothing measured again
    assert json.loads(out.read_text())["format"] == "nanosched.profile/1"
