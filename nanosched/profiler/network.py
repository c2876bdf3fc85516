"""Collectives and GEMM x all-reduce pairs on several GPUs (GPU-only; NCCL, one process each).

`measure_network` spawns `request.world` processes (torch.multiprocessing, spawn), each on its
own GPU, with NVLink multicast kept off in their environment (`NCCL_ENV`). They time all-reduce,
reduce-scatter and all-gather of [T, D] bf16 at every token count, on NCCL's default process
group and on groups whose NCCL config bounds the CTAs (`max_ctas`), all with the same fixed
number of launches so that ranks stay in step, queued behind a GPU sleep so the rows are GPU
time, not Python launch gaps (`_fixed_bench_us`). Then each rank co-runs a GEMM beside the
all-reduce (timing.co_run_us); rank 0 writes the results as JSON for the parent.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import traceback
from pathlib import Path
from typing import Any

from nanosched.errors import ProfileError
from nanosched.profiler.backend import NetworkRequest, NetworkResult
from nanosched.profiler.network_model import KINDS
from nanosched.profiler.plan import PairTask, ProfileSettings

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
WARMUP, ITERS = 3, 20
TIMEOUT_S = 540


def measure_network(settings: ProfileSettings, request: NetworkRequest, num_sms: int,
                    rep_ms: float) -> NetworkResult:
    import torch.multiprocessing as mp

    os.environ.update(NCCL_ENV)  # inherited by the spawned workers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="nanosched-net-") as tmp:
        out = Path(tmp) / "network.json"
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(rank, request.world, port, settings,
                                                   request, num_sms, rep_ms, str(out)))
                 for rank in range(request.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT_S)
        errors = sorted(Path(tmp).glob("*.err"))
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        for p in procs:
            if p.is_alive():
                p.kill()
        if errors or failed or not out.exists():
            detail = errors[0].read_text()[-2000:] if errors else f"exit codes {failed}"
            raise ProfileError(f"network measurement on {request.world} GPUs failed: {detail}")
        data = json.loads(out.read_text())
    result = NetworkResult(request.world)
    result.times_us = {(k, t, c): us for k, t, c, us in data["times"]}
    tasks = {str(t.key): t for t in request.pairs}
    result.pairs = [(tasks[key], tuple(vals)) for key, vals in data["pairs"]]
    return result


def _worker(rank: int, world: int, port: int, settings: ProfileSettings,
            request: NetworkRequest, num_sms: int, rep_ms: float, out: str) -> None:
    os.environ.update(NCCL_ENV)
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, device_id=torch.device("cuda", rank))
        groups = {c: _group(dist, world, c) for c in request.ctas}
        groups = {c: g for c, g in groups.items() if g is not None or c == 0}
        times = _collectives(settings, request, groups, world)
        pairs = [(str(t.key), _pair(settings, t, groups, times, num_sms, world, rep_ms))
                 for t in request.pairs if _ctas_of(t) in groups]
        if rank == 0:
            Path(out).write_text(json.dumps({
                "times": [[k, t, c, us] for (k, t, c), us in times.items()], "pairs": pairs}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(out).with_name(f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _group(dist: Any, world: int, ctas: int) -> Any:
    """A process group whose NCCL kernels use at most `ctas` CTAs (None: NCCL's default)."""
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    if ctas:
        if not hasattr(opts, "config") or not hasattr(opts.config, "max_ctas"):
            return None
        opts.config.max_ctas = ctas
    return dist.new_group(list(range(world)), backend="nccl", pg_options=opts)


def _ctas_of(task: PairTask) -> int:
    return int(task.other_impl.removeprefix("nccl_ctas")) if task.other_impl != "nccl" else 0


def _collective(kind: str, tokens: int, world: int, hidden: int, group: Any) -> Any:
    import torch
    import torch.distributed as dist

    full = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    part = torch.randn(tokens // world, hidden, device="cuda", dtype=torch.bfloat16)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full, group=group)
    return lambda: dist.all_gather_into_tensor(full, part, group=group)


def _fixed_bench_us(fn: Any) -> float:
    """Median GPU time of one collective over ITERS launches queued behind a sleep.

    Every rank makes the same number of launches so ranks stay in step. Launching a collective
    from Python costs tens of us, more than a small all-reduce takes on NVLink, so unqueued
    launches would time the CPU (and the slower rank's CPU). The first launch absorbs the ranks'
    skew in leaving the sleep; the median ignores it.
    """
    import torch

    from nanosched.profiler.timing import launch_cpu_us, queue_cycles

    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    cpu_us = launch_cpu_us(fn)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(ITERS)]
    torch.cuda._sleep(queue_cycles(ITERS * (cpu_us + 10)))
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(a.elapsed_time(b) for a, b in events)


def _collectives(settings: ProfileSettings, request: NetworkRequest, groups: dict[int, Any],
                 world: int) -> dict[tuple[str, int, int], float]:
    import torch
    import torch.distributed as dist

    keys = [(k, t, c) for k in KINDS for t in request.tokens for c in groups]
    times = [_fixed_bench_us(_collective(k, t, world, settings.model.hidden_size, groups[c]))
             for k, t, c in keys]
    agreed = torch.tensor(times, device="cuda", dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank uses the same numbers
    return dict(zip(keys, agreed.tolist(), strict=True))


def _pair(settings: ProfileSettings, task: PairTask, groups: dict[int, Any],
          times: dict[tuple[str, int, int], float], num_sms: int, world: int,
          rep_ms: float) -> list[float]:
    import torch

    from nanosched.profiler import impls, timing

    ws = impls.ScratchSpace(torch.device("cuda", torch.cuda.current_device()))
    device = ws.device

    def kernel(impl: str, sms: int) -> impls.Kernel:
        call = impls.OpCall(settings.model, settings.tp, task.compute_op, task.tokens, 0, sms,
                            "full", num_sms, ws, settings.dense_batch)
        return impls.get(task.compute_op, impl).kernel(call)

    alone_c = timing.bench_us(kernel("cublas", num_sms).fn, device, rep_ms)
    alone_o = min(us for (k, t, _), us in times.items() if k == "all_reduce" and
                  t == task.tokens)
    comp = kernel(task.compute_impl, task.compute_sms)
    coll = _collective("all_reduce", task.tokens, world, settings.model.hidden_size,
                       groups[_ctas_of(task)])
    lo, hi = torch.cuda.Stream.priority_range()
    s_comp, s_coll = torch.cuda.Stream(device, priority=lo), torch.cuda.Stream(device,
                                                                                priority=hi)
    with comp.scope():
        c_us, o_us = timing.co_run_us(comp.fn, s_comp, alone_c, coll, s_coll,
                                      times[("all_reduce", task.tokens, _ctas_of(task))],
                                      device)
    return [alone_c, alone_o, c_us, o_us]
