"""`bench --tp 2` and `serve --tp 2` on the CPU (gloo): the bench's per-GPU figures and a
replayed schedule set; the server answers the `openai` client streamed and not with the tokens
of tp = 1, drains every rank on SIGTERM, and ends non-zero within seconds, naming the rank, when
a worker is killed (no process left behind), once its open requests got an error."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from hf_models import make_hf
from repo import DATA, ROOT
from serve_helpers import metrics, tiny_folder, wait_healthy
from typer.testing import CliRunner

from nanosched.cli import app

pytestmark = pytest.mark.slow
WORKER_PIDS = re.compile(r"ranks 1\.\.\d+ are pids ([\d, ]+)")


def test_bench_tp2_reports_per_gpu_and_replays_a_tp2_set(tmp_path):
    folder = tmp_path / "tiny"  # the tp = 2 schedule's model is named "tiny"
    folder.mkdir()
    (folder / "config.json").write_text((DATA / "tiny_llama_config.json").read_text())
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(app, [
        "bench", "--model", str(folder), "--tp", "2", "--device", "cpu", "--input-len", "24",
        "--output-len", "8", "--num-prompts", "40", "--force", "--json", str(out),
        "--schedule", str(DATA / "tiny_llama_tp2_schedule.json")])
    assert r.exit_code == 0, r.output
    assert "tp=2" in r.output and "Total token throughput per GPU (tok/s)" in r.output
    data = json.loads(out.read_text())
    assert data["config"]["tp"] == 2 and data["environment"]["num_gpus"] == 2
    run = data["runs"]["schedule"]
    res = run["results"]
    assert res["output_tokens"] == 40 * 8
    assert res["tokens_per_s_per_gpu"] == pytest.approx(res["tokens_per_s"] / 2)
    assert run["pipelined_iterations"] > 0  # the set's pipeline ran on both ranks
    assert run["tp_messages"]["steps"] == run["iterations"] > 0
    assert run["forward_ms_full_batch"] > 0  # timed on both ranks (a Call)


def served_folder(root: Path) -> Path:
    """A tiny Llama checkpoint (so that every tp has the same weights) with a word tokenizer."""
    folder = tiny_folder(root)
    make_hf("llama", folder, seed=11, vocab_size=100, eos_token_id=None)
    return folder


def start(folder: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, str, int]:
    """`serve --tp 2` on a free port, once /health answers: (process, url, worker pid)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanosched.cli", "serve", "--model", str(folder), "--tp", "2",
         "--device", "cpu", "--dense-batch", "32", "--port", str(port), *flags],
        env=os.environ | {"PYTHONPATH": str(ROOT)}, stdout=log.open("w"),
        stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 120, log.read_text)
    pid = int(WORKER_PIDS.search(log.read_text()).group(1))
    return proc, url, pid


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except FileNotFoundError:
        return False


def test_serve_tp2_answers_openai_as_tp1_and_sigterm_drains_every_rank(tmp_path):
    import openai

    from nanosched.runtime.config import EngineConfig
    from nanosched.runtime.generate import GenerateConfig, generate

    folder = served_folder(tmp_path)
    prompt = [5, 17, 42, 8]
    want = generate(GenerateConfig(EngineConfig(model=str(folder), device="cpu"),
                                   prompt_ids=tuple(prompt), max_tokens=12)).output_ids
    log = tmp_path / "serve.log"
    proc, url, worker = start(folder, log)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                          temperature=0)
        assert whole.choices[0].token_ids == want
        assert whole.choices[0].text == " ".join(f"w{t}" for t in want)
        pieces, texts = [], []
        for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                               temperature=0, stream=True):
            pieces += chunk.choices[0].token_ids
            texts.append(chunk.choices[0].text)
        assert pieces == want and " ".join(t.strip() for t in texts if t.strip()) == \
            whole.choices[0].text
        # SIGTERM while a long stream is open: it finishes on both ranks, then all exit
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 200, "stream": True,
                "ignore_eos": True, "temperature": 0}
        ids, reason = [], None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    if not ids:
                        proc.send_signal(signal.SIGTERM)
                    ids += choice["token_ids"]
                    reason = choice["finish_reason"] or reason
        assert len(ids) == 200 and reason == "length"
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not alive(worker), log.read_text()
    assert "error" not in log.read_text().lower(), log.read_text()


def test_a_killed_worker_ends_the_server_non_zero_within_10_s(tmp_path):
    folder = served_folder(tmp_path)
    log = tmp_path / "serve.log"
    proc, url, worker = start(folder, log)
    try:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 200, "stream": True,
                "ignore_eos": True}
        t0 = None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):  # it runs on both ranks: kill the worker
                    os.kill(worker, signal.SIGKILL)
                    t0 = time.monotonic()
                    break
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code != 0 and took <= 10, (code, took, text)
    assert f"error: tensor-parallel rank 1 (pid {worker}) was killed by SIGKILL" in text, text
    assert not alive(worker)


def test_a_killed_worker_ends_open_requests_with_an_error_before_the_server_exits(tmp_path):
    """Issue 45: when a rank dies, an open stream ends with an error event in OpenAI's shape
    and [DONE], not cut, and a whole request gets a 500 with an error body."""
    folder = served_folder(tmp_path)
    log = tmp_path / "serve.log"
    proc, url, worker = start(folder, log)
    whole = {}
    try:
        long = {"model": "tiny", "prompt": [4, 5], "max_tokens": 250, "ignore_eos": True}
        t = threading.Thread(target=lambda: whole.update(r=httpx.post(
            f"{url}/v1/completions", json=long, timeout=60)))
        t.start()
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=10) as c:
            while metrics(c, url)["nanosched_requests_running"] < 1:
                assert time.monotonic() < deadline and "r" not in whole, whole["r"].text
                time.sleep(0.02)
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 200, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        os.kill(worker, signal.SIGKILL)
        t.join(60)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code != 0, text
    assert events[-1] == "[DONE]", (events[-3:], text)
    err = json.loads(events[-2])["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert f"tensor-parallel rank 1 (pid {worker}) was killed by SIGKILL" in err["message"]
    r = whole["r"]
    assert r.status_code == 500, r.text
    assert "tensor-parallel rank 1" in r.json()["error"]["message"]
    assert not alive(worker)
