"""`bench` and `serve` admission flags: range-checked (exit 2 naming the flag), explained in
--help, and bench's report of tokens per iteration, full batches and preemptions."""

import json

import pytest
from runtime_helpers import DATA
from typer.testing import CliRunner

from nanosched.cli import app

CONFIG = str(DATA / "tiny_llama_config.json")
BENCH = ["bench", "--model", CONFIG, "--input-len", "32", "--output-len", "8",
         "--num-prompts", "10", "--dense-batch", "64", "--device", "cpu"]


def run(*args):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("flag, value, message", [
    ("--admission", "greedy", "--admission must be one of reserve, use, predict; got 'greedy'"),
    ("--kv-headroom", "1", "--kv-headroom must be in [0, 1) (a share of the KV cache), got 1.0"),
    ("--preemption", "drop", "--preemption must be one of recompute, swap, auto; got 'drop'"),
    ("--swap-space", "-2", "--swap-space must be in [0, 1048576] GiB, got -2.0"),
])
@pytest.mark.parametrize("command", ["bench", "serve"])
def test_bad_admission_flags_exit_2_naming_the_flag(command, flag, value, message):
    args = BENCH if command == "bench" else ["serve", "--model", CONFIG, "--device", "cpu"]
    r = run(*args, flag, value)
    assert r.exit_code == 2, r.output
    assert message in r.output


@pytest.mark.parametrize("command", ["bench", "serve"])
def test_help_explains_the_admission_flags(command):
    r = run(command, "--help")
    text = " ".join(r.output.replace("│", " ").split())  # rich wraps help in boxes
    assert r.exit_code == 0
    for words in ("--admission", "most recently admitted", "--kv-headroom", "--preemption",
                  "prefills prompt + outputs again", "--swap-space"):
        assert words in text, words


def test_bench_reports_tokens_per_iteration_full_batches_and_preemptions(tmp_path):
    outs = {}
    for policy in ("use", "reserve"):
        path = tmp_path / f"{policy}.json"
        r = run(*BENCH, "--admission", policy, "--json", str(path))
        assert r.exit_code == 0, r.output
        assert "tokens per iteration" in r.output and "preemptions (0 recomputed" in r.output
        outs[policy] = json.loads(path.read_text())["runs"]["sequential"]
    for policy, run_ in outs.items():
        # each request: 32 prompt tokens, then 7 decode tokens (its first token ends the prompt)
        assert run_["tokens_per_iteration"] == pytest.approx(10 * (32 + 7) / run_["iterations"])
        assert 0 < run_["full_batch_share"] < 1 and run_["admission"] == policy
        assert run_["preemptions"] == {"recomputed": 0, "swapped": 0, "swap_ins": 0,
                                       "recomputed_tokens": 0, "swapped_tokens": 0,
                                       "preemptions": 0}  # the CPU cache holds every request


def test_bench_on_a_workload_smaller_than_its_full_batch(tmp_path):
    """A few short requests size a small KV cache; the full-batch forward timed after the run
    still fits (the cache is sized for both)."""
    out = tmp_path / "b.json"
    r = run("bench", "--model", CONFIG, "--input-len", "10", "--output-len", "5",
            "--num-prompts", "3", "--device", "cpu", "--json", str(out))
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    run_ = next(iter(data["runs"].values()))
    assert run_["forward_ms_full_batch"] > 0 and run_["forward_decode_tokens"] > 0


@pytest.mark.parametrize("command", ["bench", "serve", "generate"])
def test_decode_attention_is_chosen_by_flag_and_refused_naming_it(command):
    args = {"bench": BENCH, "serve": ["serve", "--model", CONFIG, "--device", "cpu"],
            "generate": ["generate", "--model", CONFIG, "--prompt-ids", "1,2"]}[command]
    r = run(*args, "--decode-attention", "flash")
    assert r.exit_code == 2, r.output
    assert "--decode-attention must be one of auto, triton_paged, triton_pipelined" in r.output
    text = " ".join(run(command, "--help").output.replace("│", " ").split())
    assert "--decode-attention" in text and "cuda_bulk on an FP8 cache" in text


def test_bench_records_the_decode_attention_it_was_given(tmp_path):
    path = tmp_path / "b.json"
    r = run(*BENCH, "--decode-attention", "triton_paged", "--json", str(path))
    assert r.exit_code == 0, r.output
    assert json.loads(path.read_text())["config"]["decode_attention"] == "triton_paged"


def test_bench_runs_cascade_decode_attention_on_a_shared_prefix_workload(tmp_path):
    path = tmp_path / "b.json"
    r = run("bench", "--model", CONFIG, "--workload",
            "shared-prefix:groups=2,prefix=40,unique=5,output=4", "--num-prompts", "8",
            "--dense-batch", "64", "--device", "cpu", "--warmup-prompts", "0",
            "--decode-attention", "cascade", "--json", str(path))
    assert r.exit_code == 0, r.output
    assert json.loads(path.read_text())["config"]["decode_attention"] == "cascade"
    text = " ".join(run("bench", "--help").output.replace("│", " ").split())
    assert "'cascade' (off by default): decode rows that share" in text


def test_bench_reports_the_prefix_cache_hit_rate_on_a_shared_prefix_workload(tmp_path):
    workload = "shared-prefix:groups=2,prefix=40,unique=5,output=4"
    outs = {}
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        path = tmp_path / f"{flag}.json"
        r = run("bench", "--model", CONFIG, "--workload", workload, "--num-prompts", "8",
                "--dense-batch", "64", "--device", "cpu", "--warmup-prompts", "0", flag,
                "--json", str(path))
        assert r.exit_code == 0, r.output
        outs[flag] = (r.output, json.loads(path.read_text())["runs"]["sequential"])
    text, on = outs["--enable-prefix-caching"]
    cache = on["prefix_cache"]
    assert cache["enabled"] and cache["queries_tokens"] == 8 * 45
    assert cache["hits_tokens"] > 0 and cache["hit_rate"] == cache["hits_tokens"] / (8 * 45)
    assert f"prefix cache: {100 * cache['hit_rate']:.1f}% of prompt tokens hit" in text
    text, off = outs["--no-enable-prefix-caching"]
    assert "prefix cache: off" in text and off["prefix_cache"]["hits_tokens"] == 0


def test_a_bad_trace_workload_exits_2_naming_it():
    r = run("bench", "--model", CONFIG, "--workload", "multi-turn:turns=2", "--device", "cpu")
    assert r.exit_code == 2, r.output
    assert "--workload 'multi-turn:turns=2': missing prompt, user, output" in r.output
