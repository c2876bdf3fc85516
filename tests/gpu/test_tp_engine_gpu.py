"""One engine on two GPUs (NCCL): CUDA graphs per bucket on both ranks give the tokens of the
same buckets run eagerly, with preemption by swap and an FP8 KV cache; `bench --tp 2` replays
graphs on both ranks; `serve --tp 2` answers, drains on SIGTERM and ends non-zero within 10 s
when a worker is killed while rank 0 waits in NCCL.

Run on a machine with two or more GPUs: `PYTHONPATH=. python -m pytest -m gpu
tests/gpu/test_tp_engine_gpu.py` (a 2-layer model of Llama-3-8B's shapes, random weights).
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
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from repo import ROOT

from nanosched.models.spec import REGISTRY, load_spec
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.loader import build_engine, load_model, named_choice
from nanosched.runtime.preempt import AdmissionConfig
from nanosched.runtime.ranks.group import start_ranks
from nanosched.runtime.requests import Request, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """config.json of Llama-3-8B with 2 layers (random weights)."""
    path = tmp_path_factory.mktemp("m") / "llama3-8b-2l"
    path.mkdir()
    spec = REGISTRY["llama3-8b"]
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": spec.hidden_size,
        "num_hidden_layers": 2, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size, "max_position_embeddings": 4096,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu"}))
    return str(path)


def requests() -> list[Request]:
    g = torch.Generator().manual_seed(0)
    return [Request(i, torch.randint(0, 128000, (int(n),), generator=g).tolist(),
                    SamplingParams(max_tokens=48, ignore_eos=True))
            for i, n in enumerate(torch.randint(200, 900, (48,), generator=g))]


def serve(model, cfg, group) -> tuple[list[list[int]], dict]:
    reqs = requests()
    choice = named_choice("sequential", None, model.spec, model.device)
    with build_engine(model, cfg, choice, requests=reqs, ranks=group) as loaded:
        eng = loaded.engine
        for r in reqs:
            eng.add_request(r)
        with torch.inference_mode():
            eng.run_to_completion()
        torch.cuda.synchronize()
        graphs = eng.stats.graphs.as_dict()
        return [r.output_ids for r in reqs], graphs | eng.batcher.report()["preemptions"]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_tp2_graphs_replay_what_the_same_buckets_compute_eagerly(folder, kv_dtype):
    base = EngineConfig(model=folder, device="cuda", tp=2, dense_batch=512, num_pages=600,
                        kv_dtype=kv_dtype, max_context=1024, eos_ids=frozenset(),
                        admission=AdmissionConfig(preemption="swap"))
    cuda0 = torch.device("cuda", 0)
    with start_ranks(base, "random", cuda0) as group:
        model = load_model(load_spec(folder), "random", cuda0, 0, group.tp)
        eager, e_stats = serve(model, replace(base, graphs="layout"), group)
        graphed, g_stats = serve(model, replace(base, graphs="on"), group)
    assert g_stats["replays"] > 20 and g_stats["captures"] > 0
    assert e_stats["swapped"] > 0 and g_stats["swapped"] == e_stats["swapped"]
    assert graphed == eager


def test_bench_tp2_replays_graphs_on_both_ranks(folder, tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "nanosched.cli", "bench", "--model", folder,
                        "--tp", "2", "--input-len", "512", "--output-len", "64",
                        "--num-prompts", "64", "--graphs", "on", "--json", str(out)],
                       env=os.environ | {"PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(out.read_text())["runs"]["sequential+graphs"]
    assert run["graph_stats"]["replays"] > 0 and not run["graph_errors"]
    assert run["results"]["percent_of_optimal"] > 0
    assert run["tp_messages"]["steps"] == run["iterations"]


def start(folder: str, log: Path) -> tuple[subprocess.Popen, str, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nanosched.cli", "serve", "--model", folder,
                             "--tp", "2", "--port", str(port), "--dense-batch", "512"],
                            env=os.environ | {"PYTHONPATH": str(ROOT)}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)
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
