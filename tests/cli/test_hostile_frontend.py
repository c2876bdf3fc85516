"""`profile --frontend FILE:FUNCTION` under hostile or mistaken user code (issue 45): a FILE
that is not Python, an exception or `sys.exit` while FILE is imported or FUNCTION runs, a model
whose attention is not routed through the frontend, and no GPU. Each is one `error:` line, exit
2, naming the flag and what the user's code did (exit 1 is kept for nanosched's own bugs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile import refused
from repo import DATA

GPT2 = (DATA / "frontend_gpt2.py").read_text()


def profile(target: str, *flags: str) -> list[str]:
    return ["profile", "--frontend", target, "--quick", *flags]


def user_file(tmp_path: Path, text: str, name: str = "fe.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return f"{path}:build"


def test_a_file_that_is_not_python_is_named(tmp_path):
    target = user_file(tmp_path, GPT2, "fe.txt")
    refused(profile(target, "--fake-gpu"), "--frontend", "fe.txt is not a Python file")


@pytest.mark.parametrize("text, needles", [
    ("raise ValueError('bad config')\n",
     ["importing", "raised ValueError: bad config", "line 1", "build function"]),
    ("def build(device):\n    return {}['missing']\n",
     ["build(device) raised KeyError", "line 2", "not of nanosched"]),
    ("import sys\nsys.exit(0)\n", ["importing", "called sys.exit(0)"]),
    ("import sys\ndef build(device):\n    sys.exit(3)\n", ["build(device) called sys.exit(3)"]),
], ids=["raise-at-import", "raise-in-function", "exit-at-import", "exit-in-function"])
def test_the_users_code_failing_is_said_to_be_the_users(tmp_path, text, needles):
    out = tmp_path / "p.json"
    refused(profile(user_file(tmp_path, text), "--fake-gpu", "--out", str(out)), "--frontend",
            *needles)
    assert not out.exists() and not list(tmp_path.glob("*.partial.json"))


def test_a_model_without_use_nanosched_is_told_what_is_missing(tmp_path):
    text = GPT2.replace("    use_nanosched(model)\n", "")
    assert text != GPT2
    refused(profile(user_file(tmp_path, text), "--fake-gpu"), "calls no frontend attention",
            "use_nanosched(model)")


def test_no_such_gpu_is_said_before_the_model_is_built(tmp_path):
    marker = tmp_path / "built"
    text = f"def build(device):\n    open({str(marker)!r}, 'w').close()\n"
    refused(profile(user_file(tmp_path, text), "--gpu", "99"), "--gpu 99: no such CUDA device")
    assert not marker.exists()
