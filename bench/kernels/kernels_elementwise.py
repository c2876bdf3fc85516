"""Elementwise-op bandwidth against the SMs they are given, beside a copy ceiling.

    PYTHONPATH=. python bench/kernels/kernels_elementwise.py [--rows 128,256,512,1024,2048]
        [--sms 16,32,48,64]
                                        [--ctas 16,32,64,132] [--per-sm 1,2,4,8,16]
                                        [--baseline FILE]

The three elementwise ops of a Llama-3-8B layer (hidden 4096, intermediate 14336, 32 q / 8 KV
heads of 128; bf16, random data): `rms_norm_add` (residual updated in place, as the model does),
`silu_mul`, and `rope_append` writing a paged cache (page 16, random slots of a cache four
times the rows) in bf16 (`rope_append`) or e4m3 with per-(token, KV head) scales
(`rope_append_fp8`). Each runs with the grid bound the dispatcher derives from the runtime's
launch dict (kernels/impls.py `elementwise_ctas`):
- on a green-context partition of about each `--sms` (the driver rounds to its granularity;
  the granted count is reported): `num_sms` = the partition's SMs, so the kernel's programs per
  SM (`ELEMENTWISE_CTAS_PER_SM`) times those;
- on all SMs: `max_ctas` = each of `--ctas` (a schedule's `cta_bound`), `num_sms` = all SMs,
  and unbounded (one program per work item).
Bandwidth = bytes read + written / median GPU time (nanosched.profiler.timing.bench_us: L2
flushed before each launch, the launches queued behind a GPU sleep, so the CPU's launch time is
not counted: these kernels take microseconds, and timed by do_bench on all SMs rope_append's
launch time showed in its figures); the ceiling is a device-to-device copy ((read + write) /
time, do_bench) measured in the same run on all SMs (4 GiB) and on each partition (1 GiB). Also
measured: each kernel with the other prefetch setting than its default (elementwise.PREFETCH:
whether a program loads its next item before it stores the current one) at two row counts,
programs per SM 1..16 (`--per-sm`) at the largest row count on each partition and on all SMs,
and with `--baseline FILE` (an elementwise.py from before the bounded grid) those kernels on all
SMs. JSON to $OUT or bench/results/; the summary table last.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from bench._common import (
    copy_bandwidth_gbs,
    environment,
    places,
    print_table,
    write_result,
)
from nanosched.kernels import impls
from nanosched.profiler.timing import bench_us

HID, INTER, HQ, HKV, HD, PAGE, MAX_POS = 4096, 14336, 32, 8, 128, 16, 8192
BF16 = torch.bfloat16
DEVICE = "cuda"
OPS = ("rms_norm_add", "silu_mul", "rope_append", "rope_append_fp8")


class OpCase:
    """One op's tensors at `rows` tokens, its work items and the bytes it reads and writes."""

    def __init__(self, op: str, rows: int) -> None:
        from nanosched.kernels.elementwise import SILU_BLOCK

        self.op, self.rows = op, rows
        self.kernel = "rope_append" if op.startswith("rope") else op
        self.kwargs: dict[str, Any] = {}
        randn = lambda *shape: torch.randn(shape, device=DEVICE, dtype=BF16)  # noqa: E731
        if op == "rms_norm_add":
            x, res, w = randn(rows, HID), randn(rows, HID), randn(HID)
            self.args: tuple = (x, res, w, 1e-5, torch.empty_like(x), res)
            self.items, self.nbytes = rows, 4 * rows * HID * 2 + HID * 2
        elif op == "silu_mul":
            self.args = (randn(rows, 2 * INTER), torch.empty(rows, INTER, dtype=BF16,
                                                             device=DEVICE))
            self.items = rows * math.ceil(INTER / min(SILU_BLOCK, INTER))
            self.nbytes = 3 * rows * INTER * 2
        else:
            fp8 = op.endswith("fp8")
            pages = 4 * rows // PAGE
            cache = torch.zeros(pages, PAGE, HKV, HD, device=DEVICE,
                                dtype=torch.float8_e4m3fn if fp8 else BF16)
            if fp8:
                self.kwargs = {"k_scale": torch.zeros(pages, PAGE, HKV, device=DEVICE),
                               "v_scale": torch.zeros(pages, PAGE, HKV, device=DEVICE)}
            tables = torch.rand(MAX_POS, HD // 2, device=DEVICE)
            self.args = (randn(rows, (HQ + 2 * HKV) * HD),
                         torch.randint(0, MAX_POS, (rows,), device=DEVICE), tables, tables.clone(),
                         torch.randperm(pages * PAGE, device=DEVICE)[:rows], cache,
                         torch.zeros_like(cache), torch.empty(rows, HQ, HD, dtype=BF16,
                                                              device=DEVICE))
            kv_bytes = 2 * rows * HKV * (HD * cache.element_size() + (4 if fp8 else 0))
            # qkv, positions and slots, cos and sin rows read; q and the cache written
            self.items = rows
            self.nbytes = (rows * (HQ + 2 * HKV) * HD * 2 + 16 * rows + 2 * rows * HD // 2 * 4
                           + rows * HQ * HD * 2 + kv_bytes)
        torch.cuda.synchronize()  # made on the default stream, timed on others

    def fn(self, module: ModuleType) -> Callable[..., None]:
        """A launch of this op through `module`'s kernel (keyword arguments: the bounds)."""
        kernel = getattr(module, self.kernel)
        return lambda **kw: kernel(*self.args, **self.kwargs, **kw)


def time_gbs(case: OpCase, fn: Callable[..., None], stream: Any, **kw: Any) -> dict[str, float]:
    """Median GPU time of one launch on `stream` and the bandwidth it gives."""
    with torch.cuda.stream(stream):
        ms = bench_us(lambda: fn(**kw), torch.device(DEVICE), rep_ms=20) / 1e3
    return {"ms": ms, "gbs": case.nbytes / ms / 1e6}


def launches(sms: int, is_partition: bool, ctas: list[int]) -> list[tuple[str, dict]]:
    """(label, launch dict) of each way the runtime gives an op these SMs."""
    if is_partition:
        return [(f"partition {sms}", {"impl": "triton", "num_sms": sms, "partition": True})]
    return ([(f"max_ctas {c}", {"impl": "triton", "max_ctas": c}) for c in ctas]
            + [(f"num_sms {sms}", {"impl": "triton", "num_sms": sms}),
               ("unbounded", {"impl": "triton"})])


class Recorder:
    """Times launches and keeps one row per timing, with its shares of the copy ceilings."""

    def __init__(self, copy_gbs: float, copies: dict[int, float]) -> None:
        self.copy_gbs, self.copies, self.rows = copy_gbs, copies, []

    def time(self, case: OpCase, fn: Callable[..., None], kind: str, place: str, sms: int,
             stream: Any, programs: int | None, **kw: Any) -> None:
        from nanosched.kernels.elementwise import PREFETCH

        r = time_gbs(case, fn, stream, **kw)
        prefetch = kw.get("prefetch", PREFETCH[case.kernel] if kind != "before" else False)
        self.rows.append({"op": case.op, "rows": case.rows, "kind": kind, "place": place,
                          "sms": sms, "programs": programs, "prefetch": prefetch,
                          **r, "pct_of_copy": 100 * r["gbs"] / self.copy_gbs,
                          "pct_of_place_copy": 100 * r["gbs"] / self.copies[sms]})


def measure_case(rec: Recorder, case: OpCase, where: list, ctas: list[int], per_sm: list[int],
                 prefetch: bool, sweep: bool, baseline: ModuleType | None) -> None:
    """Every place and launch of one op at one row count (the other prefetch setting too when
    `prefetch`, the programs-per-SM sweep when `sweep`, the baseline's kernel on all SMs)."""
    from nanosched.kernels import elementwise
    from nanosched.kernels.elementwise import PREFETCH, num_programs

    fn = case.fn(elementwise)
    for sms, stream, pair in where:
        for label, launch in launches(sms, pair is not None, ctas):
            bound = impls.elementwise_ctas(impls.read_launch(launch), case.kernel)
            programs = num_programs(case.items, bound)
            rec.time(case, fn, "launch", label, sms, stream, programs, max_ctas=bound)
            if prefetch:
                rec.time(case, fn, "other_prefetch", label, sms, stream, programs,
                         max_ctas=bound, prefetch=not PREFETCH[case.kernel])
        for k in per_sm if sweep else []:
            rec.time(case, fn, "per_sm", f"{k} per SM on {sms}", sms, stream,
                     num_programs(case.items, k * sms), max_ctas=k * sms)
    if baseline is not None:
        sms, stream, _ = where[-1]
        rec.time(case, case.fn(baseline), "before", "before", sms, stream, None)


def load_baseline(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("elementwise_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summary(rows: list[dict], kind: str, at_rows: int) -> list[dict]:
    """One line per place: each op's GB/s and share of the all-SM copy at `at_rows` rows."""
    lines: dict[str, dict] = {}
    for r in rows:
        if r["kind"] == kind and r["rows"] == at_rows:
            line = lines.setdefault(r["place"], {"place": r["place"], "sms": r["sms"],
                                                 "programs": r["programs"]})
            line[r["op"]] = f"{r['gbs']:.0f} ({r['pct_of_copy']:.0f}%)"
    return list(lines.values())


def print_summary(rows: list[dict], kind: str, at_rows: int) -> None:
    print(f"\n{kind} at {at_rows} rows: GB/s (% of the all-SM copy); programs of rms_norm_add")
    print_table(summary(rows, kind, at_rows),
                [("place", "place", ""), ("sms", "SMs", ""), ("programs", "programs", "")]
                + [(op, op, "") for op in OPS])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="128,256,512,1024,2048")
    ap.add_argument("--sms", default="16,32,48,64")
    ap.add_argument("--ctas", default="16,32,64,132")
    ap.add_argument("--per-sm", default="1,2,4,8,16")
    ap.add_argument("--baseline", default="", help="an elementwise.py to time unbounded too")
    args = ap.parse_args()
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    rows_list, ctas, per_sm = ints(args.rows), ints(args.ctas), ints(args.per_sm)
    env = environment()
    copy_gbs = copy_bandwidth_gbs()
    where = places(ints(args.sms))
    copies = {sms: copy_gbs for sms, _, pair in where if pair is None}
    for sms, stream, pair in where:
        if pair is not None:
            with torch.cuda.stream(stream):
                copies[sms] = copy_bandwidth_gbs(2**30)
    baseline = load_baseline(args.baseline) if args.baseline else None
    prefetch_rows = {rows_list[len(rows_list) // 2], max(rows_list)}
    rec = Recorder(copy_gbs, copies)
    try:
        for op in OPS:
            for n in rows_list:
                measure_case(rec, OpCase(op, n), where, ctas, per_sm, n in prefetch_rows,
                             n == max(rows_list), baseline)
                torch.cuda.empty_cache()
    finally:
        for _, _, pair in where:
            if pair is not None:
                pair.close()
    path = write_result("kernels_elementwise", {
        "env": env, "copy_gbs": copy_gbs, "copy_gbs_by_sms": copies,
        "ctas_per_sm": impls.ELEMENTWISE_CTAS_PER_SM,
        "shapes": {"hidden": HID, "intermediate": INTER, "num_heads": HQ, "num_kv_heads": HKV,
                   "head_dim": HD, "page_size": PAGE, "dtype": "bfloat16"},
        "baseline": args.baseline, "rows": rec.rows})
    big = max(rows_list)
    for kind, at in (("per_sm", big), ("other_prefetch", big), ("before", big)):
        if any(r["kind"] == kind for r in rec.rows):
            print_summary(rec.rows, kind, at)
    print(f"\n{env['device']}: copy {copy_gbs:.0f} GB/s on all SMs; on partitions "
          + ", ".join(f"{s} SMs {g:.0f}" for s, g in sorted(copies.items())) + f"; {path}")
    for at in sorted({min(rows_list), big}):
        print_summary(rec.rows, "launch", at)


if __name__ == "__main__":
    main()
