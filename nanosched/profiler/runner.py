"""The profiling loop: ceilings, kernel table, co-run pairs, the forward table, network rows ->
a checked profile.

`run_profile(settings, backend, options)` drives any `ProfilerBackend`. It saves `FILE.partial.json`
atomically every `SAVE_EVERY` rows; on Ctrl-C it saves it and raises `ProfileInterrupted`,
whose message says how to resume; `--resume` measures only the rows missing from it. With a
deadline (`--time-limit`) it stops before the first piece that would not fit (`budget.py`),
saves, and raises `ProfileStopped`, whose message says how to go on. The network step runs in
batches of pairs, each recorded as it ends. Without a progress bar, a line every
`PROGRESS_EVERY_S` says where the run is and how long the phase has left. A busy GPU
and clock drift (a reference GEMM re-timed every `DRIFT_EVERY` rows, more than `DRIFT_LIMIT`
away from the first timing) are reported on the console and in the profile's notes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from nanosched.models import ops as optable
from nanosched.models.ops import MEMORY
from nanosched.profiler.backend import NetworkRequest, ProfilerBackend, Timing, Unsupported
from nanosched.profiler.budget import (
    MIN_BATCH_PAIRS,
    ROW_MARGIN_S,
    looped_s,
    network_batch,
    network_collectives,
)
from nanosched.profiler.build import build_profile, network_request, record_network
from nanosched.profiler.format import ForwardRow, KernelRow, PairRow, Profile, save_profile
from nanosched.profiler.loop import (
    FINISH_MARGIN_S,
    Loop,
    ProfileInterrupted,
    ProfileStopped,
    RunOptions,
    TimeUp,
)
from nanosched.profiler.plan import (
    KernelTask,
    LayerTask,
    PairTask,
    ProfileSettings,
    kernel_tasks,
    layer_sizes,
    layer_tasks,
    memory_pair_tasks,
    quantized_impls,
)
from nanosched.profiler.state import RunState, load_state, partial_path

__all__ = ["ProfileInterrupted", "ProfileStopped", "RunOptions", "run_profile", "forward_rows",
           "best_impl"]

REFERENCE_REPEATS = 5  # the start reference is the fastest of these
MEMORY_PAIR_IMPL = "triton_pipelined"  # the memory kernel of the pairs: the runtime's default
# attention kernels a pair may run on a partition or CTA bound: the fastest alone there
PARTITION_MEMORY_IMPLS = ("triton_pipelined", "triton_pipelined_2w", "cuda_bulk")


def run_profile(settings: ProfileSettings, backend: ProfilerBackend, opts: RunOptions) -> Profile:
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
    loop = Loop(settings, backend, state, opts)
    try:
        _measure(loop)
    except KeyboardInterrupt:
        if loop.bar is not None:
            loop.bar.close()
        loop.save()
        raise ProfileInterrupted(
            f"interrupted: {len(state.kernels)} kernel rows and {len(state.pairs)} pairs saved "
            f"to {ppath}; continue with {opts.resume_hint}") from None
    except TimeUp as up:
        if loop.bar is not None:
            loop.bar.close()
        loop.save()
        raise ProfileStopped(
            f"time limit: stopped before {up} ({loop.time_left():.0f} s left); "
            f"{len(state.kernels)} kernel rows and {len(state.pairs)} pairs saved to {ppath} "
            f"({state.elapsed_s:.0f} s measured so far); continue with "
            f"{opts.resume_hint}") from None
    except Exception:
        loop.save()  # what was measured stays resumable
        raise
    finally:
        backend.close()
    try:  # every measurement is in the partial now: an interrupt here loses none of them
        if loop.bar is not None:
            loop.bar.close()
        loop.save()
        prof = build_profile(settings, state)
        save_profile(prof, opts.out)
    except KeyboardInterrupt:
        loop.save()
        raise ProfileInterrupted(
            f"interrupted after measuring: all {len(state.kernels)} kernel rows and "
            f"{len(state.pairs)} pairs saved to {ppath}, {opts.out} not written; "
            f"{opts.resume_hint} builds and writes it without measuring again") from None
    ppath.unlink(missing_ok=True)
    total = state.elapsed_s
    opts.log(f"wrote {opts.out}: {len(prof.kernels)} kernel rows, {len(prof.pairs)} pairs, "
             f"R->P classes {sorted(prof.rp) or 'none'}; took {total:.0f} s "
             f"({total / 60:.1f} min)")
    return prof


def _measure(loop: Loop) -> None:
    settings, backend, state = loop.settings, loop.backend, loop.state
    for reason in backend.busy():
        loop.warn(f"GPU busy: {reason}; timings will be slower than on an idle GPU")
    state.partitions = backend.make_partitions(settings.partition_requests())
    impls, impl_notes = backend.implementations()
    impls, fp8_notes = quantized_impls(settings, impls)
    impl_notes = [*impl_notes, *fp8_notes]
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
    has_memory_impl = any(i.name == MEMORY_PAIR_IMPL for i in impls.get(optable.ATTN_DECODE, []))
    if not has_memory_impl:
        state.note(f"no compute x memory pairs: implementation {MEMORY_PAIR_IMPL!r} of "
                   f"attn_decode is not available")

    def pairs() -> list[PairTask]:  # after the kernel rows: each placement's best GEMM
        if not has_memory_impl:
            return []
        few_sm = [i.name for i in impls.get(optable.ATTN_DECODE, [])
                  if i.name in PARTITION_MEMORY_IMPLS]
        return memory_pair_tasks(settings, num_sms, state.partitions, impls, MEMORY_PAIR_IMPL,
                                 lambda *a: best_impl(state, *a),
                                 lambda t, c, s, m: best_impl(state, optable.ATTN_DECODE, t, s, m,
                                                              few_sm, context=c))

    def layers() -> list[LayerTask]:  # after the kernel rows: each op's best on all SMs
        return layer_tasks(settings, num_sms, settings.decode_contexts(),
                           lambda op, t, c: best_impl(state, op, t, num_sms, "full",
                                                      context=c))

    net = network_request(settings, backend, num_sms, impls, state)  # its GEMMs: after rows
    ways = 1 + 2 * len(state.partitions)  # streams, each partition, each CTA bound
    loop.say(f"grid: {len(ktasks)} kernel rows, up to "
             f"{len(settings.pair_shapes()) * ways * has_memory_impl} co-run pairs, "
             f"{len(layer_sizes(settings))} forward layers"
             f"{f', {len(net.pairs)} network pairs on {net.world} GPUs' if net else ''}")
    _run_tasks(loop, ktasks, pairs)
    _run_layers(loop, layers())
    request = network_request(settings, backend, num_sms, impls, state,
                              lambda *a: best_impl(state, *a))
    if request is not None:
        _run_network(loop, request)
    loop.check_drift()


def _run_tasks(loop: Loop, ktasks: list[KernelTask],
               pair_tasks: Callable[[], list[PairTask]]) -> None:
    from tqdm import tqdm

    state = loop.state
    done = sum(1 for t in ktasks if t.key in state.kernels or str(t.key) in state.skipped)
    loop.bar = tqdm(total=len(ktasks), initial=done, unit="row",
                    disable=not loop.opts.progress, desc="kernels", dynamic_ncols=True)
    loop.begin("kernel rows", len(ktasks), done)
    for task in ktasks:
        if task.key not in state.kernels and str(task.key) not in state.skipped:
            loop.need(ROW_MARGIN_S, f"kernel row {task.op} at {task.tokens} tokens")
            _kernel(loop, task)
    ptasks = pair_tasks()
    if ptasks:
        state.note(f"co-run pairs and their own alone times: looped "
                   f"{loop.settings.pair_settle_ms:.0f} ms, then timed over "
                   f"{loop.settings.pair_window_ms:.0f} ms, so the SM clock had settled under "
                   f"the power cap (bench/hardware/power_settle.py)")
    todo = [t for t in ptasks if t.key not in state.pairs and str(t.key) not in state.skipped]
    if todo:
        window = loop.settings.pair_settle_ms + loop.settings.pair_window_ms
        loop.say(f"{len(todo)} co-run pairs, each looped {window / 1e3:.1f} s so that the "
                 f"clock settles under the power cap (about {len(todo) * window / 6e4:.0f} "
                 f"min, plus the alone references)")
    loop.bar.total += len(ptasks)
    loop.bar.n += len(ptasks) - len(todo)
    loop.bar.set_description("pairs")
    loop.begin("co-run pairs", len(ptasks), len(ptasks) - len(todo))
    for task in todo:
        loop.need(3 * looped_s(loop.settings), f"pair {task.compute_op} x {task.other_op}")
        _pair(loop, task)


def _run_layers(loop: Loop, tasks: list[LayerTask]) -> None:
    state = loop.state
    todo = [t for t in tasks if t.key not in state.forward and str(t.key) not in state.skipped]
    loop.bar.total += len(tasks)
    loop.bar.n += len(tasks) - len(todo)
    loop.bar.set_description("forward")
    loop.begin("forward layers", len(tasks), len(tasks) - len(todo))
    if tasks:
        state.note(FORWARD_NOTE)
    for task in todo:
        loop.need(looped_s(loop.settings), f"forward layer of {task.tokens} rows")
        try:
            state.forward[task.key] = forward_rows(
                loop.backend, loop.settings, task, lambda k: state.kernels[k.key].time_us)
        except Unsupported as exc:
            state.skipped[str(task.key)] = str(exc)
        loop.done_one()


def _run_network(loop: Loop, request: NetworkRequest) -> None:
    """The collective rows and the GEMM x all-reduce pairs, in batches that fit the time left
    (`budget.network_batch`), each recorded and saved as it ends; a pair its batch did not
    return (its collective cannot run here) is recorded as skipped."""
    state, settings = loop.state, loop.settings
    todo = [t for t in request.pairs if t.key not in state.pairs and str(t.key) not in
            state.skipped]
    loop.bar.total += len(request.pairs)
    loop.bar.n += len(request.pairs) - len(todo)
    loop.bar.set_description("network")
    loop.begin("network pairs", len(request.pairs), len(request.pairs) - len(todo))
    while state.network is None or todo:
        known = state.network is not None
        num = 0 if known else network_collectives(len(request.tokens), len(request.ctas),
                                                   len(request.copy_engine_ctas))
        room = loop.time_left() - FINISH_MARGIN_S
        batch, cost = network_batch(settings, todo, num, room)
        if cost > room or (todo and not batch):
            raise TimeUp(f"the next network batch (at least {min(len(todo), MIN_BATCH_PAIRS)} "
                         f"pairs{'' if known else ' and the collective rows'})")
        loop.say(f"network: {'' if known else f'{num} collective rows and '}{len(batch)} "
                 f"pairs on {request.world} GPUs, about {cost:.0f} s")
        times = tuple(tuple(x) for x in state.network["times"]) if known else ()
        result = loop.backend.network(settings, replace(request, pairs=tuple(batch),
                                                        times_us=times))
        record_network(state, result)
        for task in batch:
            if task.key not in state.pairs:
                state.skipped[str(task.key)] = f"{task.other_impl} did not run on the GPUs"
        todo = todo[len(batch):]
        loop.bar.update(len(batch))
        loop.report(len(batch))
        loop.save()


FORWARD_NOTE_PREFIX = "forward table: "  # the forward table's note (an older one replaced)
FORWARD_NOTE = (f"{FORWARD_NOTE_PREFIX}a Sequential layer of the fastest rows on all SMs (the "
                "workload's mix at half and all of the dense batch, decode only at a quarter), "
                "looped until the clock settled under the power cap, each op's span beside its "
                "row (F = span / row: what the search multiplies a row by for an op alone on "
                "the whole GPU inside a forward)")


def forward_rows(backend: ProfilerBackend, settings: ProfileSettings, task: LayerTask,
                 row_us: Callable[[KernelTask], float]) -> list[ForwardRow]:
    """Time `task`'s layer sustained (`time_layer`) and set each op beside its kernel row."""
    t = backend.time_layer(settings, task)
    return [ForwardRow(op=k.op, batch_tokens=task.tokens, num_decode=task.num_decode,
                       tokens=k.tokens, impl=k.impl, row_us=row_us(k), time_us=round(us, 3),
                       context=k.context, settle_ms=settings.pair_settle_ms,
                       window_ms=settings.pair_window_ms, clock_mhz=_round(t.clock_mhz),
                       power_w=_round(t.power_w))
            for k, us in zip(task.ops, t.op_us, strict=True)]


