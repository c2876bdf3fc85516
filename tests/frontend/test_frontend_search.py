"""A schedule searched for Qwen2 and Mixtral (synthetic H100 profile, the steady state of a
256-token batch) replays on the HF models through the frontend exactly as Sequential runs them,
on a device that reorders streams as a GPU may: with tests/frontend/test_frontend_replay.py
(Llama) and test_frontend_profile.py (GPT-2), every architecture under every strategy."""

from __future__ import annotations

import json

import pytest
import torch
from frontend_helpers import tiny_hf
from runtime_helpers import ShuffledDevice, batch_logits
from typer.testing import CliRunner

from nanosched.cli import app
from nanosched.frontend import FrontendModel
from nanosched.frontend.hf import llama_rules, use_nanosched
from nanosched.runtime.device import SerialDevice
from nanosched.runtime.strategies import Sequential
from nanosched.runtime.strategies.replay import Replay
from nanosched.schedules.format import Schedule


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "mixtral"])
def test_a_searched_schedule_replays_on_the_hf_model(tmp_path, arch):
    model = tiny_hf(arch)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(tmp_path)
    out = tmp_path / "set.json"
    res = CliRunner().invoke(app, ["search", "--model", str(tmp_path), "--gpu", "h100",
                                   "--dense-batch", "256", "--buckets", "dense",
                                   "--time-limit", "5", "--out", str(out)])
    assert res.exit_code == 0, res.output
    entry = json.loads(out.read_text())["entries"][0]
    schedule = Schedule.from_json(entry["schedule"])
    use_nanosched(model)
    fm = FrontendModel(model, llama_rules())
    assert set(schedule.ranges) <= set(fm.op_names())
    assert len(schedule.nano_ops) > len(schedule.ranges)  # split into nano-batches
    with torch.inference_mode():
        want = batch_logits(fm, Sequential(), SerialDevice(), entry["num_decode"])
        got = batch_logits(fm, Replay(schedule, fm.num_layers), ShuffledDevice(2),
                           entry["num_decode"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
