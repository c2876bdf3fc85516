"""`nanosched serve` logs a throughput / queue line every few seconds as vLLM's: the line's
figures from the worker's counters (a fake clock, no timing), the tiny registered model served
to a client end to end, the periodic thread, and --stats-interval range-checked (0: off)."""

import logging
import time

import httpx
import pytest
from serve_helpers import ThreadServer
from typer.testing import CliRunner

from nanosched.cli import app
from nanosched.runtime.server.statslog import StatsLogger


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def snap(prompt, gen, running=0, waiting=0, used=0, total=64):
    return {"prompt_tokens_processed": prompt, "tokens_generated": gen,
            "requests_running": running, "queue_length": waiting,
            "kv_pages_in_use": used, "kv_pages_total": total}


def test_the_line_reports_throughput_since_the_last_one_running_waiting_and_kv_usage():
    state, clock = {"s": snap(0, 0)}, Clock()
    stats = StatsLogger(lambda: state["s"], 5.0, clock=clock)
    clock.t += 4.0
    state["s"] = snap(400, 20, running=3, waiting=2, used=16)
    assert stats.line() == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: "
                            "5.0 tokens/s, Running: 3 reqs, Waiting: 2 reqs, KV cache usage: "
                            "25.0%")
    clock.t += 2.0
    state["s"] = snap(400, 30, running=1)
    assert stats.line().startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation "
                                   "throughput: 5.0 tokens/s, Running: 1 reqs, Waiting: 0")
    clock.t += 2.0
    state["s"] = snap(400, 30)
    assert stats.line() is None  # idle: nothing ran, nothing waits


@pytest.fixture(scope="module")
def srv():
    s = ThreadServer(model="stories15m", dense_batch=64, stats_interval_s=0)
    yield s
    s.close()


def test_the_tiny_model_serves_a_client_and_the_line_counts_its_tokens(srv):
    clock = Clock()
    stats = StatsLogger(srv.worker.snapshot, 5.0, clock=clock)
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{srv.url}/v1/completions",
                   json={"model": srv.model, "prompt": list(range(1, 13)), "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert srv.model == "stories15m" and len(body["choices"][0]["token_ids"]) == 5
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    clock.t += 2.0
    assert stats.line() == ("Avg prompt throughput: 6.0 tokens/s, Avg generation throughput: "
                            "2.5 tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: "
                            "0.0%")


def test_the_server_logs_the_line_periodically(caplog):
    caplog.set_level(logging.INFO, logger="nanosched.serve")
    s = ThreadServer(model="stories15m", dense_batch=64, stats_interval_s=0.05)
    try:
        with httpx.Client(timeout=60) as c:
            r = c.post(f"{s.url}/v1/completions",
                       json={"model": s.model, "prompt": [1, 2, 3], "max_tokens": 8})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30  # a bound on the wait, not a timing assertion
        while not any("Avg generation throughput" in m for m in caplog.messages):
            assert time.monotonic() < deadline, caplog.messages
            time.sleep(0.05)
    finally:
        s.close()
    line = next(m for m in caplog.messages if "Avg generation throughput" in m)
    assert "Running:" in line and "Waiting:" in line and "KV cache usage:" in line


@pytest.mark.parametrize("value", ["-1", "inf"])
def test_stats_interval_is_range_checked(value):
    r = CliRunner().invoke(app, ["serve", "--model", "stories15m", "--device", "cpu",
                                 "--stats-interval", value])
    assert r.exit_code == 2
    assert "--stats-interval must be a finite number of seconds >= 0" in r.output
