"""bench/engine/replay_timeline.py's tp = 2 path on two GPUs (NCCL, bf16): every strategy runs
eager, as a CUDA graph with the all-reduces captured, and matches Sequential to bf16 rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nanosched.benchmarks.timeline import STRATEGIES, TimelineConfig, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

DATA = Path(__file__).parents[1] / "data"


def test_tp2_timeline_on_two_gpus(tmp_path):
    folder = tmp_path / "tiny"  # the schedule's model is named "tiny"
    folder.mkdir()
    (folder / "config.json").write_text((DATA / "tiny_llama_config.json").read_text())
    cfg = TimelineConfig(str(DATA / "tiny_llama_tp2_schedule.json"), model=str(folder),
                         force=True)  # searched on a synthetic H100 profile
    out = run(cfg, tp=2)  # sets the multicast-off variables before the ranks start
    assert list(out["results"]) == list(STRATEGIES) and len(out["per_rank"]) == 2
    for name, row in out["results"].items():
        assert "graph_error" not in row, row.get("graph_error")
        assert row["graph_ms"] > 0
        assert row["check"]["finite"]
        assert row["check"]["rel_l2_vs_sequential"] < 2e-2, name
