"""The command line under hostile or puzzled use (issue 36): values out of range, `--gpu` as a
name or an index everywhere, search's first lines early, `profile rederive` that never
overwrites its input (or a file shipped in the package), and the Gantt chart of a pipeline the
set does not run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hostile import RUNNER, refused
from repo import ROOT
from signalled import default_sigint, read_until

import nanosched.cli.common as common
from nanosched.cli import app

CONFIG = str(ROOT / "tests" / "data" / "tiny_llama_config.json")
SHIPPED_PROFILE = ROOT / "nanosched" / "profiler" / "profiles" / "llama3-70b-tp2-h200x2-quick.json"
SHIPPED_SET = ROOT / "nanosched" / "schedules" / "shipped" / \
    "llama3-8b-tp1-h100-in1024-out512-b1024.set.json"
BENCH = ["bench", "--model", CONFIG, "--device", "cpu", "--input-len", "4", "--output-len",
         "2", "--num-prompts", "100"]


@pytest.mark.parametrize("args, needle", [
    (["search", "--model", "llama3-8b", "--time-limit", "inf"], "--time-limit"),
    (["search", "--model", "llama3-8b", "--time-limit", "nan"], "--time-limit"),
    (["search", "--model", "llama3-8b", "--max-period-us", "-1"], "--max-period-us"),
    (["search", "--model", "llama3-8b", "--max-period-us", "inf"], "--max-period-us"),
    ([*BENCH, "--request-rate", "1e-9"], "at least 0.00116 requests/s"),
    ([*BENCH, "--request-rate", "0"], "--request-rate must be positive"),
    ([*BENCH, "--request-rate", "nan"], "--request-rate must be positive"),
    (["generate", "--model", CONFIG, "--prompt-ids", "1", "--temperature", "inf"],
     "--temperature must be a finite number"),
    (["generate", "--model", CONFIG, "--prompt-ids", "1", "--temperature", "nan"],
     "--temperature"),
], ids=["time-inf", "time-nan", "period-negative", "period-inf", "rate-tiny", "rate-zero",
        "rate-nan", "temperature-inf", "temperature-nan"])
def test_values_out_of_range_are_refused_before_any_work(args, needle):
    refused(args, needle)


def test_gpu_names_and_indices_mean_the_same_everywhere(monkeypatch):
    here = ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    monkeypatch.setattr(common, "visible_gpus", lambda: here)
    assert common.gpu_index("h100") == 1 and common.gpu_index("0") == 0
    assert common.gpu_prior_name("1") == "h100" and common.gpu_prior_name("h200") == "h200"
    r = RUNNER.invoke(app, ["models", "--gpu", "1", "--json"])
    assert r.exit_code == 0, r.output
    monkeypatch.setattr(common, "visible_gpus", lambda: [])
    refused(["profile", "--gpu", "h100", "--model", "llama3-8b"], "--gpu h100", "no h100 here",
            "GPUs here: none")
    refused(["profile", "--gpu", "tpu", "--model", "llama3-8b"], "not a known GPU", "h100")
    refused(["profile", "--gpu", "-1", "--model", "llama3-8b"], "device index")
    refused(["models", "--gpu", "0"], "--gpu 0", "no GPU at that index")
    refused(["search", "--model", "llama3-8b", "--gpu", "2"], "--gpu 2")
    assert common.gpu_index("h100", fake=True) == 0  # a dry run measures no device


def test_search_reads_one_profile_and_says_what_it_decided_before_it_solves(monkeypatch,
                                                                           tmp_path):
    """The issue's search printed nothing for 48 s: it read every shipped profile whole, and
    said nothing of the batch shapes it decided without a solve."""
    import nanosched.autosearch.sets as sets
    import nanosched.profiler.catalog as request
    from nanosched.autosearch.command import search_command
    from nanosched.autosearch.request import SearchRequest

    read, lines = [], []
    real = request.load_profile
    monkeypatch.setattr(request, "load_profile", lambda p: read.append(p) or real(p))
    request._load.cache_clear()  # what an earlier search of this process read

    def first_solve(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sets, "run_search", first_solve)
    with pytest.raises(KeyboardInterrupt):
        search_command(SearchRequest(model="llama3-8b", tp=None, profile=None, gpu="h100",
                                     workload=None, input_len=None, output_len=None,
                                     dense_batch="auto", time_limit=60, workers=1,
                                     max_nano_ops=4, max_period_us=None,
                                     out=str(tmp_path / "s.json"), buckets="all"),
                       echo=lines.append)
    assert [Path(p).name for p in read] == ["llama3-8b-tp1-h100.json"]
    assert lines[-2].startswith("searching llama3-8b")
    assert lines[-1].startswith("[23/44] decided without a search: 2 too small for two "
                                "nano-batches, 21 bounded below 1.05x (10 by the bound, 11 by "
                                "the ceiling)"), lines[-1]


def test_rederive_never_overwrites_its_input(tmp_path, monkeypatch):
    before = SHIPPED_PROFILE.read_bytes()
    monkeypatch.chdir(tmp_path)
    r = RUNNER.invoke(app, ["profile", "rederive", str(SHIPPED_PROFILE)])
    assert r.exit_code == 0, r.output
    written = tmp_path / "llama3-70b-tp2-h200x2-quick.rederived.json"
    assert written.is_file() and f"wrote {written.name}" in r.output
    assert SHIPPED_PROFILE.read_bytes() == before  # the package's file is untouched
    mine = Path(shutil.copy(SHIPPED_PROFILE, tmp_path / "sub.json"))
    r = RUNNER.invoke(app, ["profile", "rederive", str(mine)])
    assert r.exit_code == 0 and (tmp_path / "sub.rederived.json").is_file()
    assert mine.read_bytes() == before
    r = RUNNER.invoke(app, ["profile", "rederive", str(mine), "--out", str(mine)])
    assert r.exit_code == 0  # named explicitly: replaced


def test_profile_forward_leaves_a_shipped_profile_alone_unless_told(monkeypatch):
    refused(["profile", "forward", str(SHIPPED_PROFILE), "--fake-gpu"], "shipped in the "
            "installed nanosched package", "--out")


def test_the_gantt_of_a_pipeline_the_set_does_not_run_says_so(tmp_path, monkeypatch):
    import nanosched.schedules.show as show

    titles = []
    real = show.gantt_figure

    def spy(s, note=None):
        fig = real(s, note)
        titles.append(fig.axes[0].get_title())
        return fig

    monkeypatch.setattr(show, "gantt_figure", spy)
    r = RUNNER.invoke(app, ["show", str(SHIPPED_SET), "--plot", str(tmp_path / "g.png")])
    assert r.exit_code == 0, r.output
    assert titles[0].startswith("NOT RUN: this set runs Sequential at D=384 T=1024")
    assert "does not run" in r.output
    r = RUNNER.invoke(app, ["show", str(SHIPPED_SET), "--key", "384,1024"])
    assert r.exit_code == 0 and "NOT RUN" in r.output
    data = json.loads(SHIPPED_SET.read_text())
    steady = next(e for e in data["entries"] if e["schedule"] is not None)
    steady["kind"] = "pipeline"
    steady["forward_us"] = steady["sequential_us"] / 1.2
    (tmp_path / "run.json").write_text(json.dumps(data))
    titles.clear()
    r = RUNNER.invoke(app, ["show", str(tmp_path / "run.json"), "--plot",
                            str(tmp_path / "g2.png")])
    assert r.exit_code == 0, r.output
    assert not titles[0].startswith("NOT RUN")


def test_profile_commands_take_the_shipped_names_search_takes(tmp_path, monkeypatch):
    """Issue 45: `profile show NAME` (and rederive) accept what `search --profile NAME` does;
    a name that is neither is refused with the shipped names listed."""
    from nanosched.profiler.catalog import shipped_profiles

    name = SHIPPED_PROFILE.name.removesuffix(".json")
    assert name in shipped_profiles()
    r = RUNNER.invoke(app, ["profile", "show", name])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("llama3-70b tp 2 on NVIDIA H200")
    monkeypatch.chdir(tmp_path)
    r = RUNNER.invoke(app, ["profile", "rederive", name])
    assert r.exit_code == 0, r.output
    assert (tmp_path / f"{name}.rederived.json").is_file()
    refused(["profile", "show", "no-such-profile"], "no-such-profile",
            "neither a file nor a shipped profile", name)


def test_a_profile_whose_workload_the_model_cannot_hold_is_refused_first(tmp_path):
    """Issue 45: stories15m holds 256 positions; the default 1024 / 512 workload is refused
    before any measurement (the search would refuse the profile later), one that fits is
    profiled and searched."""
    out = tmp_path / "s15.json"
    refused(["profile", "--model", "stories15m", "--fake-gpu", "--quick", "--out", str(out)],
            "prompts of 1024 tokens", "stories15m's 256 positions", "--input-len")
    assert not out.exists() and not list(tmp_path.iterdir())
    fits = ["--input-len", "128", "--output-len", "64"]
    r = RUNNER.invoke(app, ["profile", "--model", "stories15m", "--fake-gpu", "--quick",
                            "--no-progress", "--out", str(out), *fits])
    assert r.exit_code == 0 and out.is_file(), r.output
    r = RUNNER.invoke(app, ["search", "--profile", str(out), "--buckets", "dense",
                            "--time-limit", "2", "--out", str(tmp_path / "set.json"), *fits])
    assert r.exit_code == 0, r.output


@pytest.mark.slow
def test_vllm_engine_flags_are_accepted_under_vllms_names():
    """Issue 45: `--tensor-parallel-size` / `-tp`, `--max-model-len` and `--dtype` as vLLM
    spells them: `-tp 2` serves the tokens `--tp 1` does, a request longer than
    `--max-model-len` is refused, `--dtype auto` is the default's."""
    import json

    base = ["generate", "--model", "stories15m", "--prompt-ids", "5,6,7", "--max-tokens", "6",
            "--json"]
    outs = []
    for flags in (["--tp", "1"], ["-tp", "2", "--dtype", "auto"],
                  ["--tensor-parallel-size", "1", "--max-model-len", "16"]):
        r = RUNNER.invoke(app, [*base, *flags])
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.stdout.splitlines()[-1])["output_ids"])
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 6
    refused([*base, "--max-model-len", "8"], "exceeds the model's context of 8 tokens")


