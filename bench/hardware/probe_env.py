"""Probe a GPU machine: versions, APIs nanosched relies on, and the two ceilings.

Run: PYTHONPATH=. python bench/hardware/probe_env.py   (writes $OUT/probe_env.json when OUT is set)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

import torch


def ceilings() -> dict:
    from triton.testing import do_bench

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    ms_copy = do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    return {"gemm_tflops_8192": 2 * n**3 / ms / 1e9,
            "copy_gbs": 2 * src.numel() * 2 / ms_copy / 1e6}


def apis() -> dict:
    out: dict = {}
    out["set_sm_carveout"] = hasattr(torch._C, "_set_sm_carveout_experimental")
    out["preferred_blas_library"] = hasattr(torch.backends.cuda, "preferred_blas_library")
    out["green_contexts_module"] = hasattr(torch.cuda, "green_contexts")
    try:
        from cuda.bindings import driver

        out["cuda_bindings"] = getattr(__import__("cuda.bindings").bindings, "__version__", "?")
        names = ["cuDevSmResourceSplitByCount", "cuDevSmResourceSplit", "cuGreenCtxCreate",
                 "cuGreenCtxStreamCreate", "cuDeviceGetDevResource", "cuDevResourceGenerateDesc",
                 "cuGreenCtxGetDevResource"]
        out["driver_fns"] = {n: hasattr(driver, n) for n in names}
        out["split_doc"] = (driver.cuDevSmResourceSplitByCount.__doc__ or "")[:1500]
    except Exception as exc:  # report, don't fail the probe
        out["cuda_bindings_error"] = repr(exc)
    try:
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        out["nccl_config_fields"] = [f for f in dir(opts.config) if not f.startswith("_")]
    except Exception as exc:
        out["nccl_options_error"] = repr(exc)
    return out


def main() -> None:
    import triton

    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                          "clocks.sm,clocks.max.sm,utilization.gpu", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__,
            "device": props.name, "num_sms": props.multi_processor_count,
            "memory_bytes": props.total_memory, "nvidia_smi": smi,
            "num_gpus": torch.cuda.device_count(), **apis(), **ceilings()}
    for mod in ("cupy", "pandas", "typer", "transformers", "ortools", "tqdm", "safetensors",
                "matplotlib", "fastapi", "uvicorn", "httpx", "openai"):
        try:
            info[f"has_{mod}"] = getattr(__import__(mod), "__version__", "yes")
        except Exception:
            info[f"has_{mod}"] = None
    text = json.dumps(info, indent=1)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_env.json"), "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
