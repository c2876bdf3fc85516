"""CPU: registers, stack (spills) and shared memory of the attention kernels, compiled for Hopper.

    PYTHONPATH=. python bench/tools/kernel_resources.py [--arch 90] [--only NAME]

Compiles each kernel below with `triton.compile` for sm_{arch}a at Llama-3-8B heads (Hq 32,
Hkv 8, d 128, page 16, bf16 queries) at its engine launch (and the variants a benchmark
sweeps), with no GPU, and reads the cubin's resource usage with the cuobjdump Triton ships:
registers a thread, stack bytes a thread (where spills go) and the dynamic shared memory of
the launch. What a GPU run gets depends on the Triton version that compiles it (the JSON
records this one); a kernel at 255 registers with a stack spills, which a tile change or a
restructure may remove before any GPU time is spent. JSON to $OUT or bench/results/; a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import subprocess
import sys
import tempfile
from typing import Any

from bench._common import print_table, write_result

PTRS = {"q_ptr": "*bf16", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "o_ptr": "*fp32",
        "lse_ptr": "*fp32", "part_ptr": "*fp32", "part2_ptr": "*fp32", "lse2_ptr": "*fp32",
        "out_ptr": "*bf16"}  # other pointers (block tables, lengths, starts) are int32
FLOATS = ("scale", "scale_log2")


def kernels() -> list[tuple[str, Any, dict[str, Any], dict[str, str], int, int]]:
    """(name, kernel, constexprs, pointer types beyond PTRS, warps, stages) at 8B shapes."""
    from nanosched.kernels.cascade_attn import PREFIX, _prefix_kernel
    from nanosched.kernels.common import PIPELINED
    from nanosched.kernels.decode_attn import _decode_merge_kernel, _decode_partial_kernel
    from nanosched.kernels.prefill_attn import _prefill_kernel, default_config

    out = []
    for fp8 in (True, False):
        kv = "fp8e4nv" if fp8 else "bf16"
        cache = {"k_ptr": f"*{kv}", "v_ptr": f"*{kv}"}
        tag = "e4m3" if fp8 else "bf16"
        cfg = default_config(fp8_kv=fp8)
        for ahead in (False, True):
            name = (f"prefill {tag} {cfg.block_m}x{cfg.block_n}w{cfg.num_warps}"
                    f"s{cfg.num_stages}{'a' if ahead else ''}")
            out.append((name, _prefill_kernel, dict(
                GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                PAGE=16, BLOCK_S=8, DOT_PREC="tf32", FP8=fp8, F16_DOTS=fp8, PAGES_AHEAD=ahead),
                {**cache, "o_ptr": "*bf16"}, cfg.num_warps, cfg.num_stages))
        for start in (False, True):
            out.append((f"decode partial {tag} pipelined{' (cascade suffix)' if start else ''}",
                        _decode_partial_kernel, dict(
                            GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128,
                            BLOCK_N=PIPELINED.block_for(fp8), PAGE=16, STORE_LSE=True,
                            DOT_PREC="tf32", NUM_STAGES=PIPELINED.num_stages, FP8=fp8,
                            F16_DOTS=fp8, HAS_START=start),
                        cache, PIPELINED.num_warps, 3))
        out.append((f"cascade prefix {tag} m{PREFIX.block_m}n{PREFIX.block_n}", _prefix_kernel,
                    dict(GROUP=4, ROWS=PREFIX.block_m // 4, BLOCK_M=PREFIX.block_m,
                         HEAD_DIM=128, BLOCK_D=128, BLOCK_N=PREFIX.block_n, PAGE=16,
                         DOT_PREC="tf32", NUM_STAGES=PREFIX.num_stages, FP8=fp8, F16_DOTS=fp8),
                    cache, PREFIX.num_warps, 3))
    for heads, splits in ((16, 2), (1, 2)):
        out.append((f"merge {heads} head(s) x {splits} splits", _decode_merge_kernel,
                    dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=splits, BLOCK_H=heads, TWO=False),
                    {}, 4, 3))
    return out


def resources(kernel: Any, constexprs: dict[str, Any], ptrs: dict[str, str], warps: int,
              stages: int, arch: int) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    types = {**PTRS, **ptrs}
    sig = {n: "constexpr" if n in constexprs else types.get(
        n, "fp32" if n in FLOATS else "*i32" if n.endswith("_ptr") else "i32") for n in names}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v
                                             for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    return {"registers": int(found["REG"]), "stack_bytes": int(found["STACK"]),
            "shared_bytes": compiled.metadata.shared, "warps": warps, "stages": stages}


def main() -> None:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability (90: Hopper)")
    ap.add_argument("--only", default="", help="only the kernels whose name contains this")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("TRITON_INTERPRET=1 turns the kernels into interpreted functions, which do not "
                 "compile; unset it")
    rows = [{"kernel": name, **resources(k, c, p, w, s, args.arch)}
            for name, k, c, p, w, s in kernels() if args.only in name]
    if not rows:
        ap.error(f"no kernel's name contains {args.only!r}")
    env = {"device": f"sm_{args.arch}a compiled on the CPU", "triton": triton.__version__,
           "python": platform.python_version(),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["bench/tools/kernel_resources.py", *sys.argv[1:]])}
    path = write_result("kernel_resources", {"env": env, "rows": rows})
    print(f"wrote {path}")
    print_table(rows, [("kernel", "kernel", ""), ("registers", "regs", "d"),
                       ("stack_bytes", "stack B", "d"), ("shared_bytes", "smem B", "d"),
                       ("warps", "warps", "d"), ("stages", "stages", "d")])


if __name__ == "__main__":
    main()
