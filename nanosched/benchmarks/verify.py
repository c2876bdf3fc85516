"""`nanosched verify`: time a schedule set's pipelines against Sequential on this GPU, and keep
only those that win here.

Each pipeline entry is laid out at its key's shape, captured as a CUDA graph run by Sequential
and by the entry, and replayed back to back with the SM clock settled under the power cap,
alternating rounds (medians kept); an entry below the set's `min_gain` becomes `sequential`
with the measurement in its reason. The prediction can lose to launch order, SM partitions and
the clock, so a set is kept only where it wins on the GPU. On the CPU: the logic, eagerly.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from nanosched.benchmarks.common import bucket_batch, synthetic_decode_context
from nanosched.constants import PAGE_SIZE, SEQUENTIAL
from nanosched.errors import ConfigError, ScheduleError
from nanosched.runtime.backend import Backend
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.graphs import BucketRunner
from nanosched.runtime.opsched import OpScheduler
from nanosched.runtime.strategies import Sequential
from nanosched.runtime.strategies.replay_set import ReplaySet
from nanosched.schedules.sets import PIPELINE, ScheduleSet


@dataclass(frozen=True)
class VerifyConfig:
    settle_s: float = 1.0
    window_s: float = 2.0
    rounds: int = 3

    def __post_init__(self) -> None:
        if not (self.settle_s >= 0 and self.window_s > 0 and self.rounds >= 1):
            raise ConfigError(f"--settle must be >= 0, --window > 0 and --rounds >= 1; got "
                              f"{self.settle_s}, {self.window_s}, {self.rounds}")


@dataclass
class _Timed:
    """A batch captured once and replayed: `run()` does one forward of about `expect_us`."""

    run: Callable[[], None]
    expect_us: float


def _prepare(model: Any, ws: Any, strategy: OpScheduler, seqs: Any, max_pages: int,
             want_pipeline: bool, device: Any, expect_us: float) -> _Timed:
    """The batch `seqs` in its bucket under `strategy`, run once (eager, then captured on a
    GPU) on the stream device `device`. Both strategies replay the same batch: its K/V writes
    are the same each time."""
    runner = BucketRunner(model, ws, Backend(device), strategy, align=EngineConfig.graph_align,
                          max_pages=max_pages, capture=model.device.type == "cuda")
    entry = runner.entry(runner.bucket(seqs))
    if entry.fell_back or entry.strategy.pipelined != want_pipeline:
        b = entry.meta.bucket
        raise ConfigError(f"the set does not run a pipeline at D={b.num_decode}, "
                          f"T={b.num_tokens}")
    runner.run(entry, seqs)  # eager: compiles, makes every slice; then captured
    if entry.graph is not None:
        return _Timed(entry.graph.replay, expect_us)
    return _Timed(lambda: runner.run(entry, seqs), expect_us)


def _sustained(timed: _Timed, cfg: VerifyConfig, device: Any, telemetry: Any
               ) -> dict[str, Any]:
    """ms per forward replayed back to back: on a GPU the profiler's `sustained_run` (the
    queue kept fed for settle + window, the median of the forwards inside the window) with the
    clock and power over the window; on the CPU the mean over the window."""
    if device.type != "cuda":
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < cfg.window_s or n == 0:
            timed.run()
            n += 1
        return {"forward_ms": (time.perf_counter() - t0) * 1e3 / n}
    from nanosched.profiler.timing import sustained_run

    s = sustained_run([(timed.run, torch.cuda.current_stream(device), timed.expect_us)],
                      device, cfg.settle_s, cfg.window_s)
    out: dict[str, Any] = {"forward_ms": s.median_us[0] / 1e3}
    reading = telemetry.reading(*s.host_window) if telemetry else None
    if reading is not None:
        out |= {"sm_clock_mhz": round(reading.clock_mhz, 1), "power_w": round(reading.power_w, 1)}
    return out


def verify_set(model: Any, ws: Any, sset: ScheduleSet, context: int, prompt: int,
               cfg: VerifyConfig = VerifyConfig(), device_name: str = "",
               progress: Callable[[str], None] | None = None
               ) -> tuple[ScheduleSet, list[dict[str, Any]]]:
    """Measure every pipeline entry against Sequential at its key (`ws`'s cache filled with
    random K/V first); returns the set with the losing entries made sequential and every
    checked entry's `measured`, and one row per entry (key, both times, clock, power, the gain,
    the decision)."""
    # the decode rows attend to cached context no prompt wrote: random K/V as a served cache
    # holds, not zeros (after a forward over a zero-filled cache the rows had collapsed, mean
    # |cos| 0.93, and a GEMM multiplies such rows ~12% faster: docs/findings.md, 'What the kernel
    # rows price')
    ws.kv.fill_random(torch.Generator(model.device).manual_seed(0))
    telemetry = None
    if model.device.type == "cuda":
        from nanosched.profiler.telemetry import open_telemetry

        telemetry = open_telemetry(model.device.index or 0)
        if telemetry is not None:
            telemetry.start()
    from nanosched.runtime.device import CudaDevice, SerialDevice
    from nanosched.runtime.loader import StrategyChoice, open_streams

    replay = ReplaySet(sset, model.spec.num_layers)
    streams = open_streams(StrategyChoice(replay, "verify", sset), model.device)
    device = streams.device if streams is not None else \
        (CudaDevice() if model.device.type == "cuda" else SerialDevice())
    entries, rows = list(sset.entries), []
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        for i, e in enumerate(entries):
            if e.kind != PIPELINE:
                continue
            d, t = e.key
            if progress:
                progress(f"D={d} T={t}: Sequential vs the pipeline, {cfg.rounds} rounds of "
                         f"{cfg.settle_s:g} s + {cfg.window_s:g} s each")
            ctx = synthetic_decode_context(ws, t, d, context, prompt)
            seqs, ids = bucket_batch(ws, t, d, ctx, prompt, 10**8, EngineConfig.graph_align)
            max_pages = -(-max(ctx + 1, prompt) // ws.kv.page_size)
            try:
                runs = {SEQUENTIAL: _prepare(model, ws, Sequential(), seqs, max_pages, False,
                                               device, e.sequential_us),
                        PIPELINE: _prepare(model, ws, replay, seqs, max_pages, True, device,
                                             e.forward_us)}
            except (ScheduleError, ConfigError) as err:  # one entry's replay, not the run
                for r in ids:
                    ws.kv.release(r)
                entries[i] = dataclasses.replace(
                    e, kind=SEQUENTIAL, forward_us=e.sequential_us,
                    reason=f"{e.reason}; its replay failed on {device_name or 'this GPU'} "
                           f"({err}): runs Sequential")
                rows.append({"num_decode": d, "num_tokens": t, "predicted_gain": e.speedup,
                             "error": str(err), "kept": False})
                if progress:
                    progress(f"  replay failed ({err}): made sequential")
                continue
            got: dict[str, list[dict[str, Any]]] = {SEQUENTIAL: [], PIPELINE: []}
            for _ in range(cfg.rounds):
                for name, timed in runs.items():
                    got[name].append(_sustained(timed, cfg, model.device, telemetry))
            for r in ids:
                ws.kv.release(r)
            med = {name: statistics.median(x["forward_ms"] for x in xs) for name, xs in got.items()}
            gain = med[SEQUENTIAL] / med[PIPELINE]
            measured = {"device": device_name, "date": date, "decode_context": ctx,
                        "sequential_ms": round(med[SEQUENTIAL], 4),
                        "pipeline_ms": round(med[PIPELINE], 4), "gain": round(gain, 4),
                        "settle_s": cfg.settle_s, "window_s": cfg.window_s,
                        "rounds": cfg.rounds,
                        "sm_clock_mhz": [x.get("sm_clock_mhz") for x in got[PIPELINE]],
                        "power_w": [x.get("power_w") for x in got[PIPELINE]],
                        "sequential_sm_clock_mhz": [x.get("sm_clock_mhz")
                                                    for x in got[SEQUENTIAL]],
                        "sequential_power_w": [x.get("power_w") for x in got[SEQUENTIAL]]}
            keep = gain >= sset.min_gain
            if keep:
                entries[i] = dataclasses.replace(e, measured=measured)
            else:
                entries[i] = dataclasses.replace(
                    e, kind=SEQUENTIAL, forward_us=e.sequential_us, measured=measured,
                    reason=f"{e.reason}; measured {gain:.3f}x on {device_name or 'this GPU'} "
                           f"(needs {sset.min_gain:.2f}x): runs Sequential")
            rows.append({"num_decode": d, "num_tokens": t, "predicted_gain": e.speedup,
                         "predicted_sequential_ms": e.sequential_us / 1e3,
                         "predicted_pipeline_ms": e.forward_us / 1e3, **measured,
                         "kept": keep})
            if progress:
                progress(f"  Sequential {med[SEQUENTIAL]:.3f} ms, pipeline "
                         f"{med[PIPELINE]:.3f} ms: {gain:.3f}x (predicted {e.speedup:.3f}x, "
                         f"context {ctx}){'' if keep else ', made sequential'}")
    finally:
        if telemetry is not None:
            telemetry.stop()
        if streams is not None:
            streams.close()
    return dataclasses.replace(sset, entries=tuple(entries)), rows


def run_verify(path: str, out: str, device: str = "auto", cfg: VerifyConfig = VerifyConfig(),
               echo: Callable[[str], None] = print) -> tuple[ScheduleSet, list[dict[str, Any]]]:
    """What `nanosched verify` does: load the set (checked against this GPU), build its model
    with random weights (quantised as the set's profile was), measure its pipelines at the
    contexts each was searched at, write the verified set to `out`."""
    from nanosched.fileio import check_output_file
    from nanosched.models.spec import load_spec
    from nanosched.runtime.loader import gpu_name, kv_pages, load_model, resolve_device
    from nanosched.schedules.sets import (
        check_set_compatible,
        load_schedule_set,
        save_schedule_set,
    )

    check_output_file(out, "--out")
    sset = load_schedule_set(path)
    dev = resolve_device(device)
    spec = load_spec(sset.model["name"])
    check_set_compatible(sset, spec, sset.tp, gpu_name(dev), force=dev.type != "cuda",
                         kv_dtype=sset.kv_dtype, quantization=sset.quantization)
    pipes = [e for e in sset.entries if e.kind == PIPELINE and e.schedule is not None]
    if not pipes:
        echo("the set runs no pipeline: nothing to verify; written unchanged")
        save_schedule_set(sset, out)
        return sset, []
    if sset.tp != 1:
        raise ConfigError(f"verify times pipelines on one GPU; this set is for tp = {sset.tp}: "
                          f"time it end to end with `nanosched bench --model "
                          f"{sset.model['name']} --tp {sset.tp} --schedule {path} --compare`")
    model = load_model(spec, "random", dev, quantization=sset.quantization)
    from nanosched.benchmarks.throughput import forward_pages

    ctx = max(int(e.schedule.batch.decode_context) for e in pipes)  # type: ignore[union-attr]
    prompt = max(e.schedule.batch.prompt_len for e in pipes)  # type: ignore[union-attr]
    pages = max(forward_pages(e.num_tokens, e.num_decode, ctx, prompt, PAGE_SIZE)
                for e in pipes)
    pages = min(pages, kv_pages(model, sset.dense_batch, PAGE_SIZE, EngineConfig.mem_util, None,
                                sset.kv_dtype))
    ws = model.new_workspace(sset.dense_batch, num_pages=pages, kv_dtype=sset.kv_dtype)
    echo(f"verifying {len(pipes)} pipeline entries of {path} on {gpu_name(dev)}")
    verified, rows = verify_set(model, ws, sset, ctx, prompt, cfg, gpu_name(dev), echo)
    save_schedule_set(verified, out)
    return verified, rows
