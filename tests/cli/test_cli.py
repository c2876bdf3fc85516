import json

import pytest
from repo import ROOT
from typer.testing import CliRunner

from nanosched.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_analyze_prints_table2_shape():
    r = run("analyze", "--model", "llama2-70b", "--gpu", "a100", "--tp", "8",
            "--dense-batch", "2048", "--input-len", "512", "--output-len", "1024")
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("kqv "))
    assert "27487.8" in line and "11.01" in line and "compute" in line
    assert "largest dense batch that fits: 2048" in r.output


def test_analyze_json():
    r = run("analyze", "--model", "llama3-8b", "--gpu", "h100", "--json",
            "--compute-tflops", "761")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["gpu"]["compute_gflops"] == 761e3
    assert data["optimal_tokens_per_s_per_gpu"] == pytest.approx(761e12 / (2 * 8.030261248e9))


@pytest.mark.parametrize("args, message", [
    (["--model", "llama9"], "--model 'llama9' is neither a known model"),
    (["--model", "llama3-8b", "--gpu", "tpu9"], "--gpu 'tpu9' is not a known GPU"),
    (["--model", "llama3-70b", "--tp", "3"], "--tp 3 does not divide"),
    (["--model", "llama3-8b", "--input-len", "0", "--output-len", "5"], "--input-len must be"),
    (["--model", "llama3-8b", "--input-len", "10", "--output-len", "-5"], "--output-len must be"),
    (["--model", "llama3-8b", "--input-len", "10"], "go together"),
    (["--model", "llama3-8b", "--workload", "alpaca"], "known: splitwise, lmsys, sharegpt"),
    (["--model", "llama3-8b", "--compute-tflops", "-1"], "--compute-tflops must be positive"),
])
def test_bad_inputs_exit_2_with_message(args, message):
    r = run("analyze", *args)
    assert r.exit_code == 2
    assert message in r.output


def test_help_explains_commands():
    r = run("--help")
    assert r.exit_code == 0 and "analyze" in r.output
    r = run("analyze", "--help")
    assert r.exit_code == 0 and "--dense-batch" in r.output and "Table 2" in r.output


@pytest.mark.parametrize("command", [["show"], ["profile", "show"]])
def test_plot_help_names_the_plot_extra(command):
    """Rich renders the help; `[plot]` must come out as written, not be read as markup."""
    r = CliRunner().invoke(app, [*command, "--help"], terminal_width=250)
    text = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 0 and "(needs the [plot] extra: matplotlib)" in text


def test_models_lists_the_registry_with_sizes():
    r = CliRunner().invoke(app, ["models", "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads(r.stdout)}  # the assumed GPU: stderr
    assert {"llama3-8b", "smollm2-135m", "qwen2.5-0.5b", "mixtral-8x7b"} <= set(rows)
    assert 0.13 < rows["smollm2-135m"]["params_b"] < 0.14  # SmolLM2-135M's real config
    assert 0.49 < rows["qwen2.5-0.5b"]["params_b"] < 0.50
    assert rows["llama3-8b"]["tp"] == 1 and rows["llama3-70b"]["tp"] > 1
    r = CliRunner().invoke(app, ["models", "--gpu", "tpu"])
    assert r.exit_code == 2 and "not a known GPU" in r.output


def test_the_small_model_generates_on_the_cpu():
    r = CliRunner().invoke(app, ["generate", "--model", "smollm2-135m", "--prompt-ids", "1,2,3",
                                 "--max-tokens", "3", "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.output.splitlines()[-1])["output_ids"]) == 3


def test_the_readme_quick_start_runs_the_tiny_model():
    """The README's CPU commands on stories15m, exactly as written there."""
    import shlex

    readme = (ROOT / "README.md").read_text()
    commands = [line.strip() for line in readme.splitlines()
                if line.startswith(("nanosched generate --model stories15m",
                                    "nanosched bench --model stories15m"))]
    assert len(commands) == 2, commands
    for command in commands:
        r = CliRunner().invoke(app, shlex.split(command)[1:])
        assert r.exit_code == 0, (command, r.output)
    assert "Total token throughput (tok/s)" in r.output  # the bench's table


def test_the_readme_cpu_bench_is_warmed_up_and_says_so():
    """Issue 45: the README's CPU bench showed 12 tokens/s and 2.3-2.8 s TTFT for a 15M model,
    the first requests' costs: on the CPU a small model now gets 8 untimed warm-up requests
    by default, and the header says whether a run was warmed up."""
    import shlex

    readme = (ROOT / "README.md").read_text()
    command = next(line.strip() for line in readme.splitlines()
                   if line.startswith("nanosched bench --model stories15m"))
    r = CliRunner().invoke(app, shlex.split(command)[1:])
    assert r.exit_code == 0, r.output
    assert "; 8 untimed warm-up requests before each run" in r.output
    r = CliRunner().invoke(app, [*shlex.split(command)[1:], "--warmup-prompts", "0"])
    assert r.exit_code == 0 and "no warm-up (--warmup-prompts 0)" in r.output, r.output


COMMANDS = [["models"], ["analyze"], ["generate"], ["bench"], ["search"], ["verify"], ["show"],
            ["serve"], ["profile"], ["profile", "show"], ["profile", "forward"],
            ["profile", "rederive"]]


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
def test_help_has_no_hard_breaks_and_no_type_on_flags(command):
    """Issue 45: a docstring's hard line breaks showed as breaks in mid-sentence in the boxes
    (rich keeps them), and every flag was tagged `<bool>` though it takes no value."""
    import typer

    group = typer.main.get_command(app)
    cmd = group
    for name in command:
        cmd = cmd.commands[name]
    for para in (cmd.help or "").split("\n\n"):
        assert all(ln.startswith("- ") for ln in para.splitlines()[1:]), (command, para)
    r = CliRunner().invoke(app, [*command, "--help"], terminal_width=80)
    assert r.exit_code == 0, r.output
    assert "<bool>" not in r.output and "--help" in r.output


def test_the_top_level_help_starts_where_the_readme_does():
    readme = (ROOT / "README.md").read_text()
    assert "nanosched search --model llama3-70b --buckets dense" in readme
    r = CliRunner().invoke(app, ["--help"], terminal_width=250)
    text = " ".join(r.output.replace("│", " ").split())
    assert "Start where the README does: `nanosched search --model llama3-70b --buckets " \
        "dense`" in text
    r = CliRunner().invoke(app, ["bench", "--help"], terminal_width=250)
    text = " ".join(r.output.replace("│", " ").split())
    assert "Run Sequential, the strategy, then Sequential again on the same requests" in text
