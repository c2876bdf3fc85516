"""`nanosched serve` over real HTTP on loopback: answers equal `nanosched generate`'s, streams
agree with whole responses, load, disconnects, bad requests and the queue bound."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import httpx
import pytest
from serve_helpers import ThreadServer, metrics, server_fixtures

from nanosched.errors import ConfigError
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.generate import GenerateConfig, generate
from nanosched.runtime.server.text import plain_chat_prompt

folder, srv, http = server_fixtures("serve", timeout=30)


def ask(http, srv, **body):
    return http.post(f"{srv.url}/v1/completions", json={"model": srv.model, **body})


def greedy(folder, ids, n):
    return generate(GenerateConfig(EngineConfig(model=str(folder), device="cpu"),
                                   prompt_ids=tuple(ids), max_tokens=n)).output_ids


def stream(http, url, body):
    """Streamed completion → (token ids, text, finish reason, number of events)."""
    ids, text, reason, events = [], "", None, 0
    with http.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            events += 1
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            choice = json.loads(data)["choices"][0]
            ids += choice["token_ids"]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
    return ids, text, reason, events


def test_completion_equals_generate_and_stream_agrees(srv, http, folder):
    prompt = [5, 9, 2, 77, 31]
    want = greedy(folder, prompt, 8)
    r = ask(http, srv, prompt=prompt, max_tokens=8, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["token_ids"] == want and choice["finish_reason"] == "length"
    assert choice["text"] == " ".join(f"w{t}" for t in want)
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    ids, text, reason, events = stream(http, srv.url, {"model": srv.model, "prompt": prompt,
                                                       "max_tokens": 8, "temperature": 0})
    assert (ids, text, reason) == (want, choice["text"], "length") and events == 9
    text_prompt = ask(http, srv, prompt="w5 w9 w2 w77 w31", max_tokens=8, temperature=0)
    assert text_prompt.json()["choices"][0]["token_ids"] == want


def test_chat_uses_the_plain_template_without_a_chat_template(srv, http, folder):
    msgs = [{"role": "user", "content": "w3 w4"}]
    r = http.post(f"{srv.url}/v1/chat/completions",
                  json={"model": srv.model, "messages": msgs, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    # the fallback "user: w3 w4\nassistant: " splits into user : w3 w4 assistant : and the
    # words outside w0..w99 are the unknown token w0
    assert plain_chat_prompt(msgs) == "user: w3 w4\nassistant: "
    assert r.json()["usage"]["prompt_tokens"] == 6
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == greedy(folder, [0, 0, 3, 4, 0, 0], 4)
    assert choice["message"]["role"] == "assistant"


def test_models_and_health(srv, http):
    assert http.get(f"{srv.url}/health").json() == {"status": "ok"}
    data = http.get(f"{srv.url}/v1/models").json()["data"]
    assert [m["id"] for m in data] == [srv.model] and data[0]["strategy"] == "sequential"


@pytest.mark.slow
def test_64_concurrent_clients_each_get_their_own_answers(srv, folder):
    rng = random.Random(0)
    prompts = [[rng.randrange(100) for _ in range(rng.randint(2, 12))] for _ in range(16)]
    want = [greedy(folder, p, 4) for p in prompts]

    async def client(c, k):
        got = []
        for j in range(4):
            i = (k * 4 + j) % 16
            r = await c.post(f"{srv.url}/v1/completions", json={
                "model": srv.model, "prompt": prompts[i], "max_tokens": 4, "temperature": 0})
            got.append((i, r.status_code, r.json()["choices"][0]["token_ids"]))
        return got

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            return await asyncio.gather(*(client(c, k) for k in range(64)))

    t0 = time.perf_counter()
    results = [x for got in asyncio.run(main()) for x in got]
    elapsed = time.perf_counter() - t0
    assert len(results) == 256
    assert all(code == 200 and ids == want[i] for i, code, ids in results)
    print(f"256 requests in {elapsed:.2f} s ({256 / elapsed:.0f} req/s)")


def test_client_disconnect_mid_stream_aborts_and_frees_pages(srv, http):
    before = metrics(http, srv.url)["nanosched_requests_aborted_total"]
    body = {"model": srv.model, "prompt": [1, 2, 3], "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as own, own.stream("POST", f"{srv.url}/v1/completions",
                                                     json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # one token arrived, then the client leaves
    other = ask(http, srv, prompt=[4, 5], max_tokens=3, temperature=0)
    assert other.status_code == 200  # others are not stalled
    deadline = time.monotonic() + 10
    while True:
        m = metrics(http, srv.url)
        if m["nanosched_requests_aborted_total"] == before + 1 and \
                m["nanosched_kv_pages_in_use"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert srv.worker.engine.ws.kv.tables == {}


def _raw_post(url: str, path: str, body: bytes, headers: str = "") -> socket.socket:
    """Send a POST on a plain socket (so the test decides when the connection closes)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body)
    return sock


