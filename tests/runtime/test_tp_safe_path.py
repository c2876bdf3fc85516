"""Issue 45: `generate`, `bench` and `serve` at `--tp 2` started from a folder holding a
`struct.py` (a marker writer standing in for the real module) import it in no process: neither
the spawned worker nor multiprocessing's resource tracker (they boot as `python -c`, which puts
the current folder first on sys.path unless PYTHONSAFEPATH is set)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serve_helpers import wait_healthy

pytestmark = pytest.mark.slow
NANOSCHED = Path(sys.executable).with_name("nanosched")  # the console script the README installs
MARKER = '''import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"imported-{os.getpid()}"),
     "w").close()
from _struct import *
from _struct import _clearcache
from _struct import __doc__
'''


def unsafe_env() -> dict[str, str]:
    """This process's environment without PYTHONSAFEPATH, which a tp command run in-process by
    an earlier test set here: the commands below must set it themselves."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}


def planted(folder: Path) -> Path:
    folder.mkdir()
    (folder / "struct.py").write_text(MARKER)
    return folder


def imported(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("imported-*"))


def test_the_planted_module_is_a_working_marker(tmp_path):
    """The check can fail: a plain `python -c` in the folder imports the planted module."""
    cwd = planted(tmp_path / "cwd")
    subprocess.run([sys.executable, "-c", "import struct; struct.pack('i', 1)"], cwd=cwd,
                   check=True, env=unsafe_env())
    assert len(imported(cwd)) == 1


@pytest.mark.parametrize("args", [
    ["generate", "--model", "stories15m", "--prompt-ids", "1,2", "--max-tokens", "2"],
    ["bench", "--model", "stories15m", "--input-len", "8", "--output-len", "2",
     "--num-prompts", "2"],
], ids=["generate", "bench"])
def test_tp_commands_import_nothing_of_the_current_folder(tmp_path, args):
    cwd = planted(tmp_path / "cwd")
    r = subprocess.run([str(NANOSCHED), *args, "--tp", "2", "--device", "cpu"], cwd=cwd,
                       capture_output=True, text=True, timeout=300, env=unsafe_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert imported(cwd) == [], r.stderr


def test_serve_tp2_imports_nothing_of_the_current_folder(tmp_path):
    cwd = planted(tmp_path / "cwd")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([str(NANOSCHED), "serve", "--model", "stories15m", "--tp", "2",
                             "--device", "cpu", "--port", str(port)], cwd=cwd,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=unsafe_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 120, log.read_text)
        body = {"model": "stories15m", "prompt": [1, 2], "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert imported(cwd) == [], log.read_text()