@pytest.mark.parametrize("flags, needles", [
    (["--max-model-len", "300"], ["--max-model-len 300", "stories15m's 256 positions"]),
    (["--max-model-len", "0"], ["--max-model-len must be at least 1"]),
    (["--dtype", "half"], ["--dtype must be one of auto, bfloat16, float16"]),
    (["--dtype", "float16", "--device", "cpu"], ["--dtype float16", "needs a GPU"]),
], ids=["len-past-positions", "len-zero", "dtype-unknown", "dtype-half-on-cpu"])
@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_vllm_engine_flags_out_of_range_are_refused(command, flags, needles):
    args = {"generate": ["generate", "--model", "stories15m", "--prompt-ids", "1"],
            "bench": ["bench", "--model", "stories15m", "--input-len", "4", "--output-len", "2",
                      "--num-prompts", "2"],
            "serve": ["serve", "--model", "stories15m", "--port", "0"]}[command]
    refused([*args, *flags], *needles)


def test_dtype_names_the_torch_dtype_on_a_gpu():
    import torch

    from nanosched.runtime.loader import model_dtype

    cuda = torch.device("cuda", 0)
    assert model_dtype(cuda, "float16") == torch.float16
    assert model_dtype(cuda, "bfloat16") == model_dtype(cuda) == torch.bfloat16
    assert model_dtype(torch.device("cpu")) == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_bench_stopped_by_a_signal_says_so_and_exits_130(tmp_path, sig):
    """Issue 45: `bench` stopped by Ctrl-C or SIGTERM printed nothing. The signal comes once
    the timed requests' progress bar is up (the model loaded, the warm-up served), however long
    a busy machine takes to get there; the command then stops within a minute (the 2000
    requests would take several)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "b.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanosched.cli", "bench", "--model", "stories15m", "--device",
         "cpu", "--input-len", "32", "--output-len", "200", "--num-prompts", "2000", "--json",
         str(out)], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint)
    try:
        seen = read_until(proc.stderr, b"requests:", timeout_s=300)
        time.sleep(1.0)  # in the middle of the engine's steps
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(getattr(signal, sig))
        stdout, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    stderr = (seen + rest).decode()
    assert proc.returncode == 130, (stdout, stderr)
    assert f"bench interrupted: no results reported ({out} untouched)" in stderr, stderr
    assert "Traceback" not in stderr and not out.exists()


def test_bench_stopped_while_it_starts_says_so_too(tmp_path, monkeypatch):
    """A Ctrl-C while bench imports torch and builds its config (seconds before the model
    loads) gets the line and the exit code of one while serving."""
    import nanosched.runtime.config as config

    def interrupted(**kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(config, "EngineConfig", interrupted)
    out = tmp_path / "b.json"
    r = RUNNER.invoke(app, [*BENCH, "--json", str(out)])
    assert r.exit_code == 130, (r.exit_code, r.output)
    assert f"bench interrupted: no results reported ({out} untouched)" in r.stderr, r.output
    assert not out.exists()