def wait_for(http, url, pred, timeout=10.0):
    """Poll /metrics until pred(metrics) holds; returns those metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http, url)
        if pred(m):
            return m
        assert time.monotonic() < deadline, str(sorted(m.items()))
        time.sleep(0.02)


def test_client_disconnect_mid_whole_response_aborts_at_once(srv, http):
    m0 = metrics(http, srv.url)
    body = json.dumps({"model": srv.model, "prompt": [1, 2, 3], "max_tokens": 500,
                       "ignore_eos": True}).encode()
    sock = _raw_post(srv.url, "/v1/completions", body)
    wait_for(http, srv.url, lambda m: m["nanosched_tokens_generated_total"]
             > m0["nanosched_tokens_generated_total"])  # it is generating
    sock.close()  # the client leaves mid-generation
    m = wait_for(http, srv.url, lambda m: m["nanosched_requests_aborted_total"]
                 == m0["nanosched_requests_aborted_total"] + 1 and
                 m["nanosched_kv_pages_in_use"] == 0 and m["nanosched_requests_running"] == 0)
    generated = m["nanosched_tokens_generated_total"] - m0["nanosched_tokens_generated_total"]
    assert generated < 500  # stopped early, not run to max_tokens
    alloc = srv.worker.engine.ws.kv.allocator
    assert alloc.num_free == m["nanosched_kv_pages_total"] and not any(alloc.refs)
    assert srv.worker.engine.ws.kv.tables == {}
    other = ask(http, srv, prompt=[4, 5], max_tokens=3, temperature=0)
    assert other.status_code == 200  # the server still answers


def test_oversized_bodies_get_413_before_they_are_read(srv, http):
    big = json.dumps({"model": srv.model, "prompt": "w1 " * (3 * 2**20)}).encode()  # 9 MiB
    assert len(big) > 8 * 2**20
    r = http.post(f"{srv.url}/v1/completions", content=big,
                  headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while it streams in
        for i in range(0, len(big), 2**20):
            yield big[i:i + 2**20]

    r = http.post(f"{srv.url}/v1/chat/completions", content=chunks(),
                  headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert ask(http, srv, prompt=[1, 2], max_tokens=2).status_code == 200


def test_a_huge_prompt_is_tokenized_off_the_event_loop(srv, http):
    body = {"model": srv.model, "prompt": "w1 " * 2**20}  # 3 MiB: seconds of tokenizing
    out = {}
    t = threading.Thread(target=lambda: out.update(r=http.post(f"{srv.url}/v1/completions",
                                                               json=body)))
    t.start()
    worst = 0.0
    with httpx.Client(timeout=10) as probe:
        while t.is_alive():
            t0 = time.perf_counter()
            assert probe.get(f"{srv.url}/health").status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.05)
    t.join()
    assert out["r"].status_code == 400 and out["r"].json()["error"]["param"] == "prompt"
    assert worst < 0.5, f"/health took {worst:.2f} s while the prompt was tokenized"


BAD = [
    ({"model": "gpt-4", "prompt": [1]}, 404, "model"),
    ({"prompt": [1]}, 400, "model"),
    ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1], "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": [1], "max_tokens": "8"}, 400, "max_tokens"),
    ({"prompt": [1] * 500, "max_tokens": 20}, 400, "max_tokens"),
    ({"prompt": [1] * 512}, 400, "prompt"),
    ({"prompt": [1, 100]}, 400, "prompt"),
    ({"prompt": {"ids": [1]}}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1], "temperature": -0.5}, 400, "temperature"),
    ({"prompt": [1], "temperature": "hot"}, 400, "temperature"),
    ({"prompt": [1], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1], "top_p": 1.5}, 400, "top_p"),
    ({"prompt": [1], "stream": "yes"}, 400, "stream"),
    ({"prompt": [1], "n": 17}, 400, "n"),
    ({"prompt": [1], "n": 0}, 400, "n"),
    ({"prompt": [[1]] * 5, "n": 16}, 400, "n"),
    ({"prompt": [1], "n": 2, "stream": True}, 400, "stream"),
    ({"prompt": [[1], [2]], "stream": True}, 400, "stream"),
    ({"prompt": [[1], [100]]}, 400, "prompt[1]"),
    ({"prompt": [[1], 2]}, 400, "prompt"),
    ({"prompt": [[1]] * 65}, 400, "prompt"),
    ({"prompt": [1], "seed": 7}, 400, "seed"),
    ({"prompt": [1], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": [1], "stop": [""]}, 400, "stop"),
    ({"prompt": [1], "stop": 5}, 400, "stop"),
    ({"prompt": [1], "stop": "x" * 300}, 400, "stop"),
    ({"prompt": [1], "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": [1], "stream": True, "stream_options": {"x": 1}}, 400, "stream_options"),
    ({"prompt": [1], "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage"),
    ({"prompt": [1], "temperature": 2.5}, 400, "temperature"),
    ({"prompt": [1], "temperature": float("inf")}, 400, "temperature"),
    ({"prompt": [1], "temperature": float("nan")}, 400, "temperature"),
    ({"prompt": [1], "top_p": float("nan")}, 400, "top_p"),
    ({"prompt": [1], "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"prompt": [1], "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"prompt": [1], "tool_choice": "auto"}, 400, "tool_choice"),
    ({"prompt": [1], "logit_bias": {"5": 100}}, 400, "logit_bias"),
    ({"prompt": [1], "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": [1], "frequency_penalty": -1}, 400, "frequency_penalty"),
    ({"prompt": [1], "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ({"prompt": [1], "guided_json": {}}, 400, "guided_json"),
]


def test_neutral_values_of_unsupported_fields_are_accepted(srv, http):
    r = ask(http, srv, prompt=[1], max_tokens=2, response_format={"type": "text"}, tools=[],
            logit_bias={}, presence_penalty=0, frequency_penalty=0.0, temperature=2)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_requests_get_openai_errors_naming_the_field(srv, http, body, status, param):
    if "model" not in body and param != "model":
        body = {"model": srv.model, **body}
    r = http.post(f"{srv.url}/v1/completions", content=json.dumps(body),  # NaN, Infinity
                  headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and param in err["message"]


@pytest.mark.parametrize("raw, message", [(b"{not json", "not valid JSON"),
                                          (b"[1, 2]", "must be a JSON object")])
def test_malformed_bodies(srv, http, raw, message):
    r = http.post(f"{srv.url}/v1/completions", content=raw,
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_bad_chat_messages(srv, http):
    r = http.post(f"{srv.url}/v1/chat/completions",
                  json={"model": srv.model, "messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0]"


def test_past_the_queue_bound_requests_get_429(folder):
    s = ThreadServer(model=str(folder), dense_batch=8, max_queue=2)
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(f"{s.url}/v1/completions", json={
                    "model": s.model, "prompt": [1, 2, 3, i], "max_tokens": 24,
                    "ignore_eos": True}) for i in range(24)))

        rs = asyncio.run(main())
    finally:
        s.close()
    codes = [r.status_code for r in rs]
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes  # 2 may wait
    busy_r = next(r for r in rs if r.status_code == 429)
    assert busy_r.headers["retry-after"] == "1"
    busy = busy_r.json()["error"]
    assert busy["type"] == "rate_limit_error" and "--max-queue" in busy["message"]
    assert all(len(r.json()["choices"][0]["token_ids"]) == 24 for r in rs
               if r.status_code == 200)


def _body(rest: str) -> str:
    """A raw JSON object naming the served model (MODEL is replaced by the test) and `rest`."""
    return '{"model": "MODEL", ' + rest + "}"


HOSTILE = [  # raw bodies -> status, param
    ("/v1/completions", _body(r'"prompt": "w1 \ud800 w2"'), 400, "prompt"),
    ("/v1/completions", _body(r'"prompt": ["\udfff"]'), 400, "prompt"),
    ("/v1/chat/completions", _body(r'"messages": [{"role": "user", "content": "hi \ud83d"}]'),
     400, "messages[0].content"),
    ("/v1/chat/completions", _body(r'"messages": [{"role": "\udc00", "content": "w1"}]'), 400,
     "messages[0].role"),
    ("/v1/completions", r'{"model": "\ud800", "prompt": [1]}', 404, "model"),
    ("/v1/completions", "[" * 100_000 + "]" * 100_000, 400, None),
    ("/v1/completions", _body('"prompt": [1], "user": ' + "[" * 40 + "]" * 40), 400, None),
    ("/v1/chat/completions", _body('"messages": ' + "[" * 5000 + "]" * 5000), 400, None),
    ("/v1/completions", _body('"prompt": {"x": "' + "a" * 100_000 + '"}'), 400, "prompt"),
    ("/v1/completions", _body('"prompt": [1], "n": "' + "7" * 100_000 + '"'), 400, "n"),
    ("/v1/completions", "", 400, None),
    ("/v1/completions", "null", 400, None),
    ("/v1/completions", r'"\ud800"', 400, None),
]


@pytest.mark.parametrize("path, raw, status, param", HOSTILE)
def test_hostile_bodies_get_a_short_openai_error(srv, http, path, raw, status, param):
    raw = raw.replace("MODEL", srv.model)
    r = http.post(f"{srv.url}{path}", content=raw.encode(),
                  headers={"content-type": "application/json"})
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert len(err["message"]) < 400, err["message"]


@pytest.mark.parametrize("raw, param", [(b'"prompt": "\xed\xa0\x80"', "prompt"),
                                        (b'"prompt": "\xff\xfe"', None)])
def test_invalid_utf8_is_a_400(srv, http, raw, param):
    # json.loads lets UTF-8-encoded surrogates through (surrogatepass): the prompt check stops
    # them; other invalid bytes are not JSON
    raw = b'{"model": "%s", ' % srv.model.encode() + raw + b"}"
    r = http.post(f"{srv.url}/v1/completions", content=raw)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_unknown_routes_and_methods_and_internal_errors_answer_json(srv, http, monkeypatch):
    r = http.get(f"{srv.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http.get(f"{srv.url}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    import nanosched.runtime.server.app as app_module

    def broken(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(app_module, "parse_completion", broken)
    r = ask(http, srv, prompt=[1])
    assert r.status_code == 500 and r.json()["error"] == {
        "message": "internal error: RuntimeError: boom", "type": "server_error",
        "param": None, "code": "internal_error"}
    assert r.headers["connection"] == "close"  # the server closes it: not to be reused
    monkeypatch.undo()
    assert ask(http, srv, prompt=[1], max_tokens=2).status_code == 200


def test_nan_logits_end_that_request_alone_and_the_engine_goes_on(srv, http, monkeypatch):
    import nanosched.runtime.engine as engine_module

    real = engine_module.sample

    def poisoned(logits, temperature, top_p, generator=None, **kw):  # rows at temperature 0.5
        logits = logits.masked_fill((temperature == 0.5).unsqueeze(1), float("nan"))
        return real(logits, temperature, top_p, generator, **kw)

    monkeypatch.setattr(engine_module, "sample", poisoned)
    m0 = metrics(http, srv.url)

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            def post(**kw):
                return c.post(f"{srv.url}/v1/completions", json={
                    "model": srv.model, "prompt": [7, 8, 9], "max_tokens": 30,
                    "ignore_eos": True, **kw})

            return await asyncio.gather(post(temperature=0.5), post(temperature=0.5),
                                        post(temperature=0), post(temperature=1.0))

    bad1, bad2, greedy_r, random_r = asyncio.run(main())
    for r in (bad1, bad2):
        err = r.json()["error"]
        assert r.status_code == 500 and "sampling failed" in err["message"], r.text
    assert greedy_r.status_code == 200 and random_r.status_code == 200
    assert len(greedy_r.json()["choices"][0]["token_ids"]) == 30
    with http.stream("POST", f"{srv.url}/v1/completions", json={
            "model": srv.model, "prompt": [7], "max_tokens": 5, "temperature": 0.5,
            "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert "sampling failed" in json.loads(events[0][6:])["error"]["message"]
    assert events[-1] == "data: [DONE]"
    assert http.get(f"{srv.url}/health").json() == {"status": "ok"}
    m = wait_for(http, srv.url, lambda m: m["nanosched_kv_pages_in_use"] == 0)
    assert m["nanosched_requests_received_total"] == m0["nanosched_requests_received_total"] + 5
    monkeypatch.undo()
    assert ask(http, srv, prompt=[1], max_tokens=2, temperature=0.5).status_code == 200


def test_api_key_guards_the_v1_routes(folder, caplog):
    s = ThreadServer(model=str(folder), dense_batch=16, api_key="sekrit", host="0.0.0.0")
    try:
        with httpx.Client(timeout=30) as c:
            body = {"model": s.model, "prompt": [1, 2], "max_tokens": 2}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"},
                            {"Authorization": "Basic sekrit"}, {"Authorization": "Bearer sekri"}):
                r = c.post(f"{s.url}/v1/completions", json=body, headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert "--api-key" in r.json()["error"]["message"]
            assert c.get(f"{s.url}/v1/models").status_code == 401
            # refused before the body is read: no 413 for an unauthenticated 9 MiB body
            r = c.post(f"{s.url}/v1/chat/completions", content=b"x" * (9 * 2**20))
            assert r.status_code == 401
            ok = {"Authorization": "Bearer sekrit"}
            assert c.post(f"{s.url}/v1/completions", json=body, headers=ok).status_code == 200
            assert c.get(f"{s.url}/v1/models", headers=ok).status_code == 200
            assert c.get(f"{s.url}/health").status_code == 200  # probes need no key
            assert c.get(f"{s.url}/metrics").status_code == 200
    finally:
        s.close()
    assert "no --api-key" not in caplog.text
    caplog.clear()
    ThreadServer(model=str(folder), dense_batch=16, host="0.0.0.0").close()
    assert "--host 0.0.0.0 accepts requests from other machines and no --api-key" in caplog.text
    caplog.clear()
    ThreadServer(model=str(folder), dense_batch=16, host="::1").close()
    assert "no --api-key" not in caplog.text


def test_an_empty_api_key_is_refused(folder):
    with pytest.raises(ConfigError, match="--api-key is empty"):
        ThreadServer(model=str(folder), api_key=" ")


def _sse(http, url, path, body):
    """A stream's events, parsed (the last one, [DONE], as the string)."""
    with http.stream("POST", f"{url}{path}", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(x[6:]) if x != "data: [DONE]" else x[6:]
                for x in r.iter_lines() if x]


