"""`nanosched serve --tp N` on a GPU host, end to end with a client.

Starts the server (random weights), then: a completion answered whole and the same one
streamed (greedy: the same tokens); `--concurrent` streamed requests at once (output tokens/s and
time to first token); a long stream during which the server gets SIGTERM (it must finish, and
every rank must exit: the record says how long after SIGTERM, or holds the log's tail when the
server was still running `--exit-timeout` s after the stream). Records the start-up time, each
figure, the exit code and whether any worker process is left, as JSON in $OUT or bench/results/.

    bench/engine/tp_run.sh serve      (on 4 GPUs; or, with the serve wheels on PYTHONPATH:)
    python bench/engine/tp_serve_smoke.py --model llama3-70b --tp 4

(the GPU image has no fastapi / uvicorn / httpx: carry `.whl` as
bench/engine/serve_poisson.py says).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench._common import ROOT, environment, write_result


def start(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str, list[int], float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    path = f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"
    proc = subprocess.Popen([sys.executable, "-m", "nanosched.cli", "serve", "--model",
                             args.model, "--tp", str(args.tp), "--port", str(port)],
                            env=os.environ | {"PYTHONPATH": path}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None or time.monotonic() - t0 > args.start_timeout:
            proc.kill()
            sys.exit(f"server did not start:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(1)
    found = re.search(r"ranks 1\.\.\d+ are pids ([\d, ]+)", log.read_text())
    pids = [int(p) for p in found.group(1).split(",")] if found else []
    return proc, url, pids, time.monotonic() - t0


async def stream(client: httpx.AsyncClient, url: str, body: dict, on_first=None
                 ) -> tuple[list[int], float, float]:
    """(token ids, time to the first token, total time) of a streamed completion."""
    t0, first, ids = time.monotonic(), None, []
    async with client.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                if first is None:
                    first = time.monotonic() - t0
                    if on_first is not None:
                        on_first()
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
    return ids, first or float("nan"), time.monotonic() - t0


async def exercise(args: argparse.Namespace, url: str, proc: subprocess.Popen) -> dict[str, Any]:
    prompt = [(7 * i) % 97 + 3 for i in range(args.prompt_len)]
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True}
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        whole = (await client.post(f"{url}/v1/completions", json=body)).json()
        streamed, ttft, _ = await stream(client, url, body)
        out["whole_tokens"] = len(whole["choices"][0]["token_ids"])
        out["streamed_equals_whole"] = streamed == whole["choices"][0]["token_ids"]
        out["ttft_single_s"] = ttft
        t0 = time.monotonic()
        many = await asyncio.gather(*(
            stream(client, url, body | {"prompt": prompt[i:] + prompt[:i]})
            for i in range(args.concurrent)))
        wall = time.monotonic() - t0
        out |= {"concurrent": args.concurrent, "concurrent_wall_s": wall,
                "concurrent_output_tokens_per_s": sum(len(m[0]) for m in many) / wall,
                "concurrent_ttft_mean_s": sum(m[1] for m in many) / len(many)}
        long = body | {"max_tokens": 4 * args.max_tokens}

        def term() -> None:
            out["sigterm_at"] = time.monotonic()
            proc.send_signal(signal.SIGTERM)

        ids, _, _ = await stream(client, url, long, term)
        out["drained_stream_tokens"] = len(ids)
        out["drained_stream_complete"] = len(ids) == long["max_tokens"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--exit-timeout", type=float, default=60,
                    help="seconds the server may take to end after the drained stream")
    args = ap.parse_args()
    log = Path(os.environ.get("OUT") or "/tmp") / f"tp-serve-smoke-tp{args.tp}.log"
    proc, url, pids, start_s = start(args, log)
    try:
        out = asyncio.run(exercise(args, url, proc))
        try:  # a server that does not end after SIGTERM is a finding, recorded with its log
            code = proc.wait(timeout=args.exit_timeout)
        except subprocess.TimeoutExpired:
            code = None
            out["log_tail"] = log.read_text()[-3000:]
        out["exit_s"] = time.monotonic() - out.pop("sigterm_at") if code is not None else None
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(1)
    left = [p for p in pids if Path(f"/proc/{p}").exists()]
    env = environment() if torch.cuda.is_available() else {
        "device": "cpu", "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())}
    record = {"env": env | {"num_gpus": args.tp}, "model": args.model, "tp": args.tp,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "start_s": start_s, **out, "exit_code": code, "workers": pids,
              "workers_left": left}
    path = write_result(f"tp-serve-smoke-{Path(args.model).name}-tp{args.tp}", record)
    for k, v in record.items():
        if k != "env":
            print(f"{k}: {v}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
