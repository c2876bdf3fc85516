"""A tensor-parallel worker: ranks 1..N-1 of an engine whose rank 0 schedules.

`run_worker` is the spawned process's entry (runtime/ranks/group.py starts it). It ties its life
to rank 0's (PR_SET_PDEATHSIG, and a parent check while it waits), ignores SIGINT and SIGTERM
(rank 0 stops it), joins the process group, loads its shards of the model, then follows rank
0's messages (runtime/ranks/messages.py) until `Stop`: it builds the engines rank 0 opens,
replays each step's KV journal and runs the same forward, runs calls, and closes.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

from nanosched.kernels.common import bind_device
from nanosched.models.parallel import TensorParallel
from nanosched.models.spec import load_spec
from nanosched.runtime.kv_pool import replay_kv_ops
from nanosched.runtime.loader import LoadedEngine, build_engine, load_model, named_choice
from nanosched.runtime.ranks.channel import ChannelHandle, ChannelReader
from nanosched.runtime.ranks.messages import (
    Call,
    CloseEngine,
    OpenEngine,
    Step,
    Stop,
    WorkerSetup,
)

PR_SET_PDEATHSIG = 1
LEAVE_DUMP_S = 8.0  # below group.STOP_WAIT_S, after which rank 0 kills a worker still alive


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when rank 0 goes (Linux), and end now if it
    already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def run_worker(rank: int, size: int, port: int, handle: ChannelHandle,
               setup: WorkerSetup) -> None:
    """A worker process's whole life (docs/runtime.md)."""
    _die_with_parent(setup.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cuda = setup.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:  # ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    bind_device(device)
    reader = ChannelReader(handle, rank - 1)  # before joining: rank 0 then unlinks the channel
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, device_id=device if cuda else None)
    model = load_model(load_spec(setup.model), setup.weights, device, setup.seed,
                       TensorParallel(rank, size), setup.kernels, copy_engine=setup.copy_engine,
                       quantization=setup.quantization, dtype=setup.dtype)
    with torch.inference_mode():
        Follower(model, reader, setup.parent_pid).run()
    reader.close()
    faulthandler.dump_traceback_later(LEAVE_DUMP_S)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


class Follower:
    """The engines of one worker, driven by rank 0's messages."""

    def __init__(self, model: Any, reader: ChannelReader, parent_pid: int) -> None:
        self.model, self.reader, self.parent_pid = model, reader, parent_pid
        self.engines: dict[int, LoadedEngine] = {}

    def _check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            os._exit(1)  # rank 0 is gone (PR_SET_PDEATHSIG covers Linux; this, the rest)

    def run(self) -> None:
        """Follow rank 0's messages until `Stop`, then release the engines still open."""
        self._follow()
        for key in list(self.engines):
            self.engines.pop(key).close()
        gc.collect()

    def _follow(self) -> None:
        while not isinstance(msg := self.reader.recv(self._check_parent), Stop):
            self._handle(msg)

    def _handle(self, msg: Any) -> None:
        """One message. An engine is referenced only from `self.engines` between messages, so
        the one `CloseEngine` pops is freed (its KV cache and graph pools) before the next
        `OpenEngine` sizes its cache by the memory left."""
        if isinstance(msg, Step):
            loaded = self.engines[msg.key]
            self._replay(loaded, msg.ops)
            loaded.engine.follow(*msg.chunks())
        elif isinstance(msg, OpenEngine):
            choice = named_choice(msg.strategy, msg.schedule, self.model.spec,
                                  self.model.device)
            self.engines[msg.key] = build_engine(self.model, msg.config, choice)
        elif isinstance(msg, Call):
            loaded = self.engines[msg.key]
            self._replay(loaded, msg.ops)
            msg.fn(loaded.engine, *msg.args)
        elif isinstance(msg, CloseEngine):
            self.engines.pop(msg.key).close()
            gc.collect()
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()

    @staticmethod
    def _replay(loaded: LoadedEngine, ops: list[tuple]) -> None:
        if ops:
            eng = loaded.engine
            pool = eng.scheduler.pool
            replay_kv_ops(ops, eng.ws.kv, pool.swap if pool is not None else None)
