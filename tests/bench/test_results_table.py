"""bench/tools/results_table.py: the README's results table and bench/results/INDEX.md from the
records, the latest file per experiment, --check and --archive; and the README in step with
bench/results (so the table cannot drift)."""

import importlib.util
import json
import subprocess
import sys

import pytest
from repo import ROOT

_spec = importlib.util.spec_from_file_location("results_table",
                                               ROOT / "bench" / "tools" / "results_table.py")
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
                    "command": "/venv/bin/python bench/kernels/kernels_gemm.py"}, "rows": []})
    _write(tmp_path, "kernels_gemm-NVIDIA_H200-20261123T003702.json",
           {"env": {"date": "2026-11-23T00:37:02+00:00", "device": "NVIDIA H200",
                    "command": "/venv/bin/python kernels_gemm.py"}, "rows": []})
    return tmp_path


def _table_rows(readme):
    block = readme.split(rt.BEGIN)[1].split(rt.END)[0]
    return [[c.strip() for c in line.strip("|").split(" | ")]
            for line in block.splitlines() if line.startswith("| ") and "---" not in line][1:]


def _links(readme):
    block = readme.split(rt.BEGIN)[1].split(rt.END)[0]
    return dict(line[1:].split("]: ", 1) for line in block.splitlines() if line.startswith("[r"))


def test_the_table_has_the_latest_record_per_gpu_model_tp_workload_and_kv(repo):
    # another experiment (dense batch 2,048) of a-new's GPU, model, tp, workload and KV, later
    later = {"sequential+graphs": {"strategy": "sequential", "graphs": True,
                                   "results": _results(9_000.0, 20.0)}}
    _write(repo, "bench-c.json", _bench("2026-11-24T01:00:00+00:00", later, dense_batch=2048))
    fp8 = {"sequential+graphs": {"strategy": "sequential", "graphs": True,
                                 "results": _results(15_000.0, 45.0)}}
    _write(repo, "bench-d.json", _bench("2026-11-20T01:00:00+00:00", fp8, kv_dtype="fp8"))
    assert rt.main([], root=repo, figures=()) == 0
    readme = (repo / "README.md").read_text()
    assert readme.startswith("# x\n\nintro\n\n") and readme.endswith("\n\nafter\n")
    assert "old table" not in readme
    rows, links = _table_rows(readme), _links(readme)
    by = {(r[0], r[2], r[4], r[10]): r for r in rows}
    assert len(rows) == 4  # c, d, b's replay beside its Sequential, the legacy record
    assert all(r[5] == "bf16" for r in rows)  # weights: the model's dtype in every record
    h100 = by[("H100", "1", "bf16", "—")]
    assert h100[6] == "2,048" and h100[8] == "9,000" and h100[9] == "20.0%"
    assert links[h100[12].split("][")[1].rstrip("]")] == "bench/results/bench-c.json"
    assert h100[12].startswith("[2026-11-24]")
    assert by[("H100", "1", "fp8", "—")][8] == "15,000"  # another KV dtype: its own row
    replay = by[("H200", "1", "bf16", "searched schedule (predicts 1.04×)")]
    assert replay[3] == "sharegpt" and replay[7] == "600" and replay[8] == "18,000"
    assert replay[11] == "0.900×"  # 16,200 / 18,000, Sequential of the same record
    legacy = by[("H200", "2", "bf16", "two_batch")]
    assert legacy[3] == "128 / 16" and legacy[8] == "—" and legacy[11] == "—"
    assert "bench-a-new.json" not in readme and "bench-a-old.json" not in readme
    index = (repo / "bench" / "results" / "INDEX.md").read_text()
    assert "bench-a-new.json" in index and "bench-c.json" in index  # two experiments
    assert "bench-a-old.json" not in index
    assert "kernels_gemm-NVIDIA_H200-20261123T003702.json" in index
    assert "20261122T003702" not in index  # same script, arguments and device: superseded
    assert not list((repo / "bench" / "results").glob(".*.tmp"))  # atomic writes left nothing