def test_stop_strings_end_the_text_before_them_whole_and_streamed(srv, http):
    base = {"model": srv.model, "prompt": [5, 9, 2], "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    full = ask(http, srv, **base).json()["choices"][0]["text"]
    words = full.split()
    # a stop that spans two tokens ("w12 w3" is two words) and one inside a word
    for stop in (f"{words[3]} {words[4]}", f"{words[6][1:]} {words[7][:2]}",
                 [words[8], "zzz"]):
        first = min(full.find(x) for x in ([stop] if isinstance(stop, str) else stop)
                    if x in full)
        r = ask(http, srv, **base, stop=stop)
        choice = r.json()["choices"][0]
        assert choice["text"] == full[:first] and choice["finish_reason"] == "stop"
        events = _sse(http, srv.url, "/v1/completions", base | {"stop": stop})
        assert events[-1] == "[DONE]"
        streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert streamed == full[:first] and events[-2]["choices"][0]["finish_reason"] == "stop"
    r = ask(http, srv, **base, stop="never there")  # no hit: the whole text
    assert r.json()["choices"][0]["text"] == full
    m = wait_for(http, srv.url, lambda m: m["nanosched_kv_pages_in_use"] == 0)
    assert m["nanosched_requests_running"] == 0


def test_stream_options_include_usage(srv, http):
    body = {"model": srv.model, "prompt": [5, 9], "max_tokens": 4, "temperature": 0,
            "stream_options": {"include_usage": True}}
    events = _sse(http, srv.url, "/v1/completions", body)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4,
                                   "total_tokens": 6}
    assert all(e["usage"] is None for e in events[:-2])
    plain = _sse(http, srv.url, "/v1/completions", body | {"stream_options": None})
    assert all("usage" not in e for e in plain[:-1])