def _kernel(loop: Loop, task: KernelTask) -> None:
    try:
        t = loop.backend.time_kernel(loop.settings, task)
    except Unsupported as exc:
        loop.state.skipped[str(task.key)] = str(exc)
    else:
        loop.state.kernels[task.key] = KernelRow(
            op=task.op, tokens=task.tokens, time_us=t.us, sms=task.sms, mechanism=task.mechanism,
            impl=task.impl, context=task.context, clock_mhz=_round(t.clock_mhz),
            power_w=_round(t.power_w))
    loop.done_one()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def best_impl(state: RunState, op: str, tokens: int, sms: int, mechanism: str,
              among: list[str] | None = None, context: int | None = None) -> str | None:
    """The implementation of `op` fastest alone at (tokens, sms, mechanism), of `among` when
    given, at `context` when given (else any); None when no such row was measured."""
    rows = [row for key, row in state.kernels.items()
            if key[0] == op and key[1] == tokens and key[3] == sms and key[4] == mechanism
            and (context is None or key[2] == context)
            and (among is None or row.impl in among)]
    return min(rows, key=lambda r: r.time_us).impl if rows else None


def _alone(loop: Loop, op: str, impl: str, tokens: int, context: int) -> Timing | None:
    """`op` with `impl` looped alone on the whole GPU until the clock settled (cached)."""
    state, key = loop.state, (op, impl, tokens, context)
    if key not in state.alone:
        full = state.identity.num_sms
        row = state.kernels.get((op, tokens, context, full, "full", impl))
        if row is None:
            return None
        task = KernelTask(op, tokens, context, full, "full", impl)
        t = loop.backend.time_sustained(loop.settings, task, row.time_us)
        state.alone[key] = [t.us, _round(t.clock_mhz), _round(t.power_w)]
    us, clock, power = state.alone[key]
    return Timing(us, clock, power)


