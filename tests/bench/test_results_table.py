"""bench/results_table.py: the README's results table and bench/results/INDEX.md from the
records, the latest file per experiment, --check and --archive; and the README in step with
bench/results (so the table cannot drift)."""

import importlib.util
import json
import subprocess
import sys

import pytest
from repo import ROOT

_spec = importlib.util.spec_from_file_location("results_table", ROOT / "bench" / "results_table.py")
rt = importlib.util.module_from_spec(_spec)
sys.modules["results_table"] = rt  # dataclasses look their module up
_spec.loader.exec_module(rt)

README = f"# x\n\nintro\n\n{rt.BEGIN}\nold table\n{rt.END}\n\nafter\n"


def _results(tps, pct=None, **extra):
    return {"tokens_per_s": tps, **({"percent_of_optimal": pct} if pct else {}), **extra}


def _bench(date, runs, device="NVIDIA H100 80GB HBM3", **config):
    cfg = {"model": "llama3-8b", "tp": 1, "weights": "random", "input_len": 1024,
           "output_len": 512, "workload": None, "num_prompts": 200, "dense_batch": 1024,
           "schedule": "sequential", "graphs": "on", "request_rate": float("inf"), **config}
    return {"config": cfg, "environment": {"date": date, "device": device}, "runs": runs}


def _write(root, name, data):
    path = root / "bench" / "results" / name
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "README.md").write_text(README)
    seq = {"sequential+graphs": {"strategy": "sequential", "graphs": True,
                                 "results": _results(10_000.0, 30.0)}}
    _write(tmp_path, "bench-a-old.json", _bench("2026-11-22T01:00:00+00:00", seq))
    newer = {"sequential+graphs": {"strategy": "sequential", "graphs": True,
                                   "results": _results(12_000.0, 36.0)}}
    _write(tmp_path, "bench-a-new.json", _bench("2026-11-23T01:00:00+00:00", newer))
    compare = {
        "sequential+graphs": {"strategy": "sequential", "graphs": True,
                              "results": _results(18_000.0, 40.0)},
        "schedule+graphs": {"strategy": "replay", "graphs": True, "predicted_speedup": 1.04,
                            "results": _results(16_200.0, 36.0)}}
    _write(tmp_path, "bench-b.json", _bench("2026-11-22T02:00:00+00:00", compare,
                                            device="NVIDIA H200", schedule="x.schedule.json",
                                            workload="sharegpt", input_len=None,
                                            output_len=None, num_prompts=600))
    legacy = {"config": {"model": "llama3-8b", "tp": 2, "input_len": 128, "output_len": 16,
                         "num_prompts": 8, "dense_batch": 256, "schedule": "two_batch"},
              "environment": {"date": "2026-11-21T00:00:00+00:00", "device": "NVIDIA H200"},
              "strategy": "two_batch", "results": _results(1_234.0)}
    _write(tmp_path, "bench-legacy.json", legacy)
    _write(tmp_path, "kernels_gemm-NVIDIA_H200-20261122T003702.json",
           {"env": {"date": "2026-11-22T00:37:02+00:00", "device": "NVIDIA H200",
                    "command": "/venv/bin/python bench/kernels_gemm.py"}, "rows": []})
    _write(tmp_path, "kernels_gemm-NVIDIA_H200-20261123T003702.json",
           {"env": {"date": "2026-11-23T00:37:02+00:00", "device": "NVIDIA H200",
                    "command": "/venv/bin/python kernels_gemm.py"}, "rows": []})
    return tmp_path


def _table_rows(readme):
    block = readme.split(rt.BEGIN)[1].split(rt.END)[0]
    return [[c.strip() for c in line.strip("|").split(" | ")]
            for line in block.splitlines() if line.startswith("| ") and "---" not in line][1:]


def test_the_table_has_the_latest_record_of_each_experiment(repo):
    assert rt.main([], root=repo) == 0
    readme = (repo / "README.md").read_text()
    assert readme.startswith("# x\n\nintro\n\n") and readme.endswith("\n\nafter\n")
    assert "old table" not in readme
    rows = {(r[0], r[8]): r for r in _table_rows(readme)}
    assert len(rows) == 4  # a-new, b's two runs, the legacy record; a-old is superseded
    h100 = rows[("H100", "sequential")]
    assert h100[9] == "12,000" and h100[10] == "36.0%" and h100[11] == "—"
    assert "bench-a-new.json" in h100[13] and h100[12] == "2026-11-23"
    replay = rows[("H200", "searched schedule (predicts 1.04×)")]
    assert replay[2] == "sharegpt" and replay[3] == "600" and replay[9] == "16,200"
    assert replay[11] == "0.90×"  # 16,200 / 18,000, Sequential of the same file and graphs
    legacy = rows[("2×H200", "two_batch")]
    assert legacy[5] == "off" and legacy[9] == "1,234" and legacy[10] == "—"
    assert "bench-a-old.json" not in readme
    index = (repo / "bench" / "results" / "INDEX.md").read_text()
    assert "bench-a-new.json" in index and "bench-a-old.json" not in index
    assert "kernels_gemm-NVIDIA_H200-20261123T003702.json" in index
    assert "20261122T003702" not in index  # same script, arguments and device: superseded
    assert not list((repo / "bench" / "results").glob(".*.tmp"))  # atomic writes left nothing


def test_check_fails_until_written_and_archived(repo):
    assert rt.main(["--check"], root=repo) == 1  # README and INDEX stale
    assert rt.main([], root=repo) == 0
    assert rt.main(["--check"], root=repo) == 1  # two superseded files outside archive/
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    assert rt.main(["--archive"], root=repo) == 0
    archived = sorted(p.name for p in (repo / "bench" / "results" / "archive").iterdir())
    assert archived == ["bench-a-old.json", "kernels_gemm-NVIDIA_H200-20261122T003702.json"]
    assert rt.main(["--check"], root=repo) == 0
    (repo / "README.md").write_text((repo / "README.md").read_text().replace("12,000", "13,000"))
    assert rt.main(["--check"], root=repo) == 1


def test_readme_without_markers_is_refused(repo):
    (repo / "README.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="results:begin"):
        rt.main([], root=repo)


def test_readme_and_index_are_up_to_date_with_bench_results():
    assert rt.main(["--check"], root=ROOT) == 0, \
        "README.md's results table or bench/results/INDEX.md is stale, or a superseded " \
        "result is outside bench/results/archive/: run python bench/results_table.py --archive"