def test_a_record_with_several_sequential_runs_and_both_graph_settings(repo):
    aba = {"sequential": {"strategy": "sequential", "graphs": False, "results": _results(5.0)},
           "sequential+graphs": {"strategy": "sequential", "graphs": True,
                                 "results": _results(20_000.0, 40.0)},
           "schedule+graphs": {"strategy": "replay_set", "graphs": True, "iterations": 1309,
                               "pipelined_iterations": 143, "results": _results(20_500.0)},
           "sequential-after+graphs": {"strategy": "sequential", "graphs": True,
                                       "results": _results(21_000.0, 42.0)}}
    data = _bench("2026-11-25T01:00:00+00:00", aba, graphs="both")
    data["ratios"] = {"schedule+graphs": {"tokens_per_s": 0.99512}}
    _write(repo, "bench-e.json", data)
    assert rt.main([], root=repo, figures=()) == 0
    row = next(r for r in _table_rows((repo / "README.md").read_text()) if "set" in r[10])
    assert row[8] == "20,000-21,000" and row[9] == "40.0-42.0%"  # graph runs only
    assert row[10] == "set, 143 of 1,309 pipelined" and row[11] == "0.995×"


def test_check_fails_until_written_and_archived(repo):
    assert rt.main(["--check"], root=repo, figures=()) == 1  # README and INDEX stale
    assert rt.main([], root=repo, figures=()) == 0
    assert rt.main(["--check"], root=repo, figures=()) == 1  # two superseded files
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    assert rt.main(["--archive"], root=repo, figures=()) == 0
    archived = sorted(p.name for p in (repo / "bench" / "results" / "archive").iterdir())
    assert archived == ["bench-a-old.json", "kernels_gemm-NVIDIA_H200-20261122T003702.json"]
    assert rt.main(["--check"], root=repo, figures=()) == 0
    (repo / "README.md").write_text((repo / "README.md").read_text().replace("12,000", "13,000"))
    assert rt.main(["--check"], root=repo, figures=()) == 1


