"""`nanosched serve` as a process: the schedule is checked before the port opens (exit 2),
`auto` picks a shipped schedule or says why not, and SIGTERM drains open requests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from repo import DATA, ROOT
from serve_helpers import wait_healthy
from typer.testing import CliRunner

from nanosched.cli import app
from nanosched.models.spec import load_spec
from nanosched.schedules.shipped import pick_shipped_schedule, shipped_schedules

CONFIG = str(DATA / "tiny_llama_config.json")
NAME = "tiny_llama_config"  # the served model id: the config file's stem


def test_a_schedule_for_another_model_stops_the_server_with_exit_2():
    sched = shipped_schedules()[0]
    r = CliRunner().invoke(app, ["serve", "--model", CONFIG, "--schedule", str(sched),
                                 "--device", "cpu", "--port", "1"])
    assert r.exit_code == 2, r.output
    assert "schedule does not match this setup: model:" in r.output
    r = CliRunner().invoke(app, ["serve", "--model", CONFIG, "--tp", "3", "--port", "0"])
    assert r.exit_code == 2 and "--tp 3 does not divide" in r.output


def test_auto_picks_a_matching_schedule_only_when_it_predicts_a_gain(tmp_path):
    import json

    spec = load_spec("llama3-8b")
    data = json.loads((DATA / "llama3-8b-tp1-h200-b2048-single.json").read_text())
    (tmp_path / "a-weak.json").write_text(json.dumps(data))
    weak = pick_shipped_schedule(spec, 1, "NVIDIA H200", tmp_path)
    assert weak.schedule is None and "a-weak.json predicts only" in weak.reason
    assert "running Sequential" in weak.reason
    pred = data["prediction"]
    pred["sequential_iteration_us"] = 1.2 * pred["iteration_us"]  # a schedule worth replaying
    (tmp_path / "b-strong.json").write_text(json.dumps(data))
    pick = pick_shipped_schedule(spec, 1, "NVIDIA H200", tmp_path)
    assert pick.path == tmp_path / "b-strong.json"
    none = pick_shipped_schedule(spec, 1, "NVIDIA H100 80GB HBM3", tmp_path)
    assert none.schedule is None and "no shipped schedule is for llama3-8b tp=1 on NVIDIA " \
        "H100" in none.reason and "b-strong.json" in none.reason
    assert pick_shipped_schedule(spec, 2, "NVIDIA H200", tmp_path).schedule is None


def test_auto_picks_a_shipped_set_only_when_it_pipelines_a_shape(tmp_path):
    """The shipped H200 set runs every shape sequentially: auto says so and runs Sequential;
    the same set with one pipelined entry is picked."""
    import json

    from nanosched.schedules.sets import ScheduleSet

    spec = load_spec("llama3-8b")
    shipped = next(p for p in shipped_schedules() if p.name.startswith("llama3-8b-tp1-h200-in"))
    sset = ScheduleSet.from_json(json.loads(shipped.read_text()))
    assert not sset.pipelines
    (tmp_path / "a.set.json").write_text(shipped.read_text())
    weak = pick_shipped_schedule(spec, 1, "NVIDIA H200", tmp_path)
    assert weak.schedule is None and "a.set.json predicts only 1.00x" in weak.reason
    single = json.loads((DATA / "llama3-8b-tp1-h200-b2048-single.json").read_text())
    single["batch"] = single["batch"] | {"workload": sset.workload}
    pipe = next(e for e in sset.to_json()["entries"]
                if (e["num_decode"], e["num_tokens"]) == (single["batch"]["num_decode"],
                                                          single["batch"]["dense_batch"]))
    data = sset.to_json()
    i = data["entries"].index(pipe)
    single["profile_digest"] = sset.profile_digest
    data["entries"][i] = pipe | {"kind": "pipeline", "forward_us": pipe["sequential_us"] / 1.2,
                                 "schedule": single}
    (tmp_path / "b.set.json").write_text(json.dumps(data))
    pick = pick_shipped_schedule(spec, 1, "NVIDIA H200", tmp_path)
    assert pick.path == tmp_path / "b.set.json" and "1 of 152 batch shapes pipelined" in \
        pick.reason


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*flags: str) -> tuple[subprocess.Popen, str]:
    """`nanosched serve` of the tiny config on a free loopback port, once /health answers."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "nanosched.cli", "serve", "--model", CONFIG,
                             "--port", str(port), "--device", "cpu", "--dense-batch", "16",
                             *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_healthy(proc, url, 60, lambda: proc.communicate()[0], poll_s=0.1)
    return proc, url


@pytest.mark.slow
def test_sigterm_drains_the_open_stream_then_exits():
    proc, url = _start()
    try:
        body = {"model": NAME, "prompt": [3, 1, 4], "max_tokens": 300, "stream": True,
                "ignore_eos": True, "temperature": 0}
        ids, reason = [], None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if not ids:
                    proc.send_signal(signal.SIGTERM)  # while 299 tokens are still to come
                ids += choice["token_ids"]
                reason = choice["finish_reason"] or reason
        assert len(ids) == 300 and reason == "length"
        # uvicorn re-raises the SIGTERM it caught once it has shut down gracefully
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=10)[0]
    assert "Shutting down" in out and "Application shutdown complete" in out, out
    assert f"listening on {url} (OpenAI API: {url}/v1" in out, out  # issue 45: the URL is said


@pytest.mark.slow
def test_when_the_drain_time_runs_out_open_requests_end_with_503(tmp_path):
    proc, url = _start("--drain-timeout", "0.5")
    body = {"model": NAME, "prompt": [3, 1, 4], "max_tokens": 500, "ignore_eos": True}
    try:
        async def main():
            async with httpx.AsyncClient(timeout=30) as c:
                async def streamed():
                    events = []
                    async with c.stream("POST", f"{url}/v1/completions",
                                        json=body | {"stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line:
                                events.append(line)
                                if len(events) == 1:  # it runs: now stop the server,
                                    while (await c.get(f"{url}/metrics")).text.count(
                                            "nanosched_requests_received_total 2") == 0:
                                        await asyncio.sleep(0.02)  # once both are in
                                    proc.send_signal(signal.SIGTERM)
                    return events

                return await asyncio.gather(streamed(), c.post(f"{url}/v1/completions",
                                                               json=body))

        t0 = time.monotonic()
        events, whole = asyncio.run(main())
        took = time.monotonic() - t0
        assert whole.status_code == 503, whole.text
        assert "--drain-timeout" in whole.json()["error"]["message"]
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2].removeprefix("data: "))["error"]
        assert err["code"] == "unavailable" and "drain time" in err["message"]
        assert len(events) < 400 and took < 10  # cut at the drain time, not served to the end
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=10)[0]
    assert "drain time ran out: 2 open requests ended with 503" in out, out
    assert "Traceback" not in out, out


def test_drain_timeout_is_a_float_and_negative_is_refused():
    for bad in ("-1", "-0.5", "nan", "inf"):
        r = CliRunner().invoke(app, ["serve", "--model", CONFIG, "--device", "cpu",
                                     "--drain-timeout", bad])
        assert r.exit_code == 2 and "--drain-timeout" in r.output, (bad, r.output)
