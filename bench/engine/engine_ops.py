"""GPU time of each op inside the engine's own forwards while it serves, against the rows.

    PYTHONPATH=. python bench/engine/engine_ops.py --profile llama3-8b-tp1-h100-fp8
        [--kv-cache-dtype fp8] [--quantization fp8]
        [--input-len 1024] [--output-len 512] [--num-prompts 400] [--dense-batch 1024]
        [--skip 400] [--trace 24]

The engine serves a fixed-length workload as `nanosched bench` does (Llama-3-8B, random weights,
Sequential, CUDA graphs on, the async loop); after `--skip` iterations (the steady state, the
clock long settled under the power cap) the next `--trace` iterations are traced by CUPTI
(torch.profiler), a marker kernel queued after each so that the trace splits into iterations
without synchronising the loop. Each iteration's kernels are attributed to the layer's ops
(`kernel_trace`: embedding and metadata writes before the first GEMM, the LM head, and
sampling after the last layer); per op the median over the 32 layers, beside the profile's row at
the iteration's own batch: its graph bucket's rows (what the kernels run), its decode rows' mean
context, its longest prompt chunk's end (`_common.row_us`, as bench/analysis/price_run.py prices a
run and a schedule set prices its keys). NVML clock and power over the traced window.

Beside them, the GPU time between the layers' kernels (`kernel_trace.layer_gaps`), which no
row holds: each row times its kernel alone.

What the search's Sequential prediction misses for the engine's forwards shows per op. GPU only;
JSON to $OUT or bench/results/; table last.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from bench._common import (
    batch_mix,
    context_clamp,
    environment,
    print_table,
    row_us,
    write_result,
)
from bench.engine.kernel_trace import (
    TracedKernel,
    attribute,
    cuda_kernels,
    layer_gaps,
)
from nanosched.autosearch.simulate import sequential_op_times
from nanosched.models.spec import load_spec
from nanosched.profiler.catalog import load_named_profile
from nanosched.profiler.telemetry import open_telemetry
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.loader import load_engine
from nanosched.runtime.requests import make_requests
from nanosched.schedules.format import BatchInfo

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: one between traced iterations
MARKER_CYCLES = 2000


def split_iterations(kernels: list[TracedKernel]) -> list[list[TracedKernel]]:
    """The traced kernels cut at each marker (markers dropped); the part after the last marker
    (nothing, as the trace ends on one) is left out."""
    out, cur = [], []
    for k in sorted(kernels, key=lambda k: k.start_us):
        if MARKER in k.name:
            out.append(cur)
            cur = []
        else:
            cur.append(k)
    return out


def batch_shape(batch: Any, bucket: Any) -> dict[str, Any]:
    """The iteration's batch (`_common.batch_mix`) and the graph bucket its kernels run (rows
    padded)."""
    return {**batch_mix(batch)._asdict(), "bucket_decode": bucket.num_decode,
            "bucket_tokens": bucket.num_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--profile", required=True, help="a shipped profile's name or a file")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default="none", help="layer weights: none or fp8 (W8A8)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=400)
    ap.add_argument("--dense-batch", type=int, default=1024)
    ap.add_argument("--skip", type=int, default=400, help="iterations served before tracing")
    ap.add_argument("--trace", type=int, default=24, help="iterations traced")
    args = ap.parse_args()
    prof = load_named_profile(args.profile)
    within = context_clamp(prof)  # a quick profile's prefill is at one prompt length
    cfg = EngineConfig(model=args.model, weights="random", schedule="sequential",
                       dense_batch=args.dense_batch, kv_dtype=args.kv_cache_dtype, graphs="on",
                       quantization=args.quantization)
    spec = load_spec(args.model)
    reqs = make_requests(None, args.input_len, args.output_len, args.num_prompts,
                         spec.vocab_size, spec.max_position_embeddings)
    loaded = load_engine(cfg, requests=reqs)
    engine = loaded.engine
    formed: list[Any] = []  # (batch, its graph bucket) of each iteration
    form, bucket_of = engine.scheduler.form, engine.graphs.bucket

    def spy_form(now: float) -> Any:
        formed.append([form(now), None])
        return formed[-1][0]

    def spy_bucket(seqs: Any) -> Any:
        formed[-1][1] = bucket_of(seqs)
        return formed[-1][1]

    engine.scheduler.form, engine.graphs.bucket = spy_form, spy_bucket
    tele = open_telemetry(0)
    with loaded, torch.inference_mode():
        for r in reqs:
            engine.add_request(r)
        engine.t0 = time.perf_counter()
        served = 0
        while engine.has_work and served < args.skip:
            engine.step()
            served += 1
        shapes = []
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
            for _ in range(args.trace):
                if not engine.has_work:
                    break
                n = len(formed)
                engine.step()
                torch.cuda._sleep(MARKER_CYCLES)
                batch, bucket = formed[-1] if len(formed) > n else (None, None)
                shapes.append(batch_shape(batch, bucket) if bucket is not None else None)
            torch.cuda.synchronize()
        window = (tele.reading(t0, time.perf_counter()) if tele else None)

        iters = []
        per_shape: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
        for shape, ks in zip(shapes, split_iterations(cuda_kernels(trace)), strict=False):
            if shape is None or not ks:
                continue
            att = attribute(ks, spec.num_layers)
            if isinstance(att, str):
                print(f"not attributed: {att}")
                continue
            bucket_t = shape["bucket_tokens"]
            batch = BatchInfo(bucket_t, shape["bucket_decode"],
                              max(1, shape["prompt_end"] or args.input_len),
                              shape["decode_context"] or 1.0, 0.0)
            rows = sequential_op_times(spec, 1, prof, batch,
                                       lambda op, n, c: row_us(prof, op, n, within(op, c)))
            med = att.median_us()
            span = ks[-1].start_us + ks[-1].duration_us - ks[0].start_us
            layer_kernels = sum(sum(layer.values()) for layer in att.per_layer)
            gaps, count = layer_gaps(ks, spec.num_layers)
            it = {**shape, "ops_us": med, "rows_us": rows,
                  "layers_us": layer_kernels, "rows_layers_us": sum(rows.values())
                  * spec.num_layers, "embed_us": att.embed_us, "lm_head_us": att.lm_head_us,
                  "kernels_us": sum(k.duration_us for k in ks), "span_us": span,
                  "layer_gaps_us": gaps, "layer_kernels": count}
            iters.append(it)
            per_shape[(shape["bucket_decode"], bucket_t)].append(it)
        if tele is not None:
            tele.stop()
        if not per_shape:
            raise SystemExit("no traced iteration could be attributed")
        top, its = max(per_shape.items(), key=lambda kv: len(kv[1]))

    ops = sorted({op for it in its for op in it["rows_us"]} | {op for it in its
                                                                 for op in it["ops_us"]})
    table = []
    for op in ops:
        row = statistics.median(it["rows_us"].get(op, 0.0) for it in its)
        got = statistics.median(it["ops_us"].get(op, 0.0) for it in its)
        table.append({"op": op, "rows_us": row, "engine_us": got,
                      "ratio": got / row if row else float("nan")})
    summary = {
        "shape": list(top), "iterations": len(its),
        "decode_context": statistics.fmean(it["decode_context"] for it in its),
        "rows_layers_ms": statistics.median(it["rows_layers_us"] for it in its) / 1e3,
        "engine_layers_ms": statistics.median(it["layers_us"] for it in its) / 1e3,
        "engine_span_ms": statistics.median(it["span_us"] for it in its) / 1e3,
        "embed_us": statistics.median(it["embed_us"] for it in its),
        "lm_head_us": statistics.median(it["lm_head_us"] for it in its),
        "layer_gaps_us": statistics.median(it["layer_gaps_us"] for it in its),
        "layer_kernels": statistics.median(it["layer_kernels"] for it in its)}
    shape_counts = {f"{d},{t}": len(v) for (d, t), v in per_shape.items()}
    path = write_result("engine_ops", {
        "env": environment(), "args": vars(args), "clock": window.to_json() if window else None,
        "profile": args.profile, "profile_gpu": prof.identity.gpu_name, "iterations": iters,
        "shape_counts": shape_counts,
        "summary": summary, "ops": table})
    print(path)
    w = window.to_json() if window else {}
    print(f"traced {len(iters)} iterations at {w.get('clock_mhz', '?')} MHz, "
          f"{w.get('power_w', '?')} W; iterations per (decode, rows) bucket {shape_counts}")
    s = summary
    print(f"shape {tuple(top)} ({s['iterations']} iterations, decode context "
          f"{s['decode_context']:.0f}): layers {s['engine_layers_ms']:.2f} ms in the engine "
          f"against {s['rows_layers_ms']:.2f} by the rows; iteration span "
          f"{s['engine_span_ms']:.2f} ms (embedding {s['embed_us']:.0f} us, LM head "
          f"{s['lm_head_us']:.0f} us); {s['layer_gaps_us'] / 1e3:.2f} ms between the layers' "
          f"{s['layer_kernels']:.0f} kernels")
    print_table(table, [("op", "op", ""), ("rows_us", "row us", ".1f"),
                        ("engine_us", "in the engine", ".1f"), ("ratio", "engine/row", ".3f")])


if __name__ == "__main__":
    main()
