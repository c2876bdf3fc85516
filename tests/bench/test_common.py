"""bench/_common.py's pricing helpers that need no GPU."""

from types import SimpleNamespace

import pytest

from bench._common import context_clamp


def test_context_clamp_keeps_a_context_within_the_ops_measured_ones():
    rows = [SimpleNamespace(op="attn_prefill", context=1000),
            SimpleNamespace(op="attn_decode", context=500),
            SimpleNamespace(op="attn_decode", context=2000),
            SimpleNamespace(op="ug", context=0)]
    within = context_clamp(SimpleNamespace(kernels=rows))
    assert within("attn_prefill", 976) == 1000 and within("attn_prefill", 1200) == 1000
    assert within("attn_decode", 1415.5) == 1415.5
    assert within("attn_decode", 100) == 500 and within("attn_decode", 5000) == 2000
    assert within("ug", 300) == 300 and within("rope_append", 7) == 7  # no context rows
    assert within("attn_decode", None) is None


def test_fastest_skips_a_launch_that_raises_and_records_every_launch(monkeypatch):
    """The kernel sweeps' pick: each launch run once, one that raises recorded by its exception's
    name and not timed, the rest timed (here a stand-in for the CUDA-graph timer)."""
    from bench import _common

    times = {"a": 3.14159, "c": 2.0}
    ran = []

    def launch(name: str):
        def run() -> None:
            ran.append(name)
            if name == "b":
                raise MemoryError("too large a tile")
        return run

    launches = {name: launch(name) for name in ("a", "b", "c")}
    timed = {launches[k]: v for k, v in times.items()}
    monkeypatch.setattr(_common, "graph_us", lambda run: timed[run])
    assert _common.fastest(launches) == (2.0, "c", {"a": 3.14, "b": "MemoryError", "c": 2.0})
    assert ran == ["a", "b", "c"]
    with pytest.raises(RuntimeError, match="no launch ran"):
        _common.fastest({"b": launch("b")})