def test_chat_content_as_text_parts(srv, http):
    def chat(content, **kw):
        return http.post(f"{srv.url}/v1/chat/completions", json={
            "model": srv.model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 3, "temperature": 0, **kw})

    want = chat("w3 w4\nw5").json()["choices"][0]["token_ids"]
    parts = [{"type": "text", "text": "w3 w4"}, {"type": "text", "text": "w5"}]
    assert chat(parts).json()["choices"][0]["token_ids"] == want
    r = chat([{"type": "image_url", "image_url": {"url": "http://x"}}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
    r = chat([{"type": "text", "text": 5}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].text"
    r = chat({"text": "w1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    events = _sse(http, srv.url, "/v1/chat/completions", {
        "model": srv.model, "messages": [{"role": "user", "content": parts}], "max_tokens": 3,
        "temperature": 0, "stop": "never", "stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert [t for e in events[1:-2] for t in e["choices"][0]["token_ids"]] == want
    assert events[-2]["usage"]["completion_tokens"] == 3


def test_the_model_id_is_the_folder_name_or_the_served_model_name(srv, http, folder):
    assert srv.model == "tiny" and str(folder) != "tiny"
    assert [m["id"] for m in http.get(f"{srv.url}/v1/models").json()["data"]] == ["tiny"]
    r = ask(http, srv, prompt=[1], max_tokens=1)
    assert r.json()["model"] == "tiny"
    r = http.post(f"{srv.url}/v1/completions", json={"model": "tiny2", "prompt": [1]})
    assert r.status_code == 404 and "'tiny'" in r.json()["error"]["message"]
    r = http.post(f"{srv.url}/v1/completions", json={"model": str(folder), "prompt": [1],
                                                   "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "tiny"  # as vLLM: the path given
    s = ThreadServer(model=str(folder), dense_batch=16, served_model_name="my-llama")
    try:
        assert s.model == "my-llama"
        for name in ("my-llama", "tiny", str(folder)):
            r = http.post(f"{s.url}/v1/completions", json={"model": name, "prompt": [1],
                                                           "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "my-llama"
    finally:
        s.close()
    with pytest.raises(ConfigError, match="--served-model-name is empty"):
        ThreadServer(model=str(folder), served_model_name="")


def test_metrics_count_prefix_cache_queries_and_hits_in_tokens(srv, http):
    """A prompt sent again finds its full pages cached (the last token computed): /metrics
    counts the tokens under nanosched's names and vLLM's, and the answer is the same; of n = 2
    choices of a new prompt one shares the other's full pages, and no page is held after."""
    prompt = [(7 * j + 3) % 50 for j in range(40)]  # two full 16-token pages and 8 more
    m0 = metrics(http, srv.url)
    first = ask(http, srv, prompt=prompt, max_tokens=4, temperature=0)
    again = ask(http, srv, prompt=prompt, max_tokens=4, temperature=0)
    assert first.status_code == again.status_code == 200
    assert first.json()["choices"][0]["token_ids"] == again.json()["choices"][0]["token_ids"]
    m = metrics(http, srv.url)
    queries = m["nanosched_prefix_cache_queries_total"] - \
        m0["nanosched_prefix_cache_queries_total"]
    hits = m["nanosched_prefix_cache_hits_total"] - m0["nanosched_prefix_cache_hits_total"]
    assert queries == 80 and hits >= 32 and hits % 16 == 0
    assert m["vllm:prefix_cache_hits_total"] == m["nanosched_prefix_cache_hits_total"]
    assert m["vllm:prefix_cache_queries_total"] == m["nanosched_prefix_cache_queries_total"]
    fresh = [(5 * j + 1) % 50 for j in range(40)]
    want = ask(http, srv, prompt=fresh, max_tokens=4, temperature=0, n=1)  # cached from here
    m0 = metrics(http, srv.url)
    fresh[0] = (fresh[0] + 1) % 50  # a prompt nothing cached shares a page with
    both = ask(http, srv, prompt=fresh, max_tokens=4, temperature=0, n=2)
    ids = [c["token_ids"] for c in both.json()["choices"]]
    assert ids[0] == ids[1] and want.status_code == 200
    m = metrics(http, srv.url)
    assert m["nanosched_prefix_cache_hits_total"] - m0["nanosched_prefix_cache_hits_total"] == 32
    m = wait_for(http, srv.url, lambda m: m["nanosched_kv_pages_in_use"] == 0)
    assert not any(srv.worker.engine.ws.kv.allocator.refs)
