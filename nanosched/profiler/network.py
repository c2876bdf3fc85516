"""Collectives and GEMM x all-reduce pairs on several GPUs (GPU-only; one process each).

`measure_network` spawns one process per GPU (NVLink multicast off) that time all-reduce,
reduce-scatter and all-gather at every token count on NCCL, on CTA-bounded NCCL groups and the
copy-engine all-reduce, then a GEMM beside the all-reduce, sustained as the memory pairs are.
Every rank launches the same fixed number of times, so the ranks stay in step; rank 0 writes
the results for the parent.

More in docs/profiler.md, module notes.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import tempfile
import traceback
from pathlib import Path
from typing import Any

from nanosched.constants import MULTICAST_OFF, SAFE_PATH
from nanosched.errors import ProfileError
from nanosched.kernels.impls import network_impl
from nanosched.profiler.backend import NetworkPair, NetworkRequest, NetworkResult, PairTiming
from nanosched.profiler.network_model import CE_ALL_REDUCE, COLLECTIVE_KINDS
from nanosched.profiler.plan import PairTask, ProfileSettings

WARMUP, ITERS = 3, 20
TIMEOUT_S = 540


def measure_network(settings: ProfileSettings, request: NetworkRequest, num_sms: int,
                    rep_ms: float) -> NetworkResult:
    import torch.multiprocessing as mp

    os.environ.update(MULTICAST_OFF)  # inherited by the spawned workers
    os.environ.update(SAFE_PATH)
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
    result.pairs = [NetworkPair(tasks[key], v["compute_alone_us"], v["other_alone_us"],
                                PairTiming(v["compute_us"], v["other_us"], v["clock_mhz"],
                                           v["power_w"]),
                                settings.pair_settle_ms, settings.pair_window_ms,
                                v["compute_alone_clock_mhz"])
                    for key, v in data["pairs"]]
    return result


def _worker(rank: int, world: int, port: int, settings: ProfileSettings,
            request: NetworkRequest, num_sms: int, rep_ms: float, out: str) -> None:
    os.environ.update(MULTICAST_OFF)
    try:
        import torch
        import torch.distributed as dist

        from nanosched.models.parallel import TensorParallel
        from nanosched.profiler.telemetry import open_telemetry

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, device_id=torch.device("cuda", rank))
        groups = {c: _group(dist, world, c) for c in request.ctas}
        groups = {c: g for c, g in groups.items() if g is not None or c == 0}
        tp = TensorParallel(rank, world)
        if request.copy_engine_ctas:
            tp = tp.with_copy_engine(torch.device("cuda", rank))
        net = _Net(settings, request, groups, tp, world)
        times = {(k, t, c): us for k, t, c, us in request.times_us} or _collectives(net)
        tele = open_telemetry(rank)
        pairs = [(str(t.key), _pair(settings, t, net, times, num_sms, tele))
                 for t in request.pairs if net.runs(t.other_impl)]
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


class _Net:
    """This rank's collectives: NCCL on its groups (CTA bound -> group), and the copy-engine
    all-reduce on a buffer of its own when the request measures it."""

    def __init__(self, settings: ProfileSettings, request: NetworkRequest,
                 groups: dict[int, Any], tp: Any, world: int) -> None:
        import torch

        self.request, self.groups, self.tp, self.world = request, groups, tp, world
        self.hidden = settings.model.hidden_size
        self.ce_buf = None
        if tp.copy_engine is not None:
            self.ce_buf = tp.symmetric_zeros(max(request.tokens), self.hidden,
                                             dtype=torch.bfloat16, device="cuda")
            self.ce_buf.copy_(torch.randn_like(self.ce_buf))

    def runs(self, impl: str) -> bool:
        kind, ctas = network_impl(impl)
        if kind == "copy_engine":
            return self.ce_buf is not None
        return (ctas or 0) in self.groups

    def all_reduce(self, impl: str, tokens: int) -> Any:
        """A function launching one all-reduce of [tokens, D] with implementation `impl`."""
        kind, ctas = network_impl(impl)
        if kind == "copy_engine":
            buf = self.ce_buf[:tokens]
            return lambda: self.tp.all_reduce(buf, impl)
        return self.collective("all_reduce", tokens, ctas or 0)

    def collective(self, kind: str, tokens: int, ctas: int) -> Any:
        import torch
        import torch.distributed as dist

        group = self.groups[ctas]
        full = torch.randn(tokens, self.hidden, device="cuda", dtype=torch.bfloat16)
        part = torch.randn(tokens // self.world, self.hidden, device="cuda",
                           dtype=torch.bfloat16)
        if kind == "all_reduce":
            return lambda: dist.all_reduce(full, group=group)
        if kind == "reduce_scatter":
            return lambda: dist.reduce_scatter_tensor(part, full, group=group)
        return lambda: dist.all_gather_into_tensor(full, part, group=group)


def _time_key(impl: str, tokens: int) -> tuple[str, int, int]:
    """The `times` key of an all-reduce implementation's row."""
    kind, ctas = network_impl(impl)
    return (CE_ALL_REDUCE if kind == "copy_engine" else "all_reduce", tokens, ctas or 0)


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


