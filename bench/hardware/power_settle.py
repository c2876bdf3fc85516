"""How long the SM clock takes to settle under the power cap, alone and co-running.

    PYTHONPATH=. python bench/hardware/power_settle.py [--seconds 4] [--idle 3]

Each case starts from an idle GPU (`--idle` seconds of nothing), then loops its kernels back to
back for `--seconds` (profiler.timing.sustained_run) while NVML samples the SM clock and board
power every 5 ms (profiler.telemetry). Cases, at Llama-3-8B shapes: the `ug` GEMM (2,048 x 4,096
x 28,672, cuBLAS) on all SMs; the pipelined decode attention (256 requests x 4,096 context) on
all SMs; and the two side by side on disjoint green-context partitions (GEMM on the rest,
attention on 16 and on 32 SMs). Per case: the series in 50 ms bins (clock, power, each kernel's
time relative to its last second), and the settle time: the first bin from which the clock and
kernel times, averaged over the next second, stay within 3% of their means over the last two
seconds.
The profiler's pair windows are sized from these. JSON to $OUT or bench/results/; a table last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench._common import environment, print_table, write_result
from nanosched.profiler.telemetry import Telemetry
from nanosched.profiler.timing import sustained_run

BIN_MS = 50.0
SMOOTH_MS = 1000.0
TOLERANCE = 0.03
HQ, HKV, HD, PAGE = 32, 8, 128, 16


def gemm_fn(tokens: int = 2048, k: int = 4096, n: int = 28672):
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    out = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.mm(x, w.t(), out=out)


def attention_fn(requests: int, context: int, ctas: int):
    from nanosched.kernels.common import PIPELINED
    from nanosched.kernels.decode_attn import decode_attention

    pages = requests * context // PAGE
    k = torch.randn(pages, PAGE, HKV, HD, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(pages, device="cuda").int().view(requests, -1)
    lens = torch.full((requests,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(requests, HQ, HD, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    return lambda: decode_attention(q, k, v, tables, lens, context, HD ** -0.5, out,
                                    max_ctas=ctas, config=PIPELINED)


def bins(series: list[tuple[float, float]], lo_ms: float, hi_ms: float) -> list[float | None]:
    """Median kernel time per BIN_MS bin of GPU time (None: no launch started in it)."""
    out = []
    t = lo_ms
    while t < hi_ms:
        inside = [us for start, us in series if t <= start < t + BIN_MS]
        out.append(statistics.median(inside) if inside else None)
        t += BIN_MS
    return out


def settle_ms(values: list[list[float | None]]) -> float:
    """First bin time from which every series, averaged over the next SMOOTH_MS, stays within
    TOLERANCE of its mean over the last two seconds. Under the cap the clock falls to its
    regulated level within a few hundred ms, then ripples with a period of about a second
    (dips of 10-45% for about 150 ms); the one-second average follows the level, not the
    ripple, and a profile window of a second averages the ripple out."""
    width, last = int(SMOOTH_MS / BIN_MS), int(2000 / BIN_MS)
    smooth = [[statistics.fmean(w) if (w := [x for x in v[i:i + width] if x is not None])
               else None for i in range(len(v) - width + 1)] for v in values]
    finals = [statistics.fmean([x for x in v[-last:] if x is not None]) for v in values]
    first_ok = 0
    for i in range(len(smooth[0])):
        ok = all(s[i] is None or abs(s[i] / f - 1) <= TOLERANCE
                 for s, f in zip(smooth, finals, strict=True))
        if not ok:
            first_ok = i + 1
    return first_ok * BIN_MS


def run_case(name: str, work: list, tele: Telemetry, seconds: float, idle: float) -> dict:
    torch.cuda.synchronize()
    time.sleep(idle)
    res = sustained_run(work, torch.device("cuda"), settle_s=0.0, window_s=seconds)
    lo, hi = res.window_ms
    host0 = res.host_window[0] - lo / 1e3
    kernel_bins = [bins(s, 0.0, hi) for s in res.series]
    clock_bins, power_bins = [], []
    for i in range(len(kernel_bins[0])):
        r = tele.reading(host0 + i * BIN_MS / 1e3, host0 + (i + 1) * BIN_MS / 1e3)
        clock_bins.append(r.clock_mhz if r else None)
        power_bins.append(r.power_w if r else None)
    last = tele.reading(host0 + hi / 1e3 - 1.0, host0 + hi / 1e3)
    first = tele.reading(host0, host0 + 0.1)
    return {"case": name, "settle_ms": settle_ms([clock_bins, *kernel_bins]),
            "first_100ms": first.to_json() if first else None,
            "last_second": last.to_json() if last else None,
            "kernel_us_last_second": [statistics.median([us for t, us in s if t > hi - 1e3])
                                      for s in res.series],
            "kernel_us_first_100ms": [statistics.median([us for t, us in s if t < 100] or [0])
                                      for s in res.series],
            "bins": {"ms": BIN_MS, "clock_mhz": clock_bins, "power_w": power_bins,
                     "kernel_us": kernel_bins}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--idle", type=float, default=3.0)
    args = ap.parse_args()
    from nanosched.greenctx import split_sms

    env = environment()
    tele = Telemetry(0).start()
    dev = torch.device("cuda")
    gemm = gemm_fn()
    attn_full = attention_fn(256, 4096, 2 * env["num_sms"])
    main_stream = torch.cuda.current_stream()
    cases = [run_case("gemm_all_sms", [(gemm, main_stream, 1500.0)], tele, args.seconds,
                      args.idle),
             run_case("attention_all_sms", [(attn_full, main_stream, 1500.0)], tele,
                      args.seconds, args.idle)]
    lo, hi = torch.cuda.Stream.priority_range()
    for small in (16, 32):
        pair = split_sms(0, small, small_priority=hi, rest_priority=lo)
        attn = attention_fn(256, 4096, 2 * pair.small.sms)
        cases.append(run_case(f"gemm_{pair.rest.sms}sms+attention_{pair.small.sms}sms",
                              [(gemm, pair.rest.stream, 2000.0),
                               (attn, pair.small.stream, 3000.0)],
                              tele, args.seconds, args.idle))
        torch.cuda.synchronize(dev)
        pair.close()
    tele.stop()
    path = write_result("power_settle", {"env": env, "power_source": tele.power_source,
                                         "tolerance": TOLERANCE, "cases": cases})
    print(f"results in {path}")
    rows = [{"case": c["case"], "settle_ms": c["settle_ms"],
             "clock0": (c["first_100ms"] or {}).get("clock_mhz", 0),
             "clock": (c["last_second"] or {}).get("clock_mhz", 0),
             "power": (c["last_second"] or {}).get("power_w", 0),
             "us0": "/".join(f"{x:.0f}" for x in c["kernel_us_first_100ms"]),
             "us": "/".join(f"{x:.0f}" for x in c["kernel_us_last_second"])} for c in cases]
    print_table(rows, [("case", "case", ""), ("settle_ms", "settle ms", ".0f"),
                       ("clock0", "MHz first 0.1 s", ".0f"), ("clock", "MHz last 1 s", ".0f"),
                       ("power", "W last 1 s", ".0f"), ("us0", "us first 0.1 s", ""),
                       ("us", "us last 1 s", "")])


if __name__ == "__main__":
    main()
