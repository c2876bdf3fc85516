"""Decode-attention bandwidth against SMs, both Triton kernels, beside a copy ceiling.

    PYTHONPATH=. python bench/kernels/kernels_decode_attn.py [--requests 64,256,640]
        [--contexts 1024,4096,8192]
                                        [--sms 16,32,48] [--sweep] [--kv-dtype auto,fp8]

Llama-3-8B heads (Hq 32, Hkv 8, d 128), bf16, page 16, pages shuffled (`--pages in_order`:
each request's pages consecutive, as a fresh cache hands them out), random data. Each
kernel runs on a green-context partition of about `--sms` SMs (the driver rounds to its 8-SM
granularity; the granted count is reported) with `ctas_per_sm` programs per granted SM, and on
the whole GPU. Bandwidth = K/V bytes read / median time (triton.testing.do_bench); the ceiling
is a device-to-device copy ((read + write) bytes / time) of 4 GiB, measured in the same run.
`triton_paged` is today's kernel (no load pipelining), `triton_pipelined` the deep-pipelined one.
`--kv-dtype fp8` reads an FP8 cache (e4m3 values + one fp32 scale per token and KV head; the
bytes counted are those of values and scales), `auto` a bf16 one; each row names its dtype.

`--sweep` first times every `DecodeConfig` (block, stages, warps, programs per SM, limited by
shared memory) at 256 requests x 4,096 context on each partition and on the whole GPU, checks
each against `triton_paged`'s output, and prints the best; the main table then uses
`--config BN,STAGES,WARPS,CTAS` if given, else the shipped `PIPELINED`. JSON to $OUT or
bench/results/; tables last.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
from pathlib import Path

import torch

from bench._common import (
    copy_bandwidth_gbs,
    environment,
    median_ms,
    places,
    print_table,
    write_result,
)
from nanosched.kernels.common import PAGED, PIPELINED, PIPELINED_2W, DecodeConfig
from nanosched.kernels.reference import quantize_fp8

HQ, HKV, HD, PAGE = 32, 8, 128, 16
SMEM_PER_SM = 227 * 1024  # what an H100/H200 SM offers one or more programs
SMEM_SLACK = 1.25  # the compiler's layout-conversion scratch beside the K/V ring
# cuda_bulk and its variants: the decode_attn_bulk settings each one runs under
BULK = {
    "cuda_bulk": {},
    # a diagnostic: the ring with consumers that read nothing (its copy ceiling; zeros out)
    "cuda_bulk_consume": {"CONSUME_ONLY": True},
    # FP8 on any SM count: one CTA per SM (the whole ring), or two (half of it each)
    "cuda_bulk_1cta": {"FP8_CTAS_PER_SM": 1},
    "cuda_bulk_consume_1cta": {"CONSUME_ONLY": True, "FP8_CTAS_PER_SM": 1},
    "cuda_bulk_2cta": {"FP8_SHARED_MAX_SMS": 1 << 30},
}


class Batch:
    """A paged decode batch: `requests` requests of `context` tokens each."""

    def __init__(self, requests: int, context: int, seed: int = 0,
                 kv_dtype: str = "auto", pages_in_order: bool = False) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        pages_per = math.ceil(context / PAGE)
        pages = requests * pages_per
        self.k = torch.randn(pages, PAGE, HKV, HD, device="cuda", dtype=torch.bfloat16,
                             generator=gen)
        self.v = torch.randn_like(self.k)
        self.scales = {"k_scale": None, "v_scale": None}
        token_bytes = HKV * HD * 2
        if kv_dtype == "fp8":
            self.k, ks = quantize_fp8(self.k)
            self.v, vs = quantize_fp8(self.v)
            self.scales = {"k_scale": ks, "v_scale": vs}
            token_bytes = HKV * (HD + 4)
        order = (torch.arange(pages, device="cuda") if pages_in_order
                 else torch.randperm(pages, device="cuda", generator=gen))
        self.tables = order.int().view(requests, pages_per)
        self.lens = torch.full((requests,), context, dtype=torch.int32, device="cuda")
        self.q = torch.randn(requests, HQ, HD, device="cuda", dtype=torch.bfloat16,
                             generator=gen)
        self.out = torch.empty_like(self.q)
        self.context = context
        self.kv_dtype = kv_dtype
        self.kv_bytes = 2 * requests * context * token_bytes

    def run(self, config: DecodeConfig | str, ctas: int | None = None,
            sms: int | None = None) -> torch.Tensor:
        """One launch of `config`'s Triton kernel on at most `ctas` programs, or of the
        `cuda_bulk` variant it names (BULK) under a bound of `ctas` CTAs or on `sms` SMs (its
        CTAs per SM there: decode_attn_bulk.kernel_and_grid)."""
        if not isinstance(config, DecodeConfig):
            with bulk_variant(config) as bulk:
                bulk.decode_attention(
                    self.q, self.k, self.v, self.tables, self.lens, self.context, HD ** -0.5,
                    self.out, max_ctas=ctas, sms=sms, **self.scales)
            return self.out
        from nanosched.kernels.decode_attn import decode_attention

        decode_attention(self.q, self.k, self.v, self.tables, self.lens, self.context,
                         HD ** -0.5, self.out, max_ctas=ctas, config=config, **self.scales)
        return self.out

    def bulk_grid(self, name: str, ctas: int | None = None, sms: int | None = None) -> int:
        """The grid `run(name, ctas, sms)` launches."""
        with bulk_variant(name) as bulk:
            return bulk.kernel_and_grid(self.q, self.k, self.kv_dtype == "fp8", ctas, sms)[1]


@contextlib.contextmanager
def bulk_variant(name: str):
    """decode_attn_bulk with the settings of the `cuda_bulk` variant `name` (BULK), restored
    after."""
    from nanosched.kernels import decode_attn_bulk

    saved = {k: getattr(decode_attn_bulk, k) for k in BULK[name]}
    for k, v in BULK[name].items():
        setattr(decode_attn_bulk, k, v)
    try:
        yield decode_attn_bulk
    finally:
        for k, v in saved.items():
            setattr(decode_attn_bulk, k, v)


def time_on(batch: Batch, config: DecodeConfig | str, sms: int, stream,
            cta_bound: bool = False) -> dict:
    """`config` on `sms` SMs (its CTAs per SM on each), or under a bound of `sms` CTAs, as the
    dispatcher launches it."""
    if isinstance(config, DecodeConfig):
        launch = {"ctas": config.ctas_per_sm * sms}
        ctas = launch["ctas"]
    else:
        launch = {"ctas": sms} if cta_bound else {"sms": sms}
        ctas = batch.bulk_grid(config, **launch)
    with torch.cuda.stream(stream):
        ms = median_ms(lambda: batch.run(config, **launch))
    return {"ms": ms, "gbs": batch.kv_bytes / ms / 1e6, "ctas": ctas}


def sweep_configs(ok_file: str = "", grid: dict[str, tuple[int, ...]] | None = None,
                  itemsize: int = 2) -> list[DecodeConfig]:
    """Every configuration of `grid` (block_n, stages, warps, ctas_per_sm values) whose K/V ring
    fits `ctas_per_sm` times in an SM; only those that bench/kernels/decode_config_check.py passed
    when `ok_file` (its output) is given."""
    grid = grid or SWEEP_GRID
    kernels = list(itertools.product(grid["block_n"], grid["stages"], grid["warps"]))
    if ok_file:
        passed = {tuple(c) for c in json.loads(Path(ok_file).read_text())}
        kernels = [k for k in kernels if k in passed]
    out = []
    for bn, stages, warps in kernels:
        for cps in grid["ctas_per_sm"]:
            cfg = DecodeConfig(bn, stages, warps, cps)
            if cfg.smem_bytes(HD, itemsize) * SMEM_SLACK * cps <= SMEM_PER_SM:
                out.append(cfg)
    return out


SWEEP_GRID = {"block_n": (32, 64, 128), "stages": (2, 3, 4, 5), "warps": (4, 8),
              "ctas_per_sm": (1, 2, 3, 4)}


def parse_grid(text: str) -> dict[str, tuple[int, ...]]:
    """'block_n=16,32;warps=1,2' -> the sweep grid with those axes replaced."""
    grid = dict(SWEEP_GRID)
    for part in filter(None, text.split(";")):
        key, _, values = part.partition("=")
        if key not in grid:
            raise SystemExit(f"--sweep-grid: unknown axis {key!r}; axes: {sorted(grid)}")
        grid[key] = tuple(int(v) for v in values.split(","))
    return grid


def sweep(where: list, copy_gbs: float, ok_file: str, grid: dict[str, tuple[int, ...]],
          kv_dtype: str) -> tuple[list[dict], DecodeConfig]:
    batch = Batch(256, 4096, kv_dtype=kv_dtype)
    want = batch.run(PAGED, 1024).clone()
    rows = []
    for cfg in sweep_configs(ok_file, grid, 1 if kv_dtype == "fp8" else 2):
        print(f"sweep: {cfg}", flush=True)  # an illegal address is reported asynchronously
        err = ((batch.run(cfg, 264).float() - want.float()).norm() / want.float().norm()).item()
        for sms, stream, _ in where:
            r = time_on(batch, cfg, sms, stream)
            rows.append({"block_n": cfg.block_n, "stages": cfg.num_stages,
                         "warps": cfg.num_warps, "ctas_per_sm": cfg.ctas_per_sm, "sms": sms,
                         "kv_dtype": kv_dtype,
                         "rel_err": err, **r, "pct_of_copy": 100 * r["gbs"] / copy_gbs})
    small = sorted({r["sms"] for r in rows})[:-1]

    def score(cfg_rows: list[dict]) -> float:  # worst share of copy over the small partitions
        return min(r["pct_of_copy"] for r in cfg_rows if r["sms"] in small)

    by_cfg: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["rel_err"] < 2e-2:
            by_cfg.setdefault((r["block_n"], r["stages"], r["warps"], r["ctas_per_sm"]),
                              []).append(r)
    best = max(by_cfg, key=lambda k: score(by_cfg[k]))
    return rows, DecodeConfig(*best)


def print_sweep(rows: list[dict]) -> None:
    top = sorted(rows, key=lambda r: -r["pct_of_copy"])
    for sms in sorted({r["sms"] for r in rows}):
        print_table([r for r in top if r["sms"] == sms][:8],
                    [(k, k, "") for k in ("block_n", "stages", "warps", "ctas_per_sm", "sms")]
                    + [("gbs", "GB/s", ".0f"), ("pct_of_copy", "% copy", ".1f"),
                       ("rel_err", "err", ".1e")])


def table(where: list, configs: dict[str, DecodeConfig | str], requests: list[int],
          contexts: list[int], copy_gbs: float, kv_dtypes: list[str],
          page_orders: tuple[str, ...] = ("shuffled",)) -> list[dict]:
    """Each kernel at each place of `where` ((SMs, stream, pair, place): a green-context
    partition, a CTA bound of that many programs on the whole GPU, or all SMs, last);
    `rel_err`: its output against triton_pipelined's on the whole GPU (None for the
    consume-only diagnostic)."""
    rows = []
    for n, ctx, kv_dtype, order in itertools.product(requests, contexts, kv_dtypes, page_orders):
        batch = Batch(n, ctx, kv_dtype=kv_dtype, pages_in_order=order == "in_order")
        want = batch.run(PIPELINED, PIPELINED.ctas_per_sm * where[-1][0]).float()
        for name, cfg in configs.items():
            err = None
            if not (isinstance(cfg, str) and BULK[cfg].get("CONSUME_ONLY")):
                got = (batch.run(cfg, where[-1][0]) if isinstance(cfg, DecodeConfig)
                       else batch.run(cfg, sms=where[-1][0])).float()
                err = ((got - want).norm() / want.norm()).item()
            for sms, stream, _, place in where:
                r = time_on(batch, cfg, sms, stream, place == "cta")
                rows.append({"kernel": name, "kv_dtype": kv_dtype, "requests": n,
                             "context": ctx, "pages": order, "sms": sms, "place": place, **r,
                             "pct_of_copy": 100 * r["gbs"] / copy_gbs, "rel_err": err})
        del batch
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="64,256,640")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--sms", default="16,32,48")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--config", default="", help="BN,STAGES,WARPS,CTAS_PER_SM")
    ap.add_argument("--ok-file", default="", help="bench/kernels/decode_config_check.py --ok-file")
    ap.add_argument("--kv-dtype", default="auto", help="auto (bf16), fp8, or both: auto,fp8")
    ap.add_argument("--kernels", default="triton_pipelined,triton_pipelined_2w,cuda_bulk",
                    help="any of triton_paged, triton_pipelined, triton_pipelined_2w, cuda_bulk, "
                    "cuda_bulk_consume (a diagnostic: cuda_bulk's copies alone, its consumers "
                    "reading nothing)")
    ap.add_argument("--pages", default="shuffled", help="page order of the block tables: "
                    "shuffled (a long-running cache), in_order (a fresh one), or both")
    ap.add_argument("--cta-bound", action="store_true", help="also each --sms count as a "
                    "bound on the programs on the whole GPU (no partition): the hardware then "
                    "spreads them over the GPCs, where a green context takes its SMs together")
    ap.add_argument("--sweep-grid", default="", help="axes of the sweep to replace, e.g. "
                    "'block_n=16,32;warps=1,2;ctas_per_sm=4,8'")
    args = ap.parse_args()
    env = environment()
    copy_gbs = copy_bandwidth_gbs()
    where = places([int(s) for s in args.sms.split(",")])
    sweep_rows, pipelined = [], PIPELINED
    if args.sweep:
        sweep_rows, pipelined = sweep(where, copy_gbs, args.ok_file, parse_grid(args.sweep_grid),
                                      args.kv_dtype.split(",")[0])
        print_sweep(sweep_rows)  # before the table: a configuration may fail on its shapes
        write_result("kernels_decode_attn_sweep", {"env": env, "copy_gbs": copy_gbs,
                                                   "grid": args.sweep_grid, "rows": sweep_rows})
    if args.config:
        pipelined = DecodeConfig(*(int(x) for x in args.config.split(",")))
    known = {"triton_paged": PAGED, "triton_pipelined": pipelined,
             "triton_pipelined_2w": PIPELINED_2W, **{k: k for k in BULK}}
    configs = {k: known[k] for k in args.kernels.split(",")}
    spots = [(sms, st, pair, "green" if pair is not None else "all")
             for sms, st, pair in where]
    if args.cta_bound:
        spots[-1:-1] = [(sms, torch.cuda.current_stream(), None, "cta")
                        for sms, _, pair in where if pair is not None]
    rows = table(spots, configs, [int(x) for x in args.requests.split(",")],
                 [int(x) for x in args.contexts.split(",")], copy_gbs, args.kv_dtype.split(","),
                 tuple(args.pages.split(",")))
    path = write_result("kernels_decode_attn", {
        "env": env, "copy_gbs": copy_gbs,
        "configs": {k: vars(v) if isinstance(v, DecodeConfig) else k
                    for k, v in configs.items()},
        "shapes": {"num_heads": HQ, "num_kv_heads": HKV, "head_dim": HD, "page_size": PAGE,
                   "dtype": "bfloat16", "kv_dtypes": args.kv_dtype.split(",")},
        "sweep": sweep_rows, "rows": rows})
    print(f"{env['device']}: copy {copy_gbs:.0f} GB/s; pipelined config {pipelined}; {path}")
    summary, errs = {}, {}
    for r in rows:
        key = (r["kernel"], r["kv_dtype"], r["pages"], r["sms"], r["place"])
        summary.setdefault(key, []).append(r["pct_of_copy"])
        errs.setdefault(key, []).append(r["rel_err"] if r["rel_err"] is not None else math.nan)
    print_table([{"kernel": k, "kv": kv, "pages": pg, "sms": s, "place": pl, "min": min(v),
                  "max": max(v), "err": max(errs[(k, kv, pg, s, pl)])}
                 for (k, kv, pg, s, pl), v in sorted(summary.items())],
                [("kernel", "kernel", ""), ("kv", "KV", ""), ("pages", "pages", ""),
                 ("sms", "SMs", ""), ("place", "place", ""),
                 ("min", "min % copy", ".1f"), ("max", "max % copy", ".1f"),
                 ("err", "max err vs triton", ".1e")])
    if len(set(args.kv_dtype.split(","))) > 1 and "," not in args.pages:  # fp8 against bf16
        times = {(r["kernel"], r["kv_dtype"], r["requests"], r["context"], r["sms"]): r["ms"]
                 for r in rows if r["place"] != "cta"}
        print_table([{"kernel": k, "requests": n, "context": c, "sms": s,
                      "bf16": t * 1e3, "fp8": times[(k, "fp8", n, c, s)] * 1e3,
                      "speedup": t / times[(k, "fp8", n, c, s)]}
                     for (k, kv, n, c, s), t in sorted(times.items()) if kv == "auto"],
                    [("kernel", "kernel", ""), ("requests", "req", ""), ("context", "ctx", ""),
                     ("sms", "SMs", ""), ("bf16", "bf16 us", ".0f"), ("fp8", "fp8 us", ".0f"),
                     ("speedup", "x", ".2f")])
    for _, _, pair in where:
        if pair is not None:
            pair.close()


if __name__ == "__main__":
    main()
