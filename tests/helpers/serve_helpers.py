"""Test helpers for `nanosched serve`: a tiny random Llama folder, an in-thread server, and a
gate that holds its engine between two steps."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

from repo import DATA

from nanosched.runtime.config import EngineConfig
from nanosched.runtime.server.lifecycle import bind_port, build_server
from nanosched.runtime.server.startup import ServeConfig


def tiny_folder(root: Path, tokenizer: bool = True) -> Path:
    """config.json of tests/data (no safetensors: random weights) and a word tokenizer
    (w0..w99, one word per token id) without a chat template."""
    folder = root / "tiny"
    folder.mkdir(exist_ok=True)
    shutil.copy(DATA / "tiny_llama_config.json", folder / "config.json")
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        raw = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(folder)
    return folder


class ThreadServer:
    """`nanosched serve` in a background thread on a free loopback port."""

    def __init__(self, **kw) -> None:
        server_keys = {"host", "port", "max_queue", "drain_timeout_s", "max_request_bytes",
                       "api_key", "served_model_name", "stats_interval_s", "header_timeout_s",
                       "body_timeout_s", "max_connections"}
        engine = EngineConfig(device="cpu", schedule="auto", graphs="auto",
                              **{k: v for k, v in kw.items() if k not in server_keys})
        self.server = build_server(ServeConfig(engine, **{k: v for k, v in kw.items()
                                                          if k in server_keys}))
        self.worker = self.server.nanosched_worker
        self.model = self.server.nanosched_name  # the id requests name
        # bound as `nanosched serve` binds (bind_port): a TCP socket, so that asyncio sets
        # TCP_NODELAY on its connections (a protocol-0 socket kept Nagle on: every response
        # whose headers and body went out in two writes waited 40 ms for the delayed ACK)
        sock = bind_port("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start in 30 s"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


class EngineGate:
    """Holds a server's engine thread before its step after `after` steps, until `release()`:
    the requests admitted so far keep their KV pages, and new ones wait, while a test reads
    the server's state. A context manager that releases on exit."""

    def __init__(self, engine, after: int = 1) -> None:
        self.engine, self.after, self.num_steps = engine, after, 0
        self.held, self._go = threading.Event(), threading.Event()
        self._step = engine.step
        engine.step = self._gated

    def _gated(self):
        if self.num_steps == self.after:
            self.held.set()
            self._go.wait(60)
        self.num_steps += 1
        return self._step()

    def wait_held(self, timeout_s: float = 30.0) -> None:
        assert self.held.wait(timeout_s), f"the engine did not reach step {self.after + 1}"

    def release(self) -> None:
        self._go.set()
        self.engine.step = self._step

    def __enter__(self) -> EngineGate:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def metrics(client, url: str) -> dict[str, float]:
    """/metrics as {name: value}."""
    text = client.get(f"{url}/metrics").text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines()
                                     if line and not line.startswith("#"))}


def server_fixtures(name: str, timeout: float):
    """The module-scoped fixtures a server test file binds as `folder, srv, http =
    server_fixtures(...)`: a tiny random Llama folder, a ThreadServer on it (dense batch 64,
    queue 512), an httpx client with `timeout`."""
    import httpx
    import pytest

    @pytest.fixture(scope="module")
    def folder(tmp_path_factory):
        return tiny_folder(tmp_path_factory.mktemp(name))

    @pytest.fixture(scope="module")
    def srv(folder):
        s = ThreadServer(model=str(folder), dense_batch=64, max_queue=512)
        yield s
        s.close()

    @pytest.fixture(scope="module")
    def http():
        with httpx.Client(timeout=timeout) as c:
            yield c

    return folder, srv, http


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(*flags: str, model: str = str(DATA / "tiny_llama_config.json")):
    """`nanosched serve --model MODEL FLAGS` as a process on a free loopback port (CPU, dense
    batch 16), once /health answers: (Popen with stdout+stderr piped as text, base URL)."""
    import os
    import subprocess
    import sys

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"PYTHONPATH": str(DATA.parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "nanosched.cli", "serve", "--model", model,
                             "--port", str(port), "--device", "cpu", "--dense-batch", "16",
                             *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_healthy(proc, url, 60, lambda: proc.communicate()[0], poll_s=0.1)
    return proc, url


def wait_healthy(proc, url: str, timeout_s: float, output, poll_s: float = 0.2) -> None:
    """Return once `url`/health answers 200; if the server process ends or `timeout_s` passes
    first, kill it and fail with its output (`output()`: the text it wrote)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not start: {output()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(poll_s)
