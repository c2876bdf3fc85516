"""The scheduling API and backend on a toy program, on a device that reorders streams.

`ShuffledDevice` queues each stream's launches and, at the end of the forward, runs them in a
random interleaving that only respects stream order and event waits: what a GPU may do. A
strategy whose result differs from `Sequential`'s under it is missing an event.
"""

import random

import pytest
import torch
from runtime_helpers import ShuffledDevice

from nanosched.errors import ScheduleError
from nanosched.runtime.backend import Backend
from nanosched.runtime.device import SerialDevice
from nanosched.runtime.opsched import OpScheduler, SchedContext, pick_strategy, run_program
from nanosched.runtime.program import Access, Program, ProgramOp
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap, wave_aware_split

PROMPTS = [(0, 3), (3, 10), (10, 16)]  # token ranges of three requests' prompts


def prompt_start(t):
    return next(lo for lo, hi in PROMPTS if lo <= t < hi)


def toy_program(layers=3, T=16, D=8, seed=0):
    """proj -> causal mix over the prompt (span read) -> in-place 'network' op -> residual."""
    g = torch.Generator().manual_seed(seed)
    bufs = {"x": torch.randn(T, D, generator=g)}
    for n in ("y", "z"):
        bufs[n] = torch.zeros(T, D)
    ops = []
    for layer in range(layers):
        w = torch.randn(D, D, generator=g) / D**0.5
        kv = f"kv{layer}"
        bufs[kv] = torch.zeros(T, D)

        def proj(s, e, cfg, w=w, kv=kv):
            bufs["y"][s:e] = bufs["x"][s:e] @ w
            bufs[kv][s:e] = torch.tanh(bufs["y"][s:e])

        def mix(s, e, cfg, kv=kv):
            for t in range(s, e):
                bufs["z"][t] = bufs[kv][prompt_start(t):t + 1].mean(0) + bufs["y"][t]

        def net(s, e, cfg):
            bufs["z"][s:e] *= 1.5

        def add(s, e, cfg):
            bufs["x"][s:e] = bufs["x"][s:e] + bufs["z"][s:e]

        span = Access(kv, span=lambda s, e: (prompt_start(s), e))
        ops += [
            ProgramOp("proj", layer, "compute", proj, (Access("x"),), (Access("y"), Access(kv))),
            ProgramOp("mix", layer, "memory", mix, (span, Access("y")), (Access("z"),)),
            ProgramOp("net", layer, "network", net, (Access("z"),), (Access("z"),)),
            ProgramOp("add", layer, "other", add, (Access("x"), Access("z")), (Access("x"),)),
        ]
    return Program(T, tuple(ops)), bufs


def run(strategy, device):
    program, bufs = toy_program()
    run_program(program, strategy, Backend(device))
    return bufs["x"]


class RandomOrder(OpScheduler):
    """Any legal order: random ready nano-op, random stream, random merges."""

    def __init__(self, sizes, seed):
        self.sizes, self.rng = sizes, random.Random(seed)

    def schedule(self, ctx):
        ctx.split(self.sizes)
        while not ctx.done():
            ready = [n for i in range(len(self.sizes)) for n in ctx.get_ready_ops(i)]
            assert ready, "some micro-batch must always be ready"
            pick = self.rng.choice(ready)
            same = sorted((n for n in ready if n.index == pick.index), key=lambda n: n.mb)
            group = same if self.rng.random() < 0.3 else [pick]
            ctx.execute(group, stream=self.rng.choice(["main", "memory", "network"]))


def test_sequential_one_stream_needs_no_waits():
    dev = SerialDevice()
    expected = run(Sequential(), dev)
    assert dev.num_waits == 0
    assert torch.isfinite(expected).all()


@pytest.mark.parametrize("seed", range(12))
def test_any_legal_order_on_reordering_device_equals_sequential(seed):
    expected = run(Sequential(), SerialDevice())
    sizes = random.Random(seed).choice([[8, 8], [3, 7, 6], [5, 5, 3, 3], [1, 15]])
    got = run(RandomOrder(sizes, seed), ShuffledDevice(seed))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_two_batch_overlap_equals_sequential_on_reordering_device():
    expected = run(Sequential(), SerialDevice())
    for seed in range(5):
        got = run(TwoBatchOverlap(sizes=(8, 8)), ShuffledDevice(seed))
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_missing_event_is_caught(monkeypatch):
    expected = run(Sequential(), SerialDevice())
    monkeypatch.setattr(Backend, "_conflicts", lambda self, *a, **k: [])
    wrong = 0
    for seed in range(12):
        got = run(RandomOrder([8, 8], seed), ShuffledDevice(seed))
        wrong += not torch.equal(got, expected)
    assert wrong > 0


