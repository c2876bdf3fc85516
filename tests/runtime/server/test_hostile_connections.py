"""Connections that hold a socket without finishing a request (issue 36): headers sent a byte
at a time, a body that stalls, connections that say nothing, more of them than the cap. Each is
answered 408 (or 503 over the cap) and closed, the closures are logged in summary, and the
server answers everyone else meanwhile. A response that takes longer than the timeouts (a long
stream) is not cut: the timeouts bound receiving a request, not answering it."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from serve_helpers import ThreadServer, tiny_folder, wait_healthy

from nanosched.errors import ConfigError
from nanosched.runtime.server.connections import (
    CLIENT_KEEPALIVE_S,
    DEFAULT_HEADER_TIMEOUT_S,
    RESERVED_FDS,
    ConnectionLimits,
    default_max_connections,
    keep_alive_s,
)

TIMEOUT_S = 0.5
CAP = 6


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ThreadServer(model=str(tiny_folder(tmp_path_factory.mktemp("conn"))), dense_batch=16,
                     header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S, max_connections=CAP)
    yield s
    s.close()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    sock.close()
    return out


def _ok(url: str) -> bool:
    r = httpx.post(f"{url}/v1/completions", timeout=10,
                   json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
    return r.status_code == 200


def _timed(sock: socket.socket) -> tuple[bytes, float]:
    t0 = time.monotonic()
    return _answer(sock), time.monotonic() - t0


def test_headers_sent_a_byte_at_a_time_are_cut_at_the_header_timeout(srv):
    sock = _connect(srv.url)
    t0 = time.monotonic()
    for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n":
        try:
            sock.sendall(bytes([b]))
        except OSError:
            break
        time.sleep(0.05)
        if time.monotonic() - t0 > 4 * TIMEOUT_S:
            break
    answer, _ = _timed(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert time.monotonic() - t0 < 4 * TIMEOUT_S
    assert _ok(srv.url)


def test_a_connection_that_says_nothing_is_closed(srv):
    answer, took = _timed(_connect(srv.url))
    assert answer.startswith(b"HTTP/1.1 408") and took < 4 * TIMEOUT_S


def test_a_stalled_body_is_cut_at_the_body_timeout(srv):
    body = json.dumps({"model": "tiny", "prompt": [1], "max_tokens": 1}).encode()
    sock = _connect(srv.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5])
    answer, took = _timed(sock)
    assert b"408" in answer.split(b"\r\n")[0] and took < 4 * TIMEOUT_S
    assert _ok(srv.url)


def test_over_the_cap_a_connection_gets_503_at_once_and_others_are_served_after(srv):
    idle = [_connect(srv.url) for _ in range(CAP)]
    time.sleep(0.1)
    extra, took = _timed(_connect(srv.url))
    assert extra.startswith(b"HTTP/1.1 503") and b"too_many_connections" in extra
    assert took < TIMEOUT_S
    for s in idle:  # the idle ones time out, which frees their slots
        assert _answer(s).startswith(b"HTTP/1.1 408")
    assert _ok(srv.url)
    limits = srv.server.nanosched_limits
    assert limits.closed["over the connection limit"] >= 1 and limits.closed["slow headers"] >= CAP


def test_a_stream_longer_than_the_timeouts_is_not_cut(srv):
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    t0, ids = time.monotonic(), []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
                time.sleep(0.01)  # a slow reader
    assert len(ids) == 100 and time.monotonic() - t0 > TIMEOUT_S  # 100 x 10 ms of reading alone


def test_pipelined_requests_are_served_whole_past_the_header_timeout(srv):
    """Two requests in one write: the second is parsed when the first's response ends (after
    more than the header timeout) and is served, not cut; then the idle connection closes."""
    def post(body: dict) -> bytes:
        raw = json.dumps(body).encode()
        return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n" % len(raw)) + raw

    sock = _connect(srv.url)
    sock.sendall(post({"model": "tiny", "prompt": [1], "max_tokens": 200, "ignore_eos": True})
                 + post({"model": "tiny", "prompt": [2], "max_tokens": 1}))
    answer, took = _timed(sock)
    assert answer.count(b"HTTP/1.1 200 OK") == 2 and b"408" not in answer
    assert took > TIMEOUT_S  # the first answer took longer than the header timeout


def test_keep_alive_requests_reuse_the_connection(srv):
    with httpx.Client(timeout=10) as c:
        for _ in range(3):
            r = c.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": [1],
                                                          "max_tokens": 1})
            assert r.status_code == 200


def test_idle_keep_alive_is_closed_by_the_header_timeout_after_clients_let_go(srv):
    """uvicorn's own idle close comes after the header timeout's, and the default header
    timeout after the age at which httpx (and the openai client) stop reusing a connection: a
    client never writes a request on a connection the server is closing (uvicorn's 5 s, equal
    to httpx's, gave the 64-client test an httpx.ReadError under load)."""
    assert srv.server.config.timeout_keep_alive == keep_alive_s(srv.server.nanosched_limits)
    assert keep_alive_s(srv.server.nanosched_limits) > TIMEOUT_S
    assert keep_alive_s(ConnectionLimits()) > DEFAULT_HEADER_TIMEOUT_S
    assert httpx.Limits().keepalive_expiry == CLIENT_KEEPALIVE_S < DEFAULT_HEADER_TIMEOUT_S


@pytest.mark.slow
def test_a_connection_idle_as_long_as_clients_keep_one_still_serves(tmp_path):
    """The same on the wire, with the default timeouts: one connection, a request, an idle
    pause just past the clients' keep-alive, another request on the same socket."""
    import http.client

    s = ThreadServer(model=str(tiny_folder(tmp_path)), dense_batch=16)
    host, port = s.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": s.model, "prompt": [1, 2], "max_tokens": 1})
    try:
        for pause in (0.0, CLIENT_KEEPALIVE_S + 0.5):
            time.sleep(pause)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            sock = conn.sock
            r = conn.getresponse()
            assert r.status == 200 and r.read()
            assert conn.sock is sock and not r.will_close
    finally:
        conn.close()
        s.close()


def test_the_default_cap_stays_below_the_descriptor_limit(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda _: (256, 4096))
    assert default_max_connections() == 256 - RESERVED_FDS
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1 << 20, 1 << 20))
    assert default_max_connections() == 1024


