"""`nanosched serve` as a process under hostile conditions (issue 36): a busy port is refused
before the model loads, SIGHUP drains as SIGTERM does, and a second Ctrl-C ends every open
request with an error (an event on a stream, a JSON 503 otherwise) before the process exits."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time

import httpx
import pytest
from hostile import refused
from serve_helpers import DATA, serve_process

NAME = "tiny_llama_config"
BODY = {"model": NAME, "prompt": [3, 1, 4], "ignore_eos": True, "temperature": 0}


def test_a_busy_port_is_refused_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        line = refused(["serve", "--model", "llama3-70b", "--port", str(port), "--device",
                        "cpu"], "--port", "already in use")
        assert time.monotonic() - t0 < 5  # llama3-70b was never built
    assert str(port) in line
    refused(["serve", "--model", str(DATA / "tiny_llama_config.json"), "--host",
             "no-such-host.invalid"], "--host", "cannot be resolved")


@pytest.mark.parametrize("flags, needle", [
    (["--header-timeout", "0"], "--header-timeout"), (["--body-timeout", "inf"], "--body-timeout"),
    (["--max-connections", "0"], "--max-connections"), (["--api-key", "cl\u00e9"], "--api-key"),
    (["--api-key", "a\x07b"], "--api-key"), (["--port", "70000"], "--port")])
def test_bad_server_flags_are_refused_before_anything_loads(flags, needle):
    refused(["serve", "--model", "llama3-70b", "--device", "cpu", *flags], needle)


@pytest.mark.slow
def test_sighup_drains_the_open_stream_then_exits():
    proc, url = serve_process()
    try:
        ids, reason = [], None
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json=BODY | {"max_tokens": 200, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    if not ids:
                        proc.send_signal(signal.SIGHUP)  # while 199 tokens are still to come
                    choice = json.loads(line[6:])["choices"][0]
                    ids += choice["token_ids"]
                    reason = choice["finish_reason"] or reason
        assert len(ids) == 200 and reason == "length"
        assert proc.wait(timeout=30) in (0, -signal.SIGHUP)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=10)[0]
    assert "Shutting down" in out and "Application shutdown complete" in out, out


@pytest.mark.slow
def test_a_second_ctrl_c_ends_every_open_request_with_an_error():
    proc, url = serve_process("--drain-timeout", "60")
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                async def streamed():
                    events = []
                    async with c.stream("POST", f"{url}/v1/completions",
                                        json=BODY | {"max_tokens": 500, "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line:
                                events.append(line)
                    return events

                async def whole():
                    r = await c.post(f"{url}/v1/completions", json=BODY | {"max_tokens": 500})
                    return r.status_code, r.headers.get("content-type"), r.text

                tasks = [asyncio.ensure_future(streamed()) for _ in range(6)] + \
                    [asyncio.ensure_future(whole()) for _ in range(3)]
                deadline = time.monotonic() + 30
                while "nanosched_requests_running 9" not in (await c.get(f"{url}/metrics")).text:
                    assert time.monotonic() < deadline and not any(t.done() for t in tasks)
                    await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGINT)  # drain: they would run for minutes
                await asyncio.sleep(0.5)
                proc.send_signal(signal.SIGINT)  # stop now
                return await asyncio.gather(*tasks)

        results = asyncio.run(main())
        for events in results[:6]:
            assert events[-1] == "data: [DONE]", events[-3:]
            err = json.loads(events[-2].removeprefix("data: "))["error"]
            assert err["code"] == "unavailable" and "second Ctrl-C" in err["message"]
        for status, ctype, text in results[6:]:
            assert status == 503 and ctype == "application/json", text
            assert "second Ctrl-C" in json.loads(text)["error"]["message"]
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=10)[0]
    assert "Traceback" not in out and "Internal Server Error" not in out, out
    # issue 45: the log says what ended them (it said the drain time ran out)
    assert re.search(r"a second Ctrl-C stopped the server at once: \d+ open requests ended "
                     r"with 503", out), out
    assert "drain time ran out" not in out, out
