"""Two `nanosched serve` replicas behind sglang-router on loopback (docs/usage.md, "Several
replicas behind a router"): the router registers both with what /server_info and /model_info
say, answers come back through it as the replicas give them, its cache-aware policy sends the
requests of one prefix to one replica, and it reads each replica's /get_load."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from serve_helpers import EngineGate, ThreadServer, free_port, tiny_folder

pytest.importorskip("sglang_router")

START_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory.mktemp("router"))
    servers = []
    try:
        for _ in range(2):  # the same random weights (one seed): the same greedy answers
            servers.append(ThreadServer(model=str(folder), dense_batch=32, max_queue=64))
        yield servers
    finally:
        for s in servers:
            s.close()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    """`python -m sglang_router.launch_router` in front of both replicas, once it lists them
    healthy; its log in a file (shown when a check fails), stopped (then killed) at the end."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("router-log") / "router.log"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--worker-urls", *(s.url for s in replicas),
           "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
           "--shutdown-grace-period-secs", "1", "--log-level", "warn"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        workers = _wait_registered(proc, url, len(replicas), log_path)
        yield url, workers, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_registered(proc, url, count, log_path):
    """The router's /workers once `count` workers are healthy, else fail with its log."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"router did not register {count} workers in "
                                 f"{START_TIMEOUT_S} s: {log_path.read_text()[-3000:]}")
        try:
            workers = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
            if len(workers) == count and all(w["is_healthy"] for w in workers):
                return workers
        except (httpx.TransportError, ValueError, KeyError):
            pass
        time.sleep(0.1)


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=30) as c:
        yield c


def test_the_router_registers_each_replica_as_it_describes_itself(router, replicas):
    _, workers, _ = router
    assert sorted(w["url"] for w in workers) == sorted(s.url for s in replicas)
    for w in workers:  # a field of the wrong type would drop the whole body: model "unknown"
        assert w["model_id"] == replicas[0].model == "tiny", w
        meta = w["metadata"]
        assert meta["served_model_name"] == "tiny" and meta["tp_size"] == "1", meta
        assert meta["model_type"] == "llama" and meta["dp_size"] == "1", meta
        assert meta["architectures"] == '["LlamaForCausalLM"]', meta


def test_answers_come_back_through_the_router_as_a_replica_gives_them(router, replicas, http):
    url, _, log_path = router
    body = {"model": "tiny", "prompt": "w3 w1 w4 w1 w5", "max_tokens": 5, "temperature": 0}
    direct = http.post(f"{replicas[0].url}/v1/completions", json=body).json()
    routed = http.post(f"{url}/v1/completions", json=body)
    assert routed.status_code == 200, log_path.read_text()[-2000:]
    assert routed.json()["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    assert routed.json()["usage"] == direct["usage"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w7 w8"}],
            "max_tokens": 3, "temperature": 0}
    r = http.post(f"{url}/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    want = http.post(f"{replicas[1].url}/v1/chat/completions", json=chat).json()
    assert r.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    events = http.post(f"{url}/v1/completions", json=body | {"stream": True}).text.split("\n\n")
    assert events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-2]]
    assert "".join(c["text"] for c in chunks) == direct["choices"][0]["text"]
    assert [t for c in chunks for t in c["token_ids"]] == direct["choices"][0]["token_ids"]
    wrong = http.post(f"{url}/v1/completions", json=body | {"model": "other"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    ids = http.post(f"{url}/v1/completions", json=body | {"prompt": [3, 1, 4]})
    assert ids.status_code == 422  # the router's own refusal (docs/usage.md: not covered)


def test_requests_sharing_a_prefix_go_to_one_replica(router, replicas, http):
    """Cache-aware routing: a request whose text matches what a replica was sent by more than
    the threshold (0.3 of its characters) goes to that replica, even while it is the busier
    one; a request matching nothing goes to the replica with the fewest requests in flight.
    So the first prefix stays on the replica it started on (x), and the second, first sent
    while x holds a request, starts on the other (y) and stays there."""
    url, _, log_path = router
    prefixes = [" ".join(f"w{i}" for i in range(10, 50)),
                " ".join(f"w{i}" for i in range(99, 59, -1))]

    def send(group: int, k: int) -> httpx.Response:
        r = http.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": f"{prefixes[group]} w{k}", "max_tokens": 2})
        assert r.status_code == 200, log_path.read_text()[-2000:]
        return r

    def landed(action) -> tuple[int, Any]:
        """(the replica that received the one request `action` sends, what `action` gave)"""
        before = [s.worker.counters.received for s in replicas]
        result = action()
        deadline = time.monotonic() + 10
        while True:
            grew = [i for i, s in enumerate(replicas) if s.worker.counters.received > before[i]]
            if grew:
                assert len(grew) == 1 and sum(s.worker.counters.received for s in replicas) \
                    == sum(before) + 1, grew
                return grew[0], result
            assert time.monotonic() < deadline, "no replica received the request"
            time.sleep(0.01)

    x, _ = landed(lambda: send(0, 1))
    y = 1 - x
    seen = {0: [x], 1: []}
    with ThreadPoolExecutor(2) as pool, EngineGate(replicas[x].worker.engine) as gate:
        where, held = landed(lambda: pool.submit(send, 0, 2))
        seen[0].append(where)
        assert where == x, seen  # (else the gate on x would wait in vain)
        gate.wait_held()  # x now has a request in flight; y has none
        seen[1].append(landed(lambda: send(1, 1))[0])
        where, queued = landed(lambda: pool.submit(send, 0, 3))  # x is busier, but matches
        seen[0].append(where)
        gate.release()
        held.result(30)
        queued.result(30)
    for k in range(2, 5):
        seen[1].append(landed(lambda k=k: send(1, k))[0])
        seen[0].append(landed(lambda k=k: send(0, k + 2))[0])
    assert seen == {0: [x] * 6, 1: [y] * 4}, seen


def test_the_router_reads_each_replicas_load(router, replicas, http):
    """While one replica's engine is held with a request running, the router's /get_loads
    (fetched from each /get_load) gives that replica the KV tokens it holds, the other 0."""
    url, _, _ = router
    busy = replicas[0]
    ask = {"model": "tiny", "prompt": list(range(1, 41)), "max_tokens": 8}
    with ThreadPoolExecutor(1) as pool, EngineGate(busy.worker.engine) as gate:
        pending = pool.submit(http.post, f"{busy.url}/v1/completions", json=ask)
        gate.wait_held()
        held = busy.worker.engine.ws.kv.allocator.num_in_use * 16
        loads = {e["worker"]: e["load"] for e in http.get(f"{url}/get_loads").json()["workers"]}
        gate.release()
        assert pending.result(30).status_code == 200
    assert held >= 48 and loads == {busy.url: held, replicas[1].url: 0}, loads