def _collectives(net: _Net) -> dict[tuple[str, int, int], float]:
    import torch
    import torch.distributed as dist

    request = net.request
    keys = [(k, t, c) for k in COLLECTIVE_KINDS for t in request.tokens for c in net.groups]
    times = [_fixed_bench_us(net.collective(k, t, c)) for k, t, c in keys]
    if net.ce_buf is not None:
        for c in request.copy_engine_ctas:
            impl = f"copy_engine_ctas{c}" if c else "copy_engine"
            for t in request.tokens:
                keys.append(_time_key(impl, t))
                times.append(_fixed_bench_us(net.all_reduce(impl, t)))
    agreed = torch.tensor(times, device="cuda", dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank uses the same numbers
    return dict(zip(keys, agreed.tolist(), strict=True))


_ALONE: dict[tuple[str, int], tuple[float, float | None]] = {}  # (op, tokens) -> us, clock


def _pair(settings: ProfileSettings, task: PairTask, net: _Net,
          times: dict[tuple[str, int, int], float], num_sms: int,
          tele: Any) -> dict[str, Any]:
    """The GEMM of `task` beside its all-reduce, sustained (docs/profiler.md). Alone: cuBLAS
    on all SMs looped until the clock settled (as the memory pairs), and the collective's row;
    every rank launches the collective the same number of times (its row is agreed)."""
    import torch

    from nanosched.profiler import impl_registry, timing
    from nanosched.profiler.impl_registry import Kernel, OpCall, ScratchSpace

    ws = ScratchSpace(torch.device("cuda", torch.cuda.current_device()))
    device = ws.device
    settle_s, window_s = settings.pair_settle_ms / 1e3, settings.pair_window_ms / 1e3

    def kernel(impl: str, sms: int) -> Kernel:
        call = OpCall(settings.model, settings.tp, task.compute_op, task.tokens, 0, sms,
                      "full", num_sms, ws, settings.dense_batch)
        return impl_registry.get(task.compute_op, impl).kernel(call)

    lo, hi = torch.cuda.Stream.priority_range()
    s_comp, s_coll = torch.cuda.Stream(device, priority=lo), torch.cuda.Stream(device,
                                                                                priority=hi)
    shape = (task.compute_op, task.tokens)
    if shape not in _ALONE:
        run = timing.sustained_run([(kernel("cublas", num_sms).fn, s_comp, 100.0)], device,
                                   settle_s, window_s)
        reading = tele.reading(*run.host_window) if tele else None
        _ALONE[shape] = (run.median_us[0], reading.clock_mhz if reading else None)
    alone_c, alone_clock = _ALONE[shape]
    alone_o = min(us for (k, t, _), us in times.items() if k == "all_reduce" and
                  t == task.tokens)
    own_o = times[_time_key(task.other_impl, task.tokens)]
    graph = timing.captured(net.all_reduce(task.other_impl, task.tokens), s_coll)
    comp = kernel(task.compute_impl, task.compute_sms)
    n = max(8, math.ceil(1e6 * (settle_s + window_s) / own_o))
    with comp.scope():
        res = timing.sustained_fixed(comp.fn, s_comp, graph.replay, s_coll, n, settle_s)
    if res.loop_us is None or res.fixed_us is None:
        raise ProfileError(f"pair {task.compute_op} x {task.other_impl} at {task.tokens}: too "
                           f"few launches inside the window")
    reading = tele.reading(*res.host_window) if tele else None
    return {"compute_alone_us": alone_c, "other_alone_us": alone_o, "compute_us": res.loop_us,
            "other_us": res.fixed_us, "clock_mhz": reading.clock_mhz if reading else None,
            "power_w": reading.power_w if reading else None,
            "compute_alone_clock_mhz": alone_clock}
