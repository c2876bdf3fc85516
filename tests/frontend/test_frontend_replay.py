"""A searched schedule replays on HF Llama through the frontend, as on the named-op model.

The tiny Llama of tests/data (its config made into an HF `LlamaForCausalLM`) partitioned by
`llama_rules()` has the named-op model's ops, so `Replay` of the schedule searched for that
model (tests/data/tiny_llama_schedule.json: merged nano-batches on several streams, layer
offsets) runs it; on a device that reorders streams as a GPU may, every mix of decode and
prompt rows gives Sequential's logits, and so does the two-batch overlap.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from hf_models import randomize
from repo import DATA
from runtime_helpers import ShuffledDevice, batch_logits

from nanosched.frontend import FrontendModel
from nanosched.frontend.hf import llama_rules, use_nanosched
from nanosched.runtime.device import SerialDevice
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap
from nanosched.runtime.strategies.replay import Replay
from nanosched.schedules.format import load_schedule


@pytest.fixture(scope="module")
def fm():
    cfg = json.loads((DATA / "tiny_llama_config.json").read_text())
    cfg.pop("architectures")
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg))
    randomize(model, 0)
    use_nanosched(model.eval())
    return FrontendModel(model, llama_rules())


@pytest.mark.parametrize("n_decode", [0, 40, 200])
def test_replay_and_two_batch_equal_sequential_on_a_reordering_device(fm, n_decode):
    schedule = load_schedule(DATA / "tiny_llama_schedule.json")
    with torch.inference_mode():
        expected = batch_logits(fm, Sequential(), SerialDevice(), n_decode)
        for seed in range(2):
            got = batch_logits(fm, Replay(schedule, fm.num_layers), ShuffledDevice(seed),
                               n_decode)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        got = batch_logits(fm, TwoBatchOverlap(), ShuffledDevice(7), n_decode)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_schedule_names_exactly_the_partitions_ops(fm):
    schedule = load_schedule(DATA / "tiny_llama_schedule.json")
    assert set(schedule.ranges) <= set(fm.op_names())
    assert {op for op, _ in fm.layer_ops()} - set(schedule.ranges) <= {"attn_prefill"}