def test_readme_without_markers_is_refused(repo):
    (repo / "README.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="results:begin"):
        rt.main([], root=repo, figures=())


def test_readme_and_index_are_up_to_date_with_bench_results():
    assert rt.main(["--check"], root=ROOT) == 0, \
        "README.md's results table or bench/results/INDEX.md is stale, or a superseded " \
        "result is outside bench/results/archive/: run python bench/tools/results_table.py " \
        "--archive"


rf = rt._sibling("readme_figures")


def _figure_repo(tmp_path, prose):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    _write(tmp_path, "ceiling.json", {"rows": [{"num_decode": 384, "num_tokens": 1024,
                                                "ceiling": 1.0259},
                                               {"num_decode": 896, "num_tokens": 896,
                                                "ceiling": 1.1018}],
                                      "a": {"ms": 12.695}, "b": {"ms": 13.649}})
    (tmp_path / "README.md").write_text(f"# x\n\n{prose}\n\n{rt.BEGIN}\n| 9.99× |\n{rt.END}\n")
    return tmp_path


FIGS = (rf.Figure("1.026×", "ceiling.json", ("rows[num_decode=384,num_tokens=1024].ceiling",)),
        rf.Figure("0.93×", "ceiling.json", ("a.ms", "b.ms"), "ratio", "{:.2f}×"))


def _errors(root):
    return rf.figure_errors((root / "README.md").read_text(), root, rt.BEGIN, rt.END, FIGS)


def test_prose_figures_are_checked_against_their_records(tmp_path):
    root = _figure_repo(tmp_path, "Priced at 1.026× at most; replayed, 0.93× of it (700 W cap).\n"
                                  "```\n$ nanosched search  # prints 0.924x and 12 ms\n```")
    assert _errors(root) == []  # code blocks, the generated table and constants are not figures
    (root / "README.md").write_text((root / "README.md").read_text().replace("1.026×", "1.03×"))
    errs = _errors(root)
    assert any("1.026× is not in README.md" in e for e in errs)
    assert any("'1.03×'" in e for e in errs)  # a number no record checks


def test_a_figure_its_record_no_longer_gives_is_refused(tmp_path):
    root = _figure_repo(tmp_path, "1.026× and 0.93×")
    _write(root, "ceiling.json", {"rows": [{"num_decode": 384, "num_tokens": 1024,
                                            "ceiling": 1.04}], "a": {"ms": 1}, "b": {}})
    errs = _errors(root)
    assert any("figure 1.026×: ceiling.json gives 1.040×" in e for e in errs)
    assert any("figure 0.93×: ceiling.json: " in e and "ms: not there" in e for e in errs)


def test_the_readme_stays_a_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines: at most 120"
    wide = [i + 1 for i, line in enumerate(lines) if len(line) > 160]
    assert not wide, f"README.md lines {wide} are over 160 characters"
    assert len(_table_rows("\n".join(lines))) <= 10


def test_the_table_keeps_the_newest_records_that_fit_in_ten_rows(repo):
    for i in range(12):  # twelve workloads of one GPU, model, tp and KV: twelve README keys
        runs = {"sequential+graphs": {"strategy": "sequential", "graphs": True,
                                      "results": _results(1_000.0 + i)}}
        _write(repo, f"bench-w{i:02d}.json", _bench(f"2026-12-{i + 1:02d}T00:00:00+00:00", runs,
                                                    input_len=100 + i))
    assert rt.main([], root=repo, figures=()) == 0
    rows = _table_rows((repo / "README.md").read_text())
    assert len(rows) == 10
    assert {r[8] for r in rows} == {f"1,{i:03d}" for i in range(2, 12)}  # the ten newest
    assert "bench-w00.json" not in (repo / "README.md").read_text()
    assert "bench-w00.json" in (repo / "bench" / "results" / "INDEX.md").read_text()


def test_each_collective_is_its_own_experiment_and_row(repo):
    """`--collective copy_engine` at tp = 4 is another experiment than NCCL's (from the config,
    or from the command line of a record written before the config named it)."""
    two = {"sequential+graphs": {"strategy": "sequential", "graphs": True,
                                 "results": _results(8_000.0, 30.0)},
           "two_batch+graphs": {"strategy": "two_batch", "graphs": True,
                                "results": _results(6_400.0, 24.0)}}
    tp4 = {"tp": 4, "model": "llama3-70b", "schedule": "two_batch"}
    nccl = _bench("2026-11-27T02:00:00+00:00", two, **tp4)
    ce_cmd = _bench("2026-11-27T01:00:00+00:00", two, **tp4)
    ce_cmd["environment"]["command"] = "cli bench --tp 4 --collective copy_engine --json x.json"
    _write(repo, "bench-nccl.json", nccl)
    _write(repo, "bench-ce.json", ce_cmd)
    assert rt.main([], root=repo, figures=()) == 0
    rows = _table_rows((repo / "README.md").read_text())
    assert {r[2] for r in rows if r[1] == "llama3-70b"} == {"4", "4 (copy engine)"}
    index = (repo / "bench" / "results" / "INDEX.md").read_text()
    assert "bench-nccl.json" in index and "bench-ce.json" in index  # neither superseded
    assert rt._records.collective({"config": {"collective": "copy_engine"}}) == "copy_engine"
    assert rt._records.collective(nccl) == "nccl"


def test_an_aba_against_another_collective_names_both(repo):
    """bench/tools/aba_merge.py's record (the strategy on the copy engines, Sequential on
    NCCL) is its own experiment and README row, the Sequential runs' all-reduce named."""
    two = {"sequential+graphs": {"strategy": "sequential", "graphs": True,
                                 "results": _results(8_000.0, 30.0)},
           "two_batch+graphs": {"strategy": "two_batch", "graphs": True,
                                "results": _results(6_400.0, 24.0)}}
    tp4 = {"tp": 4, "model": "llama3-70b", "schedule": "two_batch", "collective": "copy_engine"}
    _write(repo, "bench-ce.json", _bench("2026-11-27T01:00:00+00:00", two, **tp4))
    _write(repo, "bench-aba.json", _bench("2026-11-27T02:00:00+00:00", two, **tp4,
                                          baseline_collective="nccl"))
    assert rt.main([], root=repo, figures=()) == 0
    rows = _table_rows((repo / "README.md").read_text())
    assert {r[2] for r in rows if r[1] == "llama3-70b"} == \
        {"4 (copy engine)", "4 (copy engine; Seq. NCCL)"}
    index = (repo / "bench" / "results" / "INDEX.md").read_text()
    assert "bench-ce.json" in index and "bench-aba.json" in index  # neither superseded


def test_a_prefix_cache_off_run_is_its_own_row_and_a_shared_prefix_workload_reads_short(repo):
    """Caching on (the default) and off on one shared-prefix workload are two experiments and
    two README rows; the workload's spec is written in a few words."""
    spec = "shared-prefix:groups=10,prefix=2000,unique=200,output=256"
    for i, cache in enumerate((True, False)):
        runs = {"sequential+graphs": {"strategy": "sequential", "graphs": True,
                                      "results": _results(9_000.0 - 5_000 * i)}}
        _write(repo, f"bench-p{i}.json", _bench(f"2026-12-0{i + 1}T00:00:00+00:00", runs,
                                                workload=spec, input_len=None, output_len=None,
                                                prefix_caching=cache))
    assert rt.main([], root=repo, figures=()) == 0
    rows = _table_rows((repo / "README.md").read_text())
    assert sorted(r[3] for r in rows if r[3].startswith("shared")) == [
        "shared 2000 + 200 / 256 (10)",
        "shared 2000 + 200 / 256 (10), cache off"]
