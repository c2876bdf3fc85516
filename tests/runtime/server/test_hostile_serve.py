"""Hostile requests against the real server over loopback (issue 36): a prompt just under the
body limit, slow and idle connections and too many of them, a chat template that refuses,
integers of thousands of digits, a client that leaves mid-body, more choices than the queue
holds, text/plain bodies, the API pages under a key, an abort counted once. Each is refused
with a 4xx naming what is wrong (or the connection closed, for the slow ones) and the server
keeps serving: no 5xx, traceback or leaked page."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import pytest
from serve_helpers import ThreadServer, metrics, server_fixtures

from nanosched.errors import ConfigError
from nanosched.runtime.requests import SamplingParams

folder, srv, http = server_fixtures("hostile", timeout=30)


def ask(http, srv, path="/v1/completions", **body):
    return http.post(f"{srv.url}{path}", json={"model": srv.model, **body})


def no_server_errors(caplog) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


def test_a_prompt_just_under_the_body_limit_is_refused_before_it_is_tokenized(srv, http):
    body = json.dumps({"model": srv.model, "prompt": "w1 " * (8 * 2**20 // 3 - 100)})
    assert len(body) < 8 * 2**20
    t0 = time.perf_counter()
    r = http.post(f"{srv.url}/v1/completions", content=body,
                  headers={"content-type": "application/json"})
    took = time.perf_counter() - t0
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt", r.text
    assert "at least" in err["message"] and "context of 512 tokens" in err["message"]
    assert took < 2.0, f"{took:.1f} s: the prompt was tokenized whole"
    chat = {"model": srv.model, "messages": [{"role": "user", "content": "w2 " * 2**21}]}
    r = http.post(f"{srv.url}/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert ask(http, srv, prompt="w1 w2", max_tokens=2).status_code == 200


@pytest.mark.parametrize("raw", ['{"model": "%s", "prompt": [1], "max_tokens": 1%s}',
                                 '{"model": "%s", "prompt": [1, 2%s]}'])
def test_integers_of_thousands_of_digits_are_a_400(srv, http, raw, caplog):
    body = raw % (srv.model, "0" * 5000)
    r = http.post(f"{srv.url}/v1/completions", content=body)
    assert r.status_code == 400 and "too long" in r.json()["error"]["message"], r.text
    no_server_errors(caplog)


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_declared_json_gets_415(srv, http, ctype):
    body = json.dumps({"model": srv.model, "prompt": [1], "max_tokens": 1})
    r = http.post(f"{srv.url}/v1/completions", content=body, headers={"content-type": ctype})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    for ok in ("application/json", "application/json; charset=utf-8", "application/vnd+json"):
        r = http.post(f"{srv.url}/v1/completions", content=body, headers={"content-type": ok})
        assert r.status_code == 200, (ok, r.text)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_a_client_that_leaves_mid_body_is_one_quiet_line(srv, http, caplog):
    caplog.set_level(logging.INFO)
    m0 = metrics(http, srv.url)
    sock = _connect(srv.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    time.sleep(0.2)
    sock.close()
    deadline = time.monotonic() + 5
    while "left before sending the whole body" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.02)
    no_server_errors(caplog)
    assert "Traceback" not in caplog.text and "ClientDisconnect" not in caplog.text
    m = metrics(http, srv.url)
    assert m["nanosched_requests_received_total"] == m0["nanosched_requests_received_total"]
    assert ask(http, srv, prompt=[1], max_tokens=1).status_code == 200


def test_more_choices_than_the_queue_holds_is_a_400_not_a_429(folder):
    s = ThreadServer(model=str(folder), dense_batch=16, max_queue=4)
    try:
        with httpx.Client(timeout=30) as c:
            for body, param in (({"prompt": [1], "n": 5}, "n"),
                                ({"prompt": [[1]] * 5}, "prompt"),
                                ({"prompt": [[1], [2]], "n": 3}, "n")):
                r = c.post(f"{s.url}/v1/completions", json={"model": s.model, **body})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == param, r.text
                assert err["code"] == "exceeds_queue" and "--max-queue 4" in err["message"]
                assert "retry-after" not in r.headers
            r = c.post(f"{s.url}/v1/completions", json={"model": s.model, "prompt": [1],
                                                        "n": 4, "max_tokens": 2})
            assert r.status_code == 200 and len(r.json()["choices"]) == 4
    finally:
        s.close()


def test_a_chat_template_that_raises_is_a_400(tmp_path):
    from serve_helpers import tiny_folder

    f = tiny_folder(tmp_path)
    cfg = json.loads((f / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (  # Llama-2's rule: no system turn, user and assistant alternate
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/"
        "assistant/...') }}{% endif %}{{ m['content'] + ' ' }}{% endfor %}")
    (f / "tokenizer_config.json").write_text(json.dumps(cfg))
    s = ThreadServer(model=str(f), dense_batch=16)
    try:
        with httpx.Client(timeout=30) as c:
            def chat(*turns):
                return c.post(f"{s.url}/v1/chat/completions", json={
                    "model": s.model, "max_tokens": 2,
                    "messages": [{"role": r, "content": "w1"} for r in turns]})

            for turns, why in ((("system", "user"), "System role not supported"),
                               (("user", "user"), "roles must alternate")):
                r = chat(*turns)
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == "messages", r.text
                assert "chat template refused" in err["message"] and why in err["message"]
            assert chat("user").status_code == 200
            assert chat("user", "assistant", "user").status_code == 200
    finally:
        s.close()


def test_the_api_pages_are_off_under_an_api_key(folder, srv, http):
    for page in ("/docs", "/redoc", "/openapi.json"):
        assert http.get(f"{srv.url}{page}").status_code == 200  # no key: open, as vLLM's
    s = ThreadServer(model=str(folder), dense_batch=16, api_key="k3y")
    try:
        for page in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            r = http.get(f"{s.url}{page}", headers={"Authorization": "Bearer k3y"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    finally:
        s.close()


@pytest.mark.parametrize("key", ["clé", "key\x00", "tab\tkey", "ключ"])
def test_a_key_no_client_can_send_is_refused_at_start(folder, key):
    with pytest.raises(ConfigError, match="--api-key holds a non-ASCII or control"):
        ThreadServer(model=str(folder), api_key=key)


def test_an_abort_in_the_step_that_ends_the_request_is_counted_once(srv, http, monkeypatch):
    """The client leaves while the engine runs the step that ends its request: the request
    is aborted, not also finished."""
    worker = srv.worker
    real = worker.engine.step

    def step():
        ended = real()
        for req in ended:
            worker.abort(req.request_id)  # the HTTP side, while the step ran
        return ended

    monkeypatch.setattr(worker.engine, "step", step)
    m0 = metrics(http, srv.url)

    async def submit():
        worker.submit([3, 4], SamplingParams(max_tokens=1, temperature=0),
                      asyncio.get_running_loop())

    asyncio.run(submit())
    deadline = time.monotonic() + 10
    while metrics(http, srv.url)["nanosched_requests_aborted_total"] == \
            m0["nanosched_requests_aborted_total"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    monkeypatch.undo()
    m = metrics(http, srv.url)
    done = {k: m[k] - m0[k] for k in ("nanosched_requests_received_total",
                                      "nanosched_requests_finished_total",
                                      "nanosched_requests_aborted_total")}
    assert done == {"nanosched_requests_received_total": 1,
                    "nanosched_requests_finished_total": 0,
                    "nanosched_requests_aborted_total": 1}
    assert m["nanosched_kv_pages_in_use"] == 0  # no page referenced, cached ones included


TOOL_CALL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "content": None, "tool_calls": TOOL_CALL}],
     "messages[1].tool_calls"),
    ([{"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}}],
     "messages[0].function_call"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}], "messages[1].role"),
    ([{"role": "tool", "content": "42", "tool_call_id": "c1"}], "messages[0].tool_call_id"),
], ids=["tool_calls", "function_call", "tool-role", "tool_call_id"])
def test_per_message_tool_calls_are_refused_as_tools_is(srv, http, messages, param, caplog):
    """Issue 45: a top-level `tools` was a 400 while a message's `tool_calls` went silently
    into the template; both are refused, naming the field, and the server serves on."""
    r = ask(http, srv, "/v1/chat/completions", messages=messages, max_tokens=2)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "serves no tools" in err["message"]
    ok = ask(http, srv, "/v1/chat/completions", max_tokens=2,
             messages=[{"role": "user", "content": "hi"}, {"role": "assistant",
                                                          "content": "yo", "tool_calls": []}])
    assert ok.status_code == 200, ok.text
    no_server_errors(caplog)


def _half_closed(url: str, body: dict, version: str = "1.1") -> bytes:
    """Send one request, shut the socket for writing (FIN) and read until the server closes."""
    raw = json.dumps(body).encode()
    sock = _connect(url)
    sock.sendall(f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
    sock.shutdown(socket.SHUT_WR)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    sock.close()
    return out


@pytest.mark.parametrize("stream, version", [(False, "1.1"), (True, "1.1"), (False, "1.0")])
def test_a_client_that_half_closes_after_its_request_gets_its_answer(srv, http, stream,
                                                                       version):
    """Issue 45: `shutdown(SHUT_WR)` after a whole request (as `nc -N` does) is not leaving:
    the answer comes (an HTTP/1.1 client may first get a 100 Continue, which tells a client
    that closed from one that half-closed), then the server closes; nothing is aborted."""
    m0 = metrics(http, srv.url)
    body = {"model": srv.model, "prompt": [1, 2, 3], "max_tokens": 20, "ignore_eos": True,
            "stream": stream}
    out = _half_closed(srv.url, body, version)
    if version == "1.1":  # unless the answer had begun when the FIN was read
        out = out.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert b"100 Continue" not in out
    head, _, payload = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), out[:300]
    if stream:
        assert b"data: [DONE]" in payload and payload.count(b'"token_ids"') >= 2
    else:
        assert len(json.loads(payload)["choices"][0]["token_ids"]) == 20
    m = metrics(http, srv.url)
    assert m["nanosched_requests_aborted_total"] == m0["nanosched_requests_aborted_total"]
    assert m["nanosched_requests_finished_total"] == m0["nanosched_requests_finished_total"] + 1