def _pair(loop: Loop, task: PairTask) -> None:
    """A pair normalised to each kernel's best implementation alone on the whole GPU, both
    timed sustained."""
    state = loop.state
    full = state.identity.num_sms
    try:
        best_c = best_impl(state, task.compute_op, task.tokens, full, "full")
        alone_c = best_c and _alone(loop, task.compute_op, best_c, task.tokens, 0)
        best_o = best_impl(state, task.other_op, task.tokens, full, "full",
                           context=task.context) or task.other_impl
        alone_o = _alone(loop, task.other_op, best_o, task.tokens, task.context)
        if not alone_c or not alone_o:
            state.skipped[str(task.key)] = "a kernel of the pair has no full-GPU row"
            loop.done_one()
            return
        t = loop.backend.time_pair(loop.settings, task, (alone_c.us, alone_o.us))
    except Unsupported as exc:
        state.skipped[str(task.key)] = str(exc)
    else:
        state.pairs[task.key] = PairRow(
            compute_op=task.compute_op, other_op=task.other_op, other_class=MEMORY,
            tokens=task.tokens, mechanism=task.mechanism, compute_impl=task.compute_impl,
            compute_sms=task.compute_sms, other_sms=task.other_sms,
            compute_alone_us=alone_c.us, other_alone_us=alone_o.us, compute_us=t.compute_us,
            other_us=t.other_us, context=task.context,
            settle_ms=loop.settings.pair_settle_ms, window_ms=loop.settings.pair_window_ms,
            clock_mhz=_round(t.clock_mhz), power_w=_round(t.power_w),
            compute_alone_clock_mhz=alone_c.clock_mhz, other_alone_clock_mhz=alone_o.clock_mhz,
            other_impl=task.other_impl if task.other_impl != MEMORY_PAIR_IMPL else "")
    loop.done_one()
