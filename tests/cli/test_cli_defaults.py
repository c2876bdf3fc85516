"""Defaults that match the user's machine: --gpu is the GPU present (else h100, said), a
shipped profile is picked only for the GPU asked for (another GPU's only when none was asked
for, said loudly), `analyze` sizes the smallest tp that fits, and each numeric flag is
range-checked with a message that names it."""

import pytest
from typer.testing import CliRunner

from nanosched.autosearch import request
from nanosched.cli import app, common
from nanosched.models.spec import load_spec
from nanosched.profiler import catalog
from nanosched.workloads import fixed


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_without_a_gpu_analyze_assumes_h100_says_so_and_picks_the_smallest_tp():
    r = run("analyze", "--model", "llama3-8b")
    assert r.exit_code == 0, r.output
    assert "--gpu not given and no GPU here: assuming h100" in r.output
    assert "using tp=1, the smallest whose h100 GPUs hold the weights and the KV cache of a " \
           "1024-token dense batch" in r.output
    assert "llama3-8b on 1 x h100" in r.output
    r = run("analyze", "--model", "llama3-70b", "--gpu", "h200")
    assert "assuming" not in r.output and "llama3-70b on 4 x h200" in r.output


def test_the_gpu_present_is_the_default(monkeypatch):
    monkeypatch.setattr(common, "gpu_here", lambda: "h200")
    r = run("analyze", "--model", "llama3-8b")
    assert r.exit_code == 0, r.output
    assert "--gpu not given: using h200, the GPU present" in r.output
    assert "llama3-8b on 1 x h200" in r.output
    r = run("models")
    assert r.exit_code == 0 and "tp on h200" in r.output


@pytest.mark.parametrize("args, message", [
    (["analyze", "--model", "llama3-8b", "--mem-util", "2"],
     "--mem-util must be in (0, 1] (a share of GPU memory), got 2.0"),
    (["analyze", "--model", "llama3-8b", "--mem-util", "0"], "--mem-util must be in (0, 1]"),
    (["analyze", "--model", "llama3-8b", "--tp", "0"], "--tp must be a positive integer, got 0"),
    (["analyze", "--model", "llama3-8b", "--dense-batch", "-5"],
     "--dense-batch must be a positive number of tokens, got -5"),
    (["bench", "--model", "stories15m", "--input-len", "4", "--output-len", "2", "--tp", "0"],
     "--tp must be at least 1, got 0"),
    (["generate", "--model", "stories15m", "--prompt-ids", "1", "--tp", "0"],
     "--tp must be at least 1, got 0"),
])
def test_numeric_flags_are_range_checked_with_their_own_message(args, message):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output and "dense batch of" not in r.output


def test_a_shipped_profile_is_picked_for_the_gpu_asked_for():
    spec = load_spec("llama3-8b")
    prof, why = catalog.pick_shipped_profile(spec, None, "h100", assumed=True)
    assert prof.identity.gpu_name.startswith("NVIDIA H100") and "same GPU" in why
    prof, why = catalog.pick_shipped_profile(spec, None, "h200")
    assert prof.identity.gpu_name == "NVIDIA H200"
    choice = request.resolve(spec, None, None, None, fixed(1024, 512), "256")
    assert choice.profile.identity.gpu_name.startswith("NVIDIA H100")
    assert "gpu: h100 assumed (no --gpu given and no GPU here)" in choice.messages


def test_another_gpus_profile_only_when_no_gpu_was_asked_for():
    spec = load_spec("llama3-70b")  # shipped: H200 only
    prof, why = catalog.pick_shipped_profile(spec, 8, "h100", assumed=True)
    assert prof is not None and prof.identity.gpu_name == "NVIDIA H200"
    assert "NOT the h100 assumed without --gpu" in why
    prof, why = catalog.pick_shipped_profile(spec, 8, "h100")
    assert prof is None and "no shipped profile for llama3-70b on h100" in why
    assert "pass --gpu h200 or --profile llama3-70b-tp8-h200-quick" in why
    choice = request.resolve(spec, 8, None, "h100", fixed(1024, 512), "256")
    assert choice.profile is None and request.SYNTHETIC_BANNER in choice.messages


def test_the_full_grid_is_picked_over_a_quick_one_of_the_same_setup():
    spec = load_spec("llama3-70b")  # tp 4 on H100: a full and a --quick profile, batches alike
    prof, why = catalog.pick_shipped_profile(spec, 4, "h100")
    assert "'llama3-70b-tp4-h100x4'" in why and "--quick" not in prof.identity.command
    quick = catalog.load_profile(catalog.shipped_profiles()["llama3-70b-tp4-h100x4-quick"])
    assert (quick.dense_batch, quick.tp) == (prof.dense_batch, prof.tp)
    assert len(prof.pairs) > len(quick.pairs)


def test_a_late_ctrl_c_keeps_the_decided_exit_code():
    """After the command decided its exit code SIGINT is ignored while the process winds down;
    a KeyboardInterrupt that escapes the command ends with 130, not a death by SIGINT (-2)."""
    import subprocess
    import sys

    decided = ("import signal, sys\nfrom nanosched.cli import main\nsys.argv = ['nanosched', "
               "'models']\ntry:\n    main()\nexcept SystemExit as e:\n    print(e.code, "
               "signal.getsignal(signal.SIGINT) == signal.SIG_IGN)\n")
    r = subprocess.run([sys.executable, "-c", decided], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.split()[-2:] == ["0", "True"], r.stdout + r.stderr
    escaped = ("import nanosched.cli as cli\ndef interrupted(**kw):\n    raise KeyboardInterrupt"
               "\ncli.app = interrupted\ncli.main()\n")
    r = subprocess.run([sys.executable, "-c", escaped], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 130, (r.returncode, r.stderr)
