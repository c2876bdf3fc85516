"""One engine on two GPUs (NCCL): CUDA graphs per bucket on both ranks give the tokens of the
same buckets run eagerly, with preemption by swap and an FP8 KV cache; `bench --tp 2` replays
graphs on both ranks (tests/gpu/test_tp_serve_gpu.py: the server).

Run on a machine with two or more GPUs: `PYTHONPATH=. python -m pytest -m gpu
tests/gpu/test_tp_engine_gpu.py` (a 2-layer model of Llama-3-8B's shapes, random weights).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from repo import ROOT
from runtime_helpers import llama3_8b_layers

from nanosched.models.spec import load_spec
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.kv_pool import AdmissionConfig
from nanosched.runtime.loader import build_engine, load_model, named_choice
from nanosched.runtime.ranks.group import start_ranks
from nanosched.runtime.requests import Request, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return llama3_8b_layers(tmp_path_factory.mktemp("m") / "llama3-8b-2l")


def requests() -> list[Request]:
    g = torch.Generator().manual_seed(0)
    return [Request(i, torch.randint(0, 128000, (int(n),), generator=g).tolist(),
                    SamplingParams(max_tokens=48, ignore_eos=True))
            for i, n in enumerate(torch.randint(200, 900, (48,), generator=g))]


def serve(model, cfg, group) -> tuple[list[list[int]], dict]:
    reqs = requests()
    choice = named_choice("sequential", None, model.spec, model.device)
    with build_engine(model, cfg, choice, requests=reqs, ranks=group) as loaded:
        eng = loaded.engine
        for r in reqs:
            eng.add_request(r)
        with torch.inference_mode():
            eng.run_to_completion()
        torch.cuda.synchronize()
        graphs = eng.stats.graphs.as_dict()
        return [r.output_ids for r in reqs], graphs | eng.scheduler.report()["preemptions"]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_tp2_graphs_replay_what_the_same_buckets_compute_eagerly(folder, kv_dtype):
    base = EngineConfig(model=folder, device="cuda", tp=2, dense_batch=512, num_pages=600,
                        kv_dtype=kv_dtype, max_context=1024, eos_ids=frozenset(),
                        admission=AdmissionConfig(preemption="swap"))
    cuda0 = torch.device("cuda", 0)
    with start_ranks(base, "random", cuda0) as group:
        model = load_model(load_spec(folder), "random", cuda0, 0, group.tp)
        eager, e_stats = serve(model, replace(base, graphs="layout"), group)
        graphed, g_stats = serve(model, replace(base, graphs="on"), group)
    assert g_stats["replays"] > 20 and g_stats["captures"] > 0
    assert e_stats["swapped"] > 0 and g_stats["swapped"] == e_stats["swapped"]
    assert graphed == eager


def test_bench_tp2_replays_graphs_on_both_ranks(folder, tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "nanosched.cli", "bench", "--model", folder,
                        "--tp", "2", "--input-len", "512", "--output-len", "64",
                        "--num-prompts", "64", "--graphs", "on", "--json", str(out)],
                       env=os.environ | {"PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(out.read_text())["runs"]["sequential+graphs"]
    assert run["graph_stats"]["replays"] > 0 and not run["graph_errors"]
    assert run["results"]["percent_of_optimal"] > 0
    assert run["tp_messages"]["steps"] == run["iterations"]
