import json
from dataclasses import replace

import pytest
from repo import ROOT
from search_fixtures import small_profile
from signalled import default_sigint, read_until
from typer.testing import CliRunner

from nanosched.autosearch import request
from nanosched.cli import app
from nanosched.models.spec import load_spec
from nanosched.profiler import catalog
from nanosched.profiler.format import save_profile
from nanosched.workloads import fixed

runner = CliRunner()
SMALL = ["--model", "llama3-8b", "--dense-batch", "256", "--input-len", "1024",
         "--output-len", "512", "--time-limit", "2", "--workers", "1", "--buckets", "dense"]
BURSTS_OK = "--allow-unsettled"


def run(*args):
    return runner.invoke(app, list(args))


def test_search_writes_a_schedule_that_show_prints_and_plots(tmp_path):
    out = tmp_path / "s.json"
    r = run("search", *SMALL, "--out", str(out))
    assert r.exit_code == 0, r.output
    # no GPU here and no --gpu: h100 is assumed and its own shipped profile picked
    assert "profile: shipped profile 'llama3-8b-tp1-h100': same model, same GPU" in r.output
    assert "tp: 1 (the profile's)" in r.output and "SYNTHETIC" not in r.output
    assert "stage I:" in r.output and "stage II:" in r.output and "predicted speedup" in r.output
    assert "% of optimal" in r.output
    data = json.loads(out.read_text())
    assert data["format"] == "nanosched.schedule/2" and data["tp"] == 1
    assert [(e["num_decode"], e["num_tokens"]) for e in data["entries"]] == [(128, 256)]
    assert data["entries"][0]["schedule"] is not None  # kept for show, whatever it predicts
    entry = data["entries"][0]  # a sequential entry says whether its NO GAIN is proven
    assert entry["ceiling"] > 0 and "stage2_gap" in entry
    if entry["kind"] == "sequential":
        assert entry["proof"] in ("ceiling", "gap", "unproven")
        assert "NO GAIN proven" in r.output or "NO GAIN NOT proven" in r.output
    png = tmp_path / "s.png"
    r = run("show", str(out), "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert "1 pipelined" in r.output or "NO GAIN" in r.output
    assert png.stat().st_size > 1000
    r = run("show", str(out), "--key", "128,256")
    assert r.exit_code == 0 and "kqv.0" in r.output, r.output


def test_a_set_for_every_batch_shape_is_written_and_shown(tmp_path):
    out = tmp_path / "set.json"
    args = [a for a in SMALL if a not in ("--buckets", "dense")]
    r = run("search", *args, "--time-limit", "6", "--out", str(out))
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    keys = sorted((e["num_decode"], e["num_tokens"]) for e in data["entries"])
    assert keys == [(0, 128), (0, 256), (128, 128), (128, 256), (256, 256)]
    assert "5 batch shapes" in r.output and "too small" in r.output
    r = run("show", str(out))
    assert r.exit_code == 0 and "T rows" in r.output and "fewer than two" in r.output
    r = run("show", str(out), "--key", "0,128")
    assert r.exit_code == 2 and "runs Sequential at D=0, T=128" in r.output


def test_search_refuses_an_output_path_it_cannot_write_before_searching(tmp_path):
    r = run("search", *SMALL, "--out", str(tmp_path))
    assert r.exit_code == 2 and "is a folder" in r.output and "stage I" not in r.output
    r = run("search", *SMALL, "--out", str(tmp_path / "nope" / "s.json"))
    assert r.exit_code == 2 and "does not exist" in r.output


def test_a_profile_with_pairs_timed_in_bursts_is_refused_unless_allowed(tmp_path):
    prof = catalog.load_named_profile("llama3-8b-tp1-h100")
    assert prof.unsettled() is None
    burst = tmp_path / "burst.json"
    save_profile(replace(prof, pairs=tuple(replace(p, settle_ms=0.0, window_ms=3.0)
                                           for p in prof.pairs)), burst)
    out = tmp_path / "s.json"
    r = run("search", *SMALL, "--profile", str(burst), "--out", str(out))
    assert r.exit_code == 2 and not out.exists()
    assert "co-run pairs were timed in bursts (settle + window at most 3 ms)" in r.output
    assert "pass --allow-unsettled to search on it anyway" in r.output
    r = run("search", *SMALL, "--profile", str(burst), BURSTS_OK, "--out", str(out))
    assert r.exit_code == 0 and "WARNING: " in r.output and "--allow-unsettled" in r.output


def test_without_a_shipped_profile_the_search_says_it_is_synthetic(tmp_path):
    args = [a if a != "llama3-8b" else "qwen2.5-72b" for a in SMALL]
    r = run("search", *args, "--gpu", "h200", "--out", str(tmp_path / "q.json"))
    assert r.exit_code == 0, r.output
    assert "SYNTHETIC PROFILE" in r.output and "tp: 2 (smallest that fits" in r.output


def test_infeasible_search_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "s.json"
    r = run("search", *SMALL, "--max-period-us", "5", "--out", str(out))
    assert r.exit_code == 2
    assert "search found no schedule: stage I ended INFEASIBLE" in r.output
    assert "no file written" in r.output and not out.exists()


def test_timed_out_search_says_so_and_writes_nothing(tmp_path, monkeypatch):
    from nanosched.autosearch import stage1
    from nanosched.schedules.format import StageReport

    def no_solution(prob, limits, progress=None):
        return None, StageReport("stage I", "UNKNOWN", float("nan"), float("nan"),
                                 float("nan"), 2.0, limits.time_limit_s, 1)

    monkeypatch.setattr("nanosched.autosearch.search.solve_stage1", no_solution)
    assert stage1.solve_stage1 is not no_solution
    out = tmp_path / "s.json"
    r = run("search", *SMALL, "--out", str(out))
    assert r.exit_code == 2
    assert "stage I ended UNKNOWN: no solution within the time limit" in r.output
    assert not out.exists()


def test_bad_inputs_exit_2_with_the_reason(tmp_path):
    for changes, message in [
        ({"--dense-batch": "200"}, "--dense-batch must be a multiple of 128"),
        ({"--dense-batch": "lots"}, "--dense-batch must be a number of tokens or 'auto'"),
        ({"--profile": "nosuch"}, "--profile 'nosuch' is neither a file nor a shipped profile"),
        ({"--time-limit": "0"}, "--time-limit must be a finite number of seconds > 0"),
        ({"--tp": "3"}, "--tp 3 does not divide"),
        ({"--model": "llama9"}, "--model 'llama9' is neither a known model"),
    ]:
        flags = dict(zip(SMALL[::2], SMALL[1::2], strict=True)) | changes
        args = [x for kv in flags.items() for x in kv]
        r = run("search", *args, "--out", str(tmp_path / "x.json"))
        assert r.exit_code == 2, (changes, r.output)
        assert message in r.output, (changes, r.output)
        assert not (tmp_path / "x.json").exists()
    r = run("show", str(tmp_path / "missing.json"))
    assert r.exit_code == 2 and "does not exist" in r.output


def test_shipped_profile_closest_to_the_request_is_chosen(tmp_path, monkeypatch):
    save_profile(small_profile(1, 256), tmp_path / "llama3-8b-tp1.json")
    save_profile(small_profile(2, 256), tmp_path / "llama3-8b-tp2.json")
    spec, wl = load_spec("llama3-8b"), fixed(512, 512)
    choice = request.resolve(spec, 2, None, None, wl, "auto", folder=tmp_path)
    assert choice.profile is not None and choice.profile.tp == 2 and choice.dense_batch == 256
    assert "shipped profile 'llama3-8b-tp2': same model and tp" in choice.messages[0]
    choice = request.resolve(load_spec("llama3-70b"), None, None, None, wl, "auto",
                             folder=tmp_path)
    assert choice.profile is None and request.SYNTHETIC_BANNER in choice.messages
    assert choice.tp == 4 or choice.tp == 8
    monkeypatch.setattr(catalog, "SHIPPED", tmp_path)
    args = [a if a != "1024" else "512" for a in SMALL]  # the fixture profiles 512 / 512
    r = run("search", *args, "--profile", "llama3-8b-tp1", "--out", str(tmp_path / "s.json"))
    assert r.exit_code == 0, r.output
    assert "profile: llama3-8b-tp1" in r.output and "SYNTHETIC PROFILE" not in r.output


@pytest.mark.slow
def test_a_signal_stops_the_whole_search_and_writes_nothing(tmp_path):
    """SIGINT and SIGTERM in the middle of a CP-SAT solve end the process at once (not only
    the solve), with exit 130, the message, and an earlier file untouched."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = ROOT
    out = tmp_path / "s.json"
    for sig in (signal.SIGINT, signal.SIGTERM):
        out.write_text("earlier")
        args = [a if a != "2" else "120" for a in SMALL]  # a 120 s time limit
        proc = subprocess.Popen(
            [sys.executable, "-m", "nanosched.cli", "search", *args, "--out", str(out)],
            cwd=root, env=os.environ | {"PYTHONPATH": str(root)}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, preexec_fn=default_sigint)
        seen = read_until(proc.stdout, b"stage I", timeout_s=300).decode()  # a solve runs
        time.sleep(1.0)
        start = time.monotonic()
        proc.send_signal(sig)
        rest = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 130, seen + rest
        assert time.monotonic() - start < 30  # the whole search stopped, not one solve
        assert "search interrupted: no schedule written" in rest
        assert out.read_text() == "earlier"


def test_the_search_ends_with_what_it_searched_its_verdict_and_what_to_run_next(tmp_path):
    """Issue 45: the verdict is bounded by CP-SAT's deterministic time, so the same command
    prints the same verdict on a busy or an idle machine; the last three lines say what was
    searched (and how long it took), the verdict, and what to run next."""
    outs = []
    for i in range(2):
        out = tmp_path / f"s{i}.json"
        r = run("search", *SMALL, "--out", str(out))
        assert r.exit_code == 0, r.output
        tail = r.output.rstrip("\n").splitlines()[-3:]
        assert tail[0].startswith("searched: llama3-8b at tp 1 on NVIDIA H100")
        assert "solver work 2 (deterministic), took" in tail[0]
        assert tail[1].startswith(("verdict: NO GAIN", "verdict: PIPELINED"))
        assert tail[2].startswith("next: ") and str(out) in tail[2]
        assert "(this pipeline over Sequential)" in r.output
        entries = json.loads(out.read_text())["entries"]  # all but the stages' wall times
        outs.append((tail[1], [(e["kind"], e["reason"], e["forward_us"], e.get("proof"),
                                e["schedule"] and e["schedule"]["nano_ops"]) for e in entries]))
    assert outs[0] == outs[1]
    assert json.loads(out.read_text())["search"]["deterministic"] is True
