"""`nanosched profile` and `search` take a frontend model: its shapes read off the partition,
its own ops measured, the search on the profile alone, the result replayed on the model.

GPT-2 (tests/data/frontend_gpt2.py: the rules of docs/usage.md) is profiled on the simulated
GPU (the profiler's loop, tables and pairs; the frontend's kernels themselves are run here on
the CPU and on a GPU by tests/gpu/test_frontend_gpu.py), searched without `--model` (the
profile's model), and the searched pipeline of the steady state replays on the model exactly
as Sequential runs it.
"""

from __future__ import annotations

import json

import pytest
import torch
from frontend_helpers import shared_frontend
from repo import DATA
from runtime_helpers import ShuffledDevice, batch_logits
from typer.testing import CliRunner

from nanosched.cli import app
from nanosched.errors import ConfigError
from nanosched.frontend import FrontendModel
from nanosched.frontend.boundary import rows
from nanosched.frontend.profiling import FrontendImpls, load_frontend, model_spec
from nanosched.models.spec import spec_from_hf_config
from nanosched.profiler.impl_registry import OpCall, ScratchSpace
from nanosched.runtime.device import SerialDevice
from nanosched.runtime.strategies import Sequential
from nanosched.runtime.strategies.replay import Replay
from nanosched.schedules.format import Schedule

GPT2 = f"{DATA / 'frontend_gpt2.py'}:build"
SHAPE = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
         "intermediate_size", "vocab_size")


@pytest.fixture(scope="module")
def gpt2():
    """The CLI's frontend model (`--frontend tests/data/frontend_gpt2.py:build`), loaded once:
    the tests that take it only read it."""
    return load_frontend(GPT2, "cpu")


def test_the_spec_is_read_off_the_partition(gpt2):
    hf, fm = shared_frontend("llama")
    want = spec_from_hf_config(hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"]},
                               name="x")
    got = model_spec(fm, "x")
    assert [getattr(got, f) for f in SHAPE] == [getattr(want, f) for f in SHAPE]
    small = model_spec(gpt2, "gpt2-tiny")
    assert [getattr(small, f) for f in SHAPE] == [64, 2, 4, 4, 16, 256, 256]


def test_ops_the_search_does_not_know_are_refused():
    from test_partition import RULES, toy

    with pytest.raises(ConfigError, match="profiles and the search take the named-op layer"):
        model_spec(FrontendModel(toy(), RULES), "toy")
    with pytest.raises(ConfigError, match="has no function nope"):
        load_frontend(f"{DATA / 'frontend_gpt2.py'}:nope", "cpu")


def test_the_frontends_kernels_run_its_own_ops(gpt2):
    fm = gpt2
    spec, reg = model_spec(fm, "gpt2-tiny"), FrontendImpls(fm)
    have, _ = reg.available(fm.op_names())
    assert {i.name for i in have["ug"]} >= {"cublas", "cublaslt"} and \
        [i.name for i in have["act"]] == ["torch"]

    def call(op: str, tokens: int, context: int = 0) -> OpCall:
        return OpCall(spec, 1, op, tokens, context, 132, "full", 132,
                      ScratchSpace(torch.device("cpu")), 256)

    for op in fm.op_names():
        name = "cublas" if op in ("kqv", "o", "ug", "d") else "torch"
        reg.get(op, name).kernel(call(op, 128, 96)).fn()
    step, ws = reg.steps["ug"], reg._ws  # the last row's workspace holds ug's rows too
    reg.get("ug", "cublas").kernel(call("ug", 64)).fn()
    x, y = (rows(ws.buffers[fm.buffers[v]], fm.values[v], 0, 64).reshape(64, -1)
            for v in (step.reads()[0], step.writes()[0]))
    c_fc = fm.model.transformer.h[0].mlp.c_fc
    torch.testing.assert_close(y, torch.addmm(c_fc.bias, x, c_fc.weight))
    layer = [(call(op, 128, 96 if op.startswith("attn") else 0), "torch" if op not in (
        "kqv", "o", "ug", "d") else "cublas") for op in fm.op_names()]
    for kernel in reg.layer_kernels(layer):
        kernel.fn()
    assert all(torch.isfinite(b).all() for b in ws.buffers.values())


@pytest.mark.slow
def test_profile_search_and_replay_a_model_the_project_does_not_register(tmp_path):
    runner = CliRunner()
    prof, sset = tmp_path / "p.json", tmp_path / "s.json"
    res = runner.invoke(app, ["profile", "--frontend", GPT2, "--model", "gpt2-tiny",
                              "--fake-gpu", "--quick", "--dense-batch", "256", "--out",
                              str(prof), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads(prof.read_text())["model"]["name"] == "gpt2-tiny"
    res = runner.invoke(app, ["search", "--profile", str(prof), "--buckets", "dense",
                              "--time-limit", "10", "--out", str(sset)])
    assert res.exit_code == 0, res.output
    data = json.loads(sset.read_text())
    assert data["model"]["name"] == "gpt2-tiny"
    entry = data["entries"][0]
    schedule = Schedule.from_json(entry["schedule"])
    fm = load_frontend(GPT2, "cpu")
    with torch.inference_mode():
        want = batch_logits(fm, Sequential(), SerialDevice(), entry["num_decode"])
        got = batch_logits(fm, Replay(schedule, fm.num_layers), ShuffledDevice(1),
                           entry["num_decode"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
