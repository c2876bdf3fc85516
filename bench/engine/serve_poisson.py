"""`nanosched serve` under Poisson load (NanoFlow §6.3): throughput, TTFT and normalized latency.

Starts `nanosched serve` (Llama-3-8B, random bf16 weights, a schedule or Sequential) on
127.0.0.1, then per request rate sends requests with exponential gaps for `--duration` seconds
(streamed, benchmark mode: `ignore_eos`, fixed or dataset lengths), waits for them (bounded),
and reports per rate: throughput ((prompt + output tokens) / wall time, and output tokens/s),
time to first token (mean, p50, p99) and normalized latency (mean over requests of end-to-end
time / output tokens), plus the server's fallback-to-Sequential count. JSON to $OUT or
bench/results/ (bench/_common.py). GPU only; not run on CPU.

    PYTHONPATH=.:.whl python bench/engine/serve_poisson.py [--schedule auto|sequential|FILE] \\
        [--rates 4,8,16] [--duration 60] [--input-len 1024 --output-len 512 | --workload W]

The GPU image has no fastapi/uvicorn/httpx: download the wheels here and carry `.whl`
(pure-Python wheels, put on PYTHONPATH as a folder of unpacked wheels):
    pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl/dl fastapi \\
        starlette uvicorn anyio sniffio h11 click idna pydantic pydantic-core annotated-types \\
        annotated-doc typing-extensions typing-inspection opentelemetry-api httpx httpcore \\
        certifi --platform manylinux2014_x86_64
    for w in .whl/dl/*.whl; do unzip -qo "$w" -d .whl; done
(the list is each wheel's `Requires-Dist` without extras, read with
`unzip -p WHEEL '*/METADATA' | grep Requires-Dist`; pydantic-core is the one binary wheel.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

from bench._common import ROOT, environment, print_table, write_result
from nanosched.models.spec import load_spec
from nanosched.runtime.requests import make_requests, poisson_arrivals


def start_server(args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanosched.cli", "serve", "--model", args.model,
           "--weights", "random", "--schedule", args.schedule, "--port", str(args.port),
           "--max-queue", "100000", "--device", "cuda",
           "--served-model-name", args.model]  # requests name the model as given
    if args.dense_batch:
        cmd += ["--dense-batch", str(args.dense_batch)]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    return subprocess.Popen(cmd, env=env)


async def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode} before it was ready")
            try:
                if (await c.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(1)
    raise SystemExit(f"server not ready after {timeout_s:.0f} s")


async def one(c: Any, url: str, model: str, ids: list[int], n_out: int, t0: float,
              delay: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    start, first, out = time.perf_counter(), None, 0
    body = {"model": model, "prompt": ids, "max_tokens": n_out, "stream": True,
            "ignore_eos": True, "temperature": 0}
    try:
        async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "status": r.status_code}
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    n = len(json.loads(line[6:])["choices"][0]["token_ids"])
                    first = first or (time.perf_counter() if n else None)
                    out += n
    except Exception as exc:  # noqa: BLE001 - count it, keep measuring the others
        return {"ok": False, "error": repr(exc)}
    end = time.perf_counter()
    return {"ok": out == n_out, "prompt": len(ids), "output": out, "start": start, "end": end,
            "ttft": (first or end) - start, "per_token": (end - start) / max(1, out)}


async def run_rate(args: argparse.Namespace, url: str, rate: float) -> dict[str, Any]:
    import httpx

    spec = load_spec(args.model)
    n = max(1, int(rate * args.duration))
    reqs = make_requests(args.workload, args.input_len, args.output_len, n, spec.vocab_size,
                         spec.max_position_embeddings, seed=args.seed)
    poisson_arrivals(reqs, rate, seed=args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as c:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(c, url, args.model, r.prompt_ids,
                                             r.params.max_tokens, t0, r.arrival_s)
                                         for r in reqs))
        wall = time.perf_counter() - t0
        metrics = (await c.get(f"{url}/metrics")).text
    ok = [r for r in results if r["ok"]]
    ttft = np.array([r["ttft"] for r in ok]) if ok else np.zeros(1)
    per_token = np.array([r["per_token"] for r in ok]) if ok else np.zeros(1)
    tokens = sum(r["prompt"] + r["output"] for r in ok)
    return {"rate": rate, "requests": n, "completed": len(ok), "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "output_tokens_per_s": sum(r["output"] for r in ok) / wall,
            "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": float(np.median(ttft)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "normalized_latency_s": float(per_token.mean()),
            "latency_per_token_p99_s": float(np.percentile(per_token, 99)),
            "fallbacks_total": _metric(metrics, "nanosched_fallback_iterations_total"),
            "failures": [r for r in results if not r["ok"]][:5]}


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--schedule", default="auto")
    p.add_argument("--rates", default="4,8,16", help="requests/s, comma-separated")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--workload", default=None, help="sharegpt, lmsys, splitwise (replaces "
                   "--input-len/--output-len)")
    p.add_argument("--dense-batch", type=int, default=None)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    args = p.parse_args()
    if args.workload:
        args.input_len = args.output_len = None
    url = f"http://127.0.0.1:{args.port}"
    proc = start_server(args)
    rows = []
    try:
        asyncio.run(wait_ready(url, proc, timeout_s=900))
        for rate in (float(x) for x in args.rates.split(",")):
            rows.append(asyncio.run(run_rate(args, url, rate)))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "failures"}),
                  flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    path = write_result("serve_poisson", {"env": environment(), "args": vars(args),
                                          "rates": rows})
    print_table(rows, [("rate", "req/s", ".1f"), ("completed", "done", "d"),
                       ("tokens_per_s", "tok/s", ".0f"), ("ttft_mean_s", "TTFT s", ".3f"),
                       ("normalized_latency_s", "s/out tok", ".4f"),
                       ("fallbacks_total", "fallbacks", ".0f")])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
