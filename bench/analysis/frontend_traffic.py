"""CPU: where HF Llama-3-8B through the frontend does more work per layer than the named-op model.

HF Llama built from Llama-3-8B's config on the meta device (shapes only), partitioned by
`llama_rules()`, with and without sibling-linear fusion (no Inductor: its kernels exist only on
a GPU). Each op of a middle layer runs over `--rows` tokens under a dispatch mode that records
every ATen call that launches a kernel (views excluded): the bytes it reads and writes (a
broadcast operand counted once) and its FLOPs; the KV append's two `index_copy_` calls are
counted from the shapes. The attention operators run the named-op model's kernels and are not
counted.

The estimate prices each recorded call on an H100: a GEMM at the FLOP rate the shipped H100
profile measured for the named op's fused GEMM at these rows, scaled by wave quantisation
(128 x 128 tiles over 132 SMs) against the fused GEMM's; any other call at `--floor-us` or its
bytes at `--tbs` TB/s, whichever is longer. The named op's time is the profile's row. The sum
of the differences is what the frontend adds per layer, to set beside the measured gap
(bench/engine/frontend_llama.py).

    PYTHONPATH=. python bench/analysis/frontend_traffic.py --rows 1024
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "nanosched" / "profiler" / "profiles" / "llama3-8b-tp1-h100.json"
GEMMS = {"mm", "addmm", "bmm"}
SKIP = {"kv_append", "attn_decode", "attn_prefill"}  # the named-op model's own kernels
SMS, TILE = 132, 128


def effective_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for tensor `t`: dimensions of stride 0 (broadcasts) once."""
    return t.element_size() * math.prod(s for s, st in zip(t.shape, t.stride(), strict=True)
                                        if st != 0)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # identity of the storage (meta tensors have no address)


class Calls(TorchDispatchMode):
    """Every kernel-launching ATen call: (name, bytes read + written, FLOPs, GEMM shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        alias = schema.returns[0].alias_info if schema.returns else None
        name = func.overloadpacket.__name__
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        given = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        storages = {_storage(t) for t in given}
        if alias is not None and not alias.is_write and \
                all(_storage(o) in storages for o in outs):
            return out  # a view, or `to` / `contiguous` returning its input: no kernel
        ins = [t for t in given if all(t is not o for o in outs)]
        call = {"aten": name, "bytes": sum(map(effective_bytes, ins + outs)), "flops": 0}
        if name in GEMMS:
            a, b = args[-2], args[-1]
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            call |= {"flops": 2 * m * k * n * (a.shape[0] if a.dim() == 3 else 1),
                     "mn": (int(m), int(n))}
        self.calls.append(call)
        return out


def frontend(fuse: bool) -> Any:
    from transformers import LlamaForCausalLM

    from bench.engine.frontend_llama import llama_config
    from nanosched.frontend import FrontendModel
    from nanosched.frontend.hf import llama_rules, use_nanosched

    cfg = llama_config(3)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    use_nanosched(model)
    return FrontendModel(model, llama_rules(), fuse=fuse)


def op_calls(fm: Any, rows: int) -> dict[str, list[dict[str, Any]]]:
    """The recorded calls of each op of the traced middle layer over `rows` tokens."""
    from nanosched.frontend.boundary import allocate, evaluate
    from nanosched.frontend.boundary import rows as row_view
    from nanosched.frontend.custom_ops import KV_APPEND

    def view(v: Any) -> torch.Tensor:
        return row_view(allocate(fm.values[v], rows, fm.device), fm.values[v], 0, rows)

    out = {}
    for step in (s for s in fm.steps if s.layer == 1):
        sub = step.sub
        args = [view(v) for v in step.reads()] + list(step.bound)
        args += [evaluate(fm.sizes[n], fm.trace.symbol, rows) for n in sub.reads.symbols]
        args += [view(step.value_id(n)) for n in sub.outputs]
        with Calls() as calls, torch.inference_mode():
            sub.module(*args)
        out[sub.group.op] = [c for c in calls.calls if c["aten"] not in SKIP]
        if step.has(KV_APPEND):
            out[sub.group.op] += kv_append_calls(fm, rows)
    return out


def kv_append_calls(fm: Any, rows: int) -> list[dict[str, Any]]:
    """The frontend's KV append (kernels/reference.py `append_kv`): one `index_copy_` each
    for K and V, reading the rows and writing them into the cache (the meta device runs no
    operator, so these are counted from the shapes)."""
    nbytes = rows * fm.kv_heads * fm.head_dim * fm.dtype.itemsize
    return [{"aten": "index_copy_", "bytes": 2 * nbytes, "flops": 0} for _ in ("k", "v")]


def waves(mn: tuple[int, int]) -> float:
    tiles = math.ceil(mn[0] / TILE) * math.ceil(mn[1] / TILE)
    return math.ceil(tiles / SMS) / (tiles / SMS)


def estimate_us(calls: list[dict[str, Any]], fused: list[dict[str, Any]], row_us: float,
                args: argparse.Namespace) -> float:
    """The calls' time (module docstring); `fused` is the same op's fused calls."""
    gemm = [c for c in fused if c["flops"]]
    rate = sum(c["flops"] for c in gemm) * waves(gemm[0]["mn"]) / row_us if gemm else 0.0
    total = 0.0
    for c in calls:
        if c["flops"]:
            total += c["flops"] / rate * waves(c["mn"])
        else:
            total += max(args.floor_us, c["bytes"] / args.tbs / 1e6)
    return total


def main() -> None:
    from nanosched.profiler.format import load_profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--tbs", type=float, default=2.5, help="TB/s of a torch elementwise call")
    ap.add_argument("--floor-us", type=float, default=2.0, help="least time of a kernel")
    args = ap.parse_args()
    prof = load_profile(PROFILE)
    unfused, fused = op_calls(frontend(False), args.rows), op_calls(frontend(True), args.rows)
    table, added = {}, {"unfused": 0.0, "fused": 0.0}
    print(f"{'op':14s} {'named us':>9s} | unfused: calls  MB   est us | fused: calls  MB   est us")
    for op, calls in unfused.items():
        if op in SKIP or not calls:
            continue
        row = prof.kernel_time_us(op, args.rows)
        est = {k: estimate_us(c, fused[op], row, args) for k, c in
               (("unfused", calls), ("fused", fused[op]))}
        table[op] = {"named_us": row, **{f"{k}_calls": len(c) for k, c in
                                          (("unfused", calls), ("fused", fused[op]))},
                     **{f"{k}_mb": sum(x["bytes"] for x in c) / 1e6 for k, c in
                        (("unfused", calls), ("fused", fused[op]))},
                     **{f"{k}_est_us": v for k, v in est.items()}}
        for k in added:
            added[k] += max(0.0, est[k] - row)
        t = table[op]
        print(f"{op:14s} {row:9.1f} | {t['unfused_calls']:5d} {t['unfused_mb']:6.1f} "
              f"{t['unfused_est_us']:7.1f} | {t['fused_calls']:5d} {t['fused_mb']:6.1f} "
              f"{t['fused_est_us']:7.1f}")
    print(f"added per layer over the named op (est.): unfused {added['unfused']:.0f} us, "
          f"fused GEMMs {added['fused']:.0f} us")
    stamp = time.strftime("%Y%m%d", time.gmtime())
    out = ROOT / "bench" / "results" / f"frontend-traffic-llama3-8b-{stamp}.json"
    out.write_text(json.dumps({"args": vars(args), "profile": PROFILE.name, "ops": table,
                               "added_us_per_layer": added,
                               "calls": {"unfused": unfused, "fused": fused}}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
