"""bench/tools/aba_merge.py: three one-run bench records as one A-B-A record, its ratio as
`bench --compare` computes it, and records that do not form one refused with what differs."""

import importlib.util
import json
import sys

import pytest
from repo import ROOT

from nanosched.benchmarks.report import run_ratio

_spec = importlib.util.spec_from_file_location("aba_merge",
                                               ROOT / "bench" / "tools" / "aba_merge.py")
am = importlib.util.module_from_spec(_spec)
sys.modules["aba_merge"] = am
_spec.loader.exec_module(am)


def record(strategy, tps, collective="nccl", date="2026-11-27T12:00:00+00:00", **config):
    name = ("sequential" if strategy == "sequential" else strategy) + "+graphs"
    cfg = {"model": "llama3-70b", "tp": 4, "workload": None, "input_len": 1024,
           "output_len": 512, "num_prompts": 1000, "dense_batch": 2048, "graphs": "on",
           "weights": "random", "seed": 0, "kv_dtype": "auto", "request_rate": None,
           "schedule": strategy, "collective": collective, **config}
    run = {"strategy": strategy, "graphs": True, "iterations": 2000,
           "pipelined_iterations": 0 if strategy == "sequential" else 2000,
           "results": {"tokens_per_s": tps, "elapsed_s": 200.0}}
    return {"config": cfg, "environment": {"date": date, "device": "NVIDIA H100 80GB HBM3",
                                           "command": f"bench --schedule {strategy}"},
            "model_params": 70e9, "runs": {name: run}}


def test_three_records_make_one_aba_with_bench_compares_ratio():
    a1, b, a2 = (record("sequential", 9000.0), record("two_batch", 7200.0, "copy_engine"),
                 record("sequential", 8800.0))
    out = am.merge(a1, b, a2)
    assert list(out["runs"]) == ["sequential+graphs", "two_batch+graphs",
                                 "sequential-after+graphs"]
    assert [r["collective"] for r in out["runs"].values()] == ["nccl", "copy_engine", "nccl"]
    assert out["config"]["collective"] == "copy_engine"
    assert out["config"]["baseline_collective"] == "nccl" and out["config"]["compare"]
    assert out["ratio"]["tokens_per_s"] == pytest.approx(7200.0 / 8900.0)
    assert out["ratio"]["sequential_drift"] == pytest.approx(8800.0 / 9000.0)
    assert out["ratio"] == run_ratio(out["runs"], "two_batch+graphs", "sequential+graphs")
    assert out["environment"]["commands"] == ["bench --schedule sequential",
                                              "bench --schedule two_batch",
                                              "bench --schedule sequential"]


@pytest.mark.parametrize("change, match", [
    (lambda a1, b, a2: a2["config"].update(num_prompts=500), "num_prompts"),
    (lambda a1, b, a2: b["environment"].update(device="NVIDIA H200"), "different GPUs"),
    (lambda a1, b, a2: a2["config"].update(collective="copy_engine"), "different all-reduces"),
    (lambda a1, b, a2: a1["runs"]["sequential+graphs"].update(strategy="two_batch"),
     "must be Sequential"),
    (lambda a1, b, a2: b["runs"].update(more={}), "one run"),
])
def test_records_that_are_not_one_aba_are_refused(change, match):
    a1, b, a2 = (record("sequential", 9000.0), record("two_batch", 7200.0),
                 record("sequential", 8800.0))
    change(a1, b, a2)
    with pytest.raises(am.MergeError, match=match):
        am.merge(a1, b, a2)


def test_the_command_writes_the_record_or_says_what_is_wrong(tmp_path, capsys):
    paths = []
    for i, r in enumerate((record("sequential", 9000.0), record("two_batch", 7200.0),
                           record("sequential", 8800.0))):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    out = tmp_path / "aba.json"
    assert am.main([*map(str, paths), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ratio"]["tokens_per_s"] == pytest.approx(7200 / 8900)
    assert "0.809x" in capsys.readouterr().out
    paths[2].write_text(json.dumps({"runs": {}}))
    assert am.main([*map(str, paths), "--json", str(tmp_path / "x.json")]) == 2
    assert "expected a record of one run" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
