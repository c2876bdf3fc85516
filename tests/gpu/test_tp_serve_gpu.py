"""`serve --tp 2` on two GPUs (NCCL): a stream finishes when SIGTERM drains every rank, and the
server ends non-zero within 10 s, naming the rank, when a worker is killed while rank 0 waits in
NCCL.

The GPU image has no fastapi / uvicorn / httpx: carry their wheels and run it through
`bench/engine/tp_run.sh tests` (the server inherits this process's PYTHONPATH).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from repo import ROOT
from runtime_helpers import llama3_8b_layers

# the server's packages first: serve_helpers imports the app, which imports fastapi
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
from serve_helpers import wait_healthy  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return llama3_8b_layers(tmp_path_factory.mktemp("m") / "llama3-8b-2l")


def start(folder: str, log: Path) -> tuple[subprocess.Popen, str, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nanosched.cli", "serve", "--model", folder,
                             "--tp", "2", "--port", str(port), "--dense-batch", "512"],
                            env=os.environ | {"PYTHONPATH": os.pathsep.join(
                                filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))},
                            stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 300, log.read_text, poll_s=0.5)
    pid = int(re.search(r"ranks 1\.\.\d+ are pids (\d+)", log.read_text()).group(1))
    return proc, url, pid


def stream(url: str, n: int, on_first=None) -> list[int]:
    body = {"model": "llama3-8b-2l", "prompt": [1, 2, 3], "max_tokens": n, "stream": True,
            "ignore_eos": True}
    ids: list[int] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if not ids and on_first is not None:
                    on_first()
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
    return ids


def test_serve_tp2_drains_on_sigterm(folder, tmp_path):
    log = tmp_path / "serve.log"
    proc, url, worker = start(folder, log)
    try:
        assert len(stream(url, 300, lambda: proc.send_signal(signal.SIGTERM))) == 300
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not Path(f"/proc/{worker}").exists() or \
        "State:\tZ" in Path(f"/proc/{worker}/status").read_text()


def test_serve_tp2_ends_within_10_s_when_a_worker_is_killed(folder, tmp_path):
    log = tmp_path / "serve.log"
    proc, url, worker = start(folder, log)
    killed: list[float] = []

    def kill() -> None:
        os.kill(worker, signal.SIGKILL)
        killed.append(time.monotonic())

    try:
        with contextlib.suppress(httpx.HTTPError):  # the server goes away mid-stream
            stream(url, 2000, kill)
        code = proc.wait(timeout=60)
        took = time.monotonic() - killed[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0 and took <= 10, (code, took, log.read_text())
    assert f"tensor-parallel rank 1 (pid {worker}) was killed by SIGKILL" in log.read_text()