def test_cross_micro_batch_span_dependency_gates_readiness():
    program, _ = toy_program()
    ctx = SchedContext(program, Backend(SerialDevice()))
    ctx.split([5, 11])  # request (3, 10) is cut: tokens 5..9 read K/V rows 3..4 of mb 0
    ctx.execute(ctx.get_ready_ops(1))  # proj of mb 1
    assert ctx.get_ready_ops(1) == []  # mix of mb 1 waits for proj of mb 0
    with pytest.raises(ScheduleError, match="L0.proj of micro-batch 0 first"):
        ctx.execute(type(ctx.get_ready_ops(0)[0])(1, 1, 5, 16))
    ctx.execute(ctx.get_ready_ops(0))
    assert [n.index for n in ctx.get_ready_ops(1)] == [1]


def test_merged_micro_batches_are_one_launch():
    program, _ = toy_program(layers=1)
    backend = Backend(SerialDevice())
    ctx = SchedContext(program, backend)
    ctx.split([4, 4, 8])
    ctx.execute([ctx.get_ready_ops(i)[0] for i in range(3)])
    assert backend.num_launches == 1


def test_bad_splits_and_incomplete_strategies():
    program, _ = toy_program(layers=1)
    ctx = SchedContext(program, Backend(SerialDevice()))
    with pytest.raises(ScheduleError, match="sum to the batch's 16 tokens"):
        ctx.split([8, 7])

    class Lazy(OpScheduler):
        name = "lazy"

        def schedule(self, ctx):
            ctx.split([16])

    with pytest.raises(ScheduleError, match="'lazy' returned before dispatching"):
        run_program(program, Lazy(), Backend(SerialDevice()))


@pytest.mark.parametrize("tokens, tiles, sms, expected", [
    (2048, 32, 132, (1024, 1024)),  # 512 CTAs = 4 waves; halves of 256 CTAs = 2 waves each
    (2048, 36, 132, (896, 1152)),  # 576 CTAs = 5 waves; halves would take 3 + 3, 7 + 9 rows 2 + 3
    (256, 8, 132, (128, 128)),
    (300 * 128, 1, 132, (132 * 128, 168 * 128)),  # TokenWeave §3.1's example: 132 + 168 CTAs
])
def test_wave_aware_split(tokens, tiles, sms, expected):
    assert wave_aware_split(tokens, tiles, sms) == expected


class LabelledDevice(SerialDevice):
    """A device that asks for labels, as the GPU timeline device does."""

    wants_labels = True

    def __init__(self):
        super().__init__()
        self.labels = []

    def launch(self, stream, fn, label=""):
        self.labels.append((stream, label))
        fn()


def test_launch_labels_name_layer_op_and_rows_for_devices_that_want_them():
    dev = LabelledDevice()
    assert torch.equal(run(Sequential(), dev), run(Sequential(), SerialDevice()))
    labels = [lab for _, lab in dev.labels]
    assert len(labels) == len(set(labels))  # every launch its own label
    assert labels[:4] == ["L0.proj[0:16]", "L0.mix[0:16]", "L0.net[0:16]", "L0.add[0:16]"]
    program, _ = toy_program(layers=1)
    backend = Backend(dev)
    ctx = SchedContext(program, backend)
    ctx.split([4, 4, 8])
    ctx.execute([ctx.get_ready_ops(i)[0] for i in range(3)])  # one merged launch
    assert dev.labels[-1][1] == "L0.proj[0:4]+L0.proj[4:8]+L0.proj[8:16]"
    assert not Backend(SerialDevice()).wants_labels


def test_pick_strategy_falls_back_only_where_the_strategy_refuses():
    class Picky(Sequential):
        name = "picky"

        def accepts(self, program):
            return program.num_tokens > 8

    big, _ = toy_program(T=16)
    small, _ = toy_program(T=8)
    picky, fallback = Picky(), Sequential()
    assert pick_strategy(picky, fallback, big, 0) == (picky, False)
    assert pick_strategy(picky, fallback, small, 0) == (fallback, True)


def test_each_strategy_name_is_a_literal_in_at_most_three_files():
    """Issue 47 item 3: a strategy is its file plus its registry line, and its name is spelled
    (as a string literal equal to it) in at most 3 files of nanosched/; everything else reads
    the class's `name` or the constant (Sequential's: `constants.SEQUENTIAL`)."""
    import ast
    from pathlib import Path

    from nanosched.runtime.strategies import NAMED
    from nanosched.runtime.strategies.replay import Replay
    from nanosched.runtime.strategies.replay_set import ReplaySet

    root = Path(__file__).resolve().parents[2] / "nanosched"
    names = {*NAMED, Replay.name, ReplaySet.name}
    files: dict[str, set[str]] = {n: set() for n in names}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in files:
                files[node.value].add(str(path.relative_to(root)))
    assert len(names) >= 4 and all(files.values())  # the counter sees each definition
    assert {n: sorted(f) for n, f in files.items() if len(f) > 3} == {}