@pytest.mark.parametrize("kw, flag", [({"header_timeout_s": 0}, "--header-timeout"),
                                      ({"body_timeout_s": float("inf")}, "--body-timeout"),
                                      ({"max_connections": 0}, "--max-connections")])
def test_bad_bounds_are_refused(tmp_path, kw, flag):
    with pytest.raises(ConfigError, match=flag):
        ThreadServer(model=str(tiny_folder(tmp_path)), **kw)


def _serve_limited(tmp_path, nofile: int, *flags: str):
    """`nanosched serve` (stories15m) under RLIMIT_NOFILE `nofile`: (process, url, log)."""
    import resource
    import subprocess
    import sys

    from repo import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanosched.cli", "serve", "--model", "stories15m", "--device",
         "cpu", "--port", str(port), *flags], cwd=ROOT, stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 120, log.read_text)
    return proc, url, log


@pytest.mark.slow
@pytest.mark.parametrize("nofile, clients, flags", [
    (256, 300, ()), (1024, 1100, ()), (1024, 1100, ("--max-connections", "5000"))],
    ids=["256-300", "1024-1100", "1024-1100-asked-5000"])
def test_idle_connections_past_the_descriptor_limit_get_503_not_accept_tracebacks(
        tmp_path, nofile, clients, flags):
    """Issue 45: the cap is held below the descriptors left once the model is loaded (with
    room for an accept burst), so past it a connection is answered 503 and nothing logs "Too
    many open files"; a cap asked above that is said once; the server serves after."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < clients + 64:
        pytest.skip(f"this process may open {hard} descriptors, fewer than {clients} clients")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, clients + 64), hard))
    proc, url, log = _serve_limited(tmp_path, nofile, *flags)
    socks = []
    try:
        for _ in range(clients):
            socks.append(socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])),
                                                  timeout=10))
        time.sleep(1.0)
        r = httpx.post(f"{url}/v1/completions", timeout=10,
                       json={"model": "stories15m", "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
        for s in socks:
            s.close()
        socks = []
        deadline = time.monotonic() + 10
        while True:  # the server sees the closes within a moment
            r = httpx.post(f"{url}/v1/completions", timeout=10,
                           json={"model": "stories15m", "prompt": [1, 2], "max_tokens": 2})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(timeout=60)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    text = log.read_text()
    assert "Too many open files" not in text and "Traceback" not in text, text
    assert text.count("closed connections so far") >= 1
    assert text.count("descriptor limit") == (1 if flags else 0), text


def test_accept_out_of_descriptors_is_logged_once_without_a_traceback(caplog):
    """Should accept() run out anyway, asyncio's per-attempt report (a traceback each) becomes
    one warning and a count; other loop errors still reach the default handler."""
    import asyncio
    import errno

    from nanosched.runtime.server.connections import OUT_OF_FDS, accept_errors

    limits = ConnectionLimits(max_connections=10)
    handle = accept_errors(limits)
    loop = asyncio.new_event_loop()
    seen = []
    loop.default_exception_handler = seen.append
    try:
        exc = OSError(errno.EMFILE, "Too many open files")
        with caplog.at_level("WARNING", logger="nanosched.serve"):
            for _ in range(5):
                handle(loop, {"message": OUT_OF_FDS, "exception": exc})
            handle(loop, {"message": "something else"})
    finally:
        loop.close()
    said = [r for r in caplog.records if "out of file descriptors" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None
    assert "Too many open files" in said[0].getMessage()
    assert limits.closed["accept() out of descriptors"] == 5
    assert seen == [{"message": "something else"}]
