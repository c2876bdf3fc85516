"""A worker frees the engine `CloseEngine` names before it builds the next one: the next
engine's KV cache is sized by the GPU memory left, so an engine still referenced (a local of
the message loop) would leave the next one without room (`bench --compare` at tp = 4 of a 70B
model) or, where it still fits, with fewer pages than the run before it."""

from __future__ import annotations

import gc
import weakref
from array import array
from types import SimpleNamespace

import torch

from nanosched.runtime.ranks import follower as fmod
from nanosched.runtime.ranks.messages import Call, CloseEngine, OpenEngine, Step, Stop


class _Engine:
    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(pool=None)
        self.ws = SimpleNamespace(kv=None)
        self.followed = 0

    def follow(self, *chunks) -> None:
        self.followed += 1


class _Loaded:
    def __init__(self) -> None:
        self.engine, self.closed = _Engine(), False

    def close(self) -> None:
        self.closed = True


class _Reader:
    def __init__(self, messages: list) -> None:
        self.messages = messages

    def recv(self, check) -> object:
        return self.messages.pop(0)


def _touch(engine: _Engine) -> None:
    engine.followed += 10


def test_a_closed_engine_is_freed_before_the_next_is_built(monkeypatch):
    built: list[weakref.ref] = []
    alive_at_build: list[list[bool]] = []

    def build(model, config, choice):
        gc.collect()
        alive_at_build.append([r() is not None for r in built])
        loaded = _Loaded()
        built.append(weakref.ref(loaded))
        return loaded

    monkeypatch.setattr(fmod, "build_engine", build)
    monkeypatch.setattr(fmod, "named_choice", lambda *a: None)
    monkeypatch.setattr(fmod, "replay_kv_ops", lambda *a: None)
    step = Step(0, [("op",)], array("q"), [])
    step1 = Step(1, [], array("q"), [])
    messages = [OpenEngine(0, None, "sequential", None), step, Call(0, [], _touch, ()),
                CloseEngine(0), OpenEngine(1, None, "two_batch", None), step1, Stop()]
    model = SimpleNamespace(spec=None, device=torch.device("cpu"))
    f = fmod.Follower(model, _Reader(messages), parent_pid=0)
    f._check_parent = lambda: None
    f.run()
    assert alive_at_build == [[], [False]]
    assert not f.engines and all(r() is None for r in built)
