"""A tensor-parallel group the tool starts itself: rank 0 in this process, ranks 1..N-1 spawned.

`start_ranks(cfg, weights, device)` forces NVLink multicast off in this process's environment
(which the workers inherit: NCCL, PyTorch symmetric memory and NVSHMEM read it) and sets
PYTHONSAFEPATH there (`constants.SAFE_PATH`: a spawned worker and multiprocessing's resource
tracker boot as `python -c`, which would import the current folder's modules), spawns one
worker per other GPU (runtime/ranks/follower.py: it loads its shards of the model, then follows
rank 0's messages), joins the process group with them (NCCL on CUDA, gloo on the CPU) and
returns the `RankGroup`. Rank 0 owns the scheduler; each engine it builds at tp > 1 sends its
steps through the group's channel (runtime/ranks/messages.py `EngineLink`).

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

from nanosched.constants import MULTICAST_OFF, SAFE_PATH
from nanosched.errors import ConfigError
from nanosched.kernels.common import bind_device
from nanosched.models.parallel import TensorParallel, free_port
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.ranks.channel import ChannelWriter
from nanosched.runtime.ranks.follower import run_worker
from nanosched.runtime.ranks.messages import EngineLink, OpenEngine, Stop, WorkerSetup

log = logging.getLogger("nanosched.ranks")
RANK_DIED_EXIT = 1
STOP_WAIT_S = 10.0  # how long close() waits for a worker to end after `Stop`


class RankDied(RuntimeError):
    """A worker of the group is gone."""


def describe_exit(code: int | None) -> str:
    """How a worker ended, from its exit code (negative: the signal that killed it)."""
    if code is None:
        return "is still running"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else \
            f"signal {-code}"
        hint = " (the kernel's out-of-memory killer sends it too)" if -code == 9 else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code} (its error is printed above)"


class RankGroup:
    """Rank 0's handle on the group (docs/runtime.md); `tp` is rank 0's `TensorParallel`."""

    def __init__(self, size: int, procs: list[Any], writer: ChannelWriter) -> None:
        self.size, self.procs, self.writer = size, procs, writer
        self.tp = TensorParallel(0, size)
        self.closing = False
        self.on_death: Callable[[str], None] | None = None  # told before a dead rank ends us
        self._next_key = 0
        self._watchdog = threading.Thread(target=self._watch, name="nanosched-rank-watchdog",
                                          daemon=True)
        writer.check = self._check

    # ---- engines ---------------------------------------------------------------------------
    def open_engine(self, config: EngineConfig, choice: Any) -> EngineLink:
        """Have every worker build the engine `config` (resolved) runs with `choice`'s
        strategy; returns the link rank 0's engine sends its steps through."""
        key, self._next_key = self._next_key, self._next_key + 1
        self.send(OpenEngine(key, config, choice.name, choice.schedule))
        return EngineLink(self.send, key)

    def send(self, message: Any) -> int:
        return self.writer.send(message)

    # ---- failure ---------------------------------------------------------------------------
    def _check(self) -> None:
        for p in self.procs:
            if not p.is_alive():
                raise RankDied(f"tensor-parallel rank {p.rank} (pid {p.pid}) "
                               f"{describe_exit(p.exitcode)}")

    def dead_rank(self, wait_s: float | None = 0.0) -> str | None:
        """Which worker is gone and how (waiting up to `wait_s` for one to go: None, for
        ever), or None: e.g. why a collective failed."""
        ready = wait([p.sentinel for p in self.procs], wait_s)
        dead = next((p for p in self.procs if p.sentinel in ready), None)
        if dead is None:
            return None
        dead.join(1.0)
        how = "is gone" if dead.exitcode is None else describe_exit(dead.exitcode)
        return f"tensor-parallel rank {dead.rank} (pid {dead.pid}) {how}"

    def _watch(self) -> None:
        what = self.dead_rank(None)
        if self.closing:
            return
        sys.stderr.write(f"error: {what}; stopping every rank\n")
        sys.stderr.flush()
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.kill()
        if self.on_death is not None:  # e.g. the server answers its open requests (bounded)
            with contextlib.suppress(Exception):
                self.on_death(what)
        with contextlib.suppress(Exception):
            self.writer.unlink()
        os._exit(RANK_DIED_EXIT)

    # ---- shutdown --------------------------------------------------------------------------
    def close(self, failed: bool = False) -> None:
        """Stop every worker: `Stop` after the work already sent, or with `failed` (rank 0
        broke off mid-work, so workers may wait in a collective) killed at once. Rank 0 leaves
        the process group while the workers leave it (NCCL's teardown may wait for every rank),
        and nothing here waits longer than `STOP_WAIT_S`: a worker still alive then is killed,
        and a teardown still blocked is left to end with the process."""
        if self.closing:
            return
        self.closing = True
        t0 = time.monotonic()
        deadline = t0 + (0 if failed else STOP_WAIT_S)

        def check() -> None:
            if time.monotonic() > deadline:
                raise RankDied("a worker did not take the stop message in time")

        self.writer.check = check
        leave = None
        if not failed:
            with contextlib.suppress(RankDied):
                self.send(Stop())
            if dist.is_initialized():
                leave = threading.Thread(target=dist.destroy_process_group,
                                         name="nanosched-leave-group", daemon=True)
                leave.start()
        killed = []
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                killed.append(p.rank)
                p.kill()
                p.join()
        if leave is not None:
            leave.join(max(1.0, deadline - time.monotonic()))
        if killed:
            log.warning("tensor parallel: ranks %s did not stop within %.0f s and were killed",
                        ", ".join(map(str, killed)), STOP_WAIT_S)
        if leave is not None and leave.is_alive():
            faulthandler.dump_traceback(all_threads=True)  # where the teardown waits
            log.warning("tensor parallel: leaving the process group did not end within %.0f s; "
                        "it is left to end with this process", STOP_WAIT_S)
        log.info("tensor parallel: %d ranks stopped in %.1f s", self.size,
                 time.monotonic() - t0)
        self.writer.close()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, kind: Any, *exc: object) -> None:
        self.close(failed=kind is not None)


