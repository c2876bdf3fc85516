"""The profiling loop: ceilings, kernel table, co-run pairs, network rows -> a checked profile.

`run_profile(settings, backend, options)` drives any `Backend`. It saves `FILE.partial.json`
atomically every `SAVE_EVERY` rows; on Ctrl-C it saves it and raises `ProfileInterrupted`,
whose message says how to resume; `--resume` measures only the rows missing from it. A busy GPU
and clock drift (a reference GEMM re-timed every `DRIFT_EVERY` rows, more than `DRIFT_LIMIT`
away from the first timing) are reported on the console and in the profile's notes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanosched.errors import NanoschedError
from nanosched.models.ops import MEMORY
from nanosched.profiler.backend import Backend, Unsupported
from nanosched.profiler.build import build_profile, network_request, record_network
from nanosched.profiler.format import KernelRow, PairRow, Profile, save_profile
from nanosched.profiler.plan import (
    KernelTask,
    PairTask,
    ProfileSettings,
    kernel_tasks,
    memory_pair_tasks,
)
from nanosched.profiler.state import RunState, load_state, partial_path, save_state

SAVE_EVERY = 100  # rows, or
SAVE_EVERY_S = 15.0  # seconds, whichever comes first
DRIFT_EVERY = 200
DRIFT_LIMIT = 0.05
REFERENCE_REPEATS = 5  # the start reference is the fastest of these
MEMORY_PAIR_IMPL = "triton_paged"


class ProfileInterrupted(NanoschedError):
    """Ctrl-C during a profile; the partial file is saved and the message says how to resume."""


@dataclass
class RunOptions:
    out: Path
    resume: bool = False
    progress: bool = True
    command: str = ""
    log: Callable[[str], None] = print
    resume_hint: str = "the same command with --resume"


@dataclass
class _Loop:
    settings: ProfileSettings
    backend: Backend
    state: RunState
    opts: RunOptions
    bar: Any = None
    since_save: int = 0
    since_drift: int = 0
    started: float = field(default_factory=time.perf_counter)
    saved_at: float = field(default_factory=time.perf_counter)

    def warn(self, text: str) -> None:
        (self.bar.write if self.bar is not None else self.opts.log)(f"warning: {text}")
        self.state.note(text)

    def done_one(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
        self.since_save += 1
        self.since_drift += 1
        if self.since_save >= SAVE_EVERY or time.perf_counter() - self.saved_at > SAVE_EVERY_S:
            self.save()
        if self.since_drift >= DRIFT_EVERY:
            self.check_drift()

    def save(self) -> None:
        now = time.perf_counter()
        self.state.elapsed_s += now - self.started
        self.started = now
        save_state(self.state, partial_path(self.opts.out))
        self.since_save, self.saved_at = 0, time.perf_counter()

    def check_drift(self) -> None:
        self.since_drift = 0
        ref = self.state.reference_us
        now = self.backend.reference_us()
        if ref and abs(now / ref - 1) > DRIFT_LIMIT:
            why = ("slower: throttling or another process" if now > ref else
                   "faster: the start was measured before the clocks settled")
            self.warn(f"reference GEMM takes {now:.1f} us, {100 * (now / ref - 1):+.0f}% from "
                      f"{ref:.1f} us at the start ({why}); rows measured around now are suspect")


def run_profile(settings: ProfileSettings, backend: Backend, opts: RunOptions) -> Profile:
    """Measure everything `settings` asks for, write `opts.out`, return the profile."""
    identity = backend.identity(opts.command)
    ppath = partial_path(opts.out)
    if opts.resume:
        state = load_state(ppath, settings, identity)
        opts.log(f"resuming {ppath}: {len(state.kernels)} kernel rows and {len(state.pairs)} "
                 f"pairs already measured")
    else:
        if ppath.exists():
            opts.log(f"note: starting over; {ppath} from an earlier run is replaced "
                     f"(use --resume to continue it instead)")
        state = RunState(settings=settings.to_json(), identity=identity)
    loop = _Loop(settings, backend, state, opts)
    try:
        _measure(loop)
    except KeyboardInterrupt:
        if loop.bar is not None:
            loop.bar.close()
        loop.save()
        raise ProfileInterrupted(
            f"interrupted: {len(state.kernels)} kernel rows and {len(state.pairs)} pairs saved "
            f"to {ppath}; continue with {opts.resume_hint}") from None
    finally:
        backend.close()
    if loop.bar is not None:
        loop.bar.close()
    loop.save()
    prof = build_profile(settings, state)
    save_profile(prof, opts.out)
    ppath.unlink(missing_ok=True)
    total = state.elapsed_s
    opts.log(f"wrote {opts.out}: {len(prof.kernels)} kernel rows, {len(prof.pairs)} pairs, "
             f"R->P classes {sorted(prof.rp) or 'none'}; took {total:.0f} s "
             f"({total / 60:.1f} min)")
    return prof


def _measure(loop: _Loop) -> None:
    settings, backend, state = loop.settings, loop.backend, loop.state
    for reason in backend.busy():
        loop.warn(f"GPU busy: {reason}; timings will be slower than on an idle GPU")
    state.partitions = backend.make_partitions(settings.partition_requests())
    impls, impl_notes = backend.implementations()
    for text in impl_notes:
        state.note(text)
    if state.ceilings is None:
        state.ceilings = backend.ceilings(settings)
    # the fastest of a few: the first runs may catch the clocks still ramping up (seen on an
    # H200: 199.5 us first, 174 us for the rest of the profile)
    ref = min(backend.reference_us() for _ in range(REFERENCE_REPEATS))
    if state.reference_us is None:
        state.reference_us = ref
    else:
        loop.check_drift()
    loop.save()
    num_sms = state.identity.num_sms
    ktasks = kernel_tasks(settings, num_sms, state.partitions, impls)
    has_memory_impl = any(i.name == MEMORY_PAIR_IMPL for i in impls.get("attn_decode", []))
    ptasks = memory_pair_tasks(settings, num_sms, state.partitions, impls,
                               MEMORY_PAIR_IMPL) if has_memory_impl else []
    if not has_memory_impl:
        state.note(f"no compute x memory pairs: implementation {MEMORY_PAIR_IMPL!r} of "
                   f"attn_decode is not available")
    request = network_request(settings, backend, num_sms, impls, state)
    _run_tasks(loop, ktasks, ptasks, request is not None)
    if request is not None and state.network is None:
        result = backend.network(settings, request)
        record_network(state, settings, request, result, num_sms)
        loop.done_one()
    loop.check_drift()


def _run_tasks(loop: _Loop, ktasks: list[KernelTask], ptasks: list[PairTask],
               network: bool) -> None:
    from tqdm import tqdm

    state = loop.state
    total = len(ktasks) + len(ptasks) + int(network)
    done = sum(1 for t in ktasks if t.key in state.kernels or str(t.key) in state.skipped)
    done += sum(1 for t in ptasks if t.key in state.pairs or str(t.key) in state.skipped)
    done += int(network and state.network is not None)
    loop.bar = tqdm(total=total, initial=done, unit="row", disable=not loop.opts.progress,
                    desc="profile", dynamic_ncols=True)
    for task in ktasks:
        if task.key not in state.kernels and str(task.key) not in state.skipped:
            _kernel(loop, task)
    for task in ptasks:
        if task.key not in state.pairs and str(task.key) not in state.skipped:
            _pair(loop, task)


def _kernel(loop: _Loop, task: KernelTask) -> None:
    try:
        us = loop.backend.time_kernel(loop.settings, task)
    except Unsupported as exc:
        loop.state.skipped[str(task.key)] = str(exc)
    else:
        loop.state.kernels[task.key] = KernelRow(
            op=task.op, tokens=task.tokens, time_us=us, sms=task.sms, mechanism=task.mechanism,
            impl=task.impl, context=task.context)
    loop.done_one()


def best_full_us(state: RunState, op: str, tokens: int, context: int) -> float | None:
    """Fastest time of `op` alone on the whole GPU, any implementation."""
    full = state.identity.num_sms
    times = [row.time_us for key, row in state.kernels.items()
             if key[:4] == (op, tokens, context, full) and row.mechanism == "full"]
    return min(times) if times else None


def _pair(loop: _Loop, task: PairTask) -> None:
    state = loop.state
    alone_c = best_full_us(state, task.compute_op, task.tokens, 0)
    alone_o = best_full_us(state, task.other_op, task.tokens, task.context)
    if alone_c is None or alone_o is None:
        state.skipped[str(task.key)] = "a kernel of the pair has no full-GPU row"
        loop.done_one()
        return
    try:
        c_us, o_us = loop.backend.time_pair(loop.settings, task, (alone_c, alone_o))
    except Unsupported as exc:
        state.skipped[str(task.key)] = str(exc)
    else:
        state.pairs[task.key] = PairRow(
            compute_op=task.compute_op, other_op=task.other_op, other_class=MEMORY,
            tokens=task.tokens, mechanism=task.mechanism, compute_impl=task.compute_impl,
            compute_sms=task.compute_sms, other_sms=task.other_sms, compute_alone_us=alone_c,
            other_alone_us=alone_o, compute_us=c_us, other_us=o_us, context=task.context)
    loop.done_one()