def start_ranks(cfg: EngineConfig, weights: str, device: torch.device,
                copy_engine: bool = False) -> RankGroup:
    """Start `cfg.tp` ranks (docs/runtime.md); this process is rank 0 on `device`;
    `copy_engine`: every rank maps the copy-engine all-reduce's buffers (a schedule uses it)."""
    size = cfg.tp
    if cfg.model is None:
        raise ConfigError("EngineConfig.model is not set: name a model or an HF folder")
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(f"--tp {size} needs {size} GPUs (one process each); "
                          f"{torch.cuda.device_count()} are visible")
    os.environ.update(MULTICAST_OFF)  # forced, not defaulted; the workers inherit it
    os.environ.update(SAFE_PATH)  # no module of the current folder in any spawned process
    ctx = mp.get_context("spawn")
    writer = ChannelWriter(size - 1)
    port = free_port()
    setup = WorkerSetup(cfg.model, weights, cfg.seed, cfg.kernels, device.type, os.getpid(),
                        copy_engine, cfg.quantization, cfg.dtype)
    procs = []
    for rank in range(1, size):
        p = ctx.Process(target=run_worker, args=(rank, size, port, writer.handle, setup),
                        name=f"nanosched-tp{rank}", daemon=True)
        p.rank = rank
        procs.append(p)
    group = RankGroup(size, procs, writer)
    try:
        for p in procs:
            p.start()
        log.info("tensor parallel: rank 0 is pid %d; ranks 1..%d are pids %s", os.getpid(),
                 size - 1, ", ".join(str(p.pid) for p in procs))
        group._watchdog.start()
        backend = "nccl" if device.type == "cuda" else "gloo"
        bind_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=size, device_id=device if backend == "nccl" else None)
        writer.unlink()  # every worker attached to the channel before it joined the group
    except BaseException:
        group.close(failed=True)
        raise
    return group
