"""One engine on two ranks (gloo, a spawned worker) serves the tokens the same engine serves at
tp = 1: with preemption by recompute and by swap, an FP8 KV cache, graph buckets (layout on the
CPU), the asynchronous loop, temperature sampling and aborts, prefix caching on and off (odd
requests share a prompt prefix: rank 0 decides, the other ranks replay its page choices);
several engines one after another on one group (as `bench --compare` builds them), and a call
on every rank."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hf_models import make_hf

from nanosched.models.spec import load_spec
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.kv_pool import AdmissionConfig
from nanosched.runtime.loader import build_engine, load_model, named_choice
from nanosched.runtime.ranks.group import start_ranks
from nanosched.runtime.requests import Request, SamplingParams

pytestmark = pytest.mark.slow

CASES = {
    "recompute": dict(admission=AdmissionConfig(preemption="recompute")),
    "swap, fp8 KV": dict(kv_dtype="fp8", admission=AdmissionConfig(preemption="swap")),
    "graph layout, async loop": dict(graphs="layout", async_loop=True,
                                     admission=AdmissionConfig(preemption="swap")),
    "no prefix caching": dict(prefix_caching=False),
}


def requests() -> list[Request]:
    """Twelve requests whose pages outgrow a 20-page cache (preemptions), two sampled at a
    temperature, the odd ones starting with the same 40 tokens."""
    out = []
    shared = [(5 * j + 1) % 256 for j in range(40)]
    for i in range(12):
        prompt = [(7 * i + 3 * j) % 256 for j in range(20 + 5 * i)]
        if i % 2:
            prompt = shared + prompt
        temp = 0.8 if i in (3, 8) else 0.0
        out.append(Request(i, prompt, SamplingParams(temperature=temp, max_tokens=12 + 2 * i,
                                                     ignore_eos=True)))
    return out


def serve(model, cfg, ranks=None, abort_at: int | None = None) -> tuple[list, dict]:
    """Every request's output ids and the preemptions, served to completion; with `abort_at`,
    request 5 is aborted after that many steps."""
    reqs = requests()
    choice = named_choice("sequential", None, model.spec, model.device)
    with build_engine(model, cfg, choice, requests=reqs, ranks=ranks) as loaded:
        eng = loaded.engine
        for r in reqs:
            eng.add_request(r)
        with torch.inference_mode():
            steps = 0
            while eng.has_work:
                eng.step()
                steps += 1
                if steps == abort_at:
                    eng.abort(5)
        alloc = eng.ws.kv.allocator
        assert alloc.num_free == cfg.num_pages and not any(alloc.refs)
        report = eng.scheduler.report()
        return [r.output_ids for r in reqs], report["preemptions"], report["prefix_cache"]


@pytest.mark.slow
def test_tp2_engine_serves_what_tp1_serves(tmp_path):
    folder = str(tmp_path / "llama")
    make_hf("llama", tmp_path / "llama", seed=5)
    spec = load_spec(folder)
    base = EngineConfig(model=folder, device="cpu", dense_batch=64, num_pages=20,
                        max_context=256, eos_ids=frozenset())
    cpu = torch.device("cpu")
    one = load_model(spec, folder, cpu)
    want = {name: serve(one, replace(base, **kw)) for name, kw in CASES.items()}
    want_abort = serve(one, base, abort_at=6)[0]
    cfg2 = replace(base, tp=2)
    with start_ranks(cfg2, folder, cpu) as group:
        two = load_model(spec, folder, cpu, tp=group.tp)
        got = {name: serve(two, replace(cfg2, **kw), group) for name, kw in CASES.items()}
        got_abort = serve(two, cfg2, group, abort_at=6)[0]
    for name in CASES:
        tokens, preempted, cached = got[name]
        assert tokens == want[name][0], name
        assert preempted == want[name][1] and cached == want[name][2], name
        assert (cached["hits_tokens"] > 0) == (name != "no prefix caching"), name
    assert want["recompute"][1]["recomputed"] > 0
    assert want["swap, fp8 KV"][1]["swapped"] > 0
    assert got_abort == want_abort and len(got_abort[5]) < 22


@pytest.mark.slow
def test_generate_tp2_prints_the_tokens_of_tp1(tmp_path):
    """... with the layers' all-reduces on gloo and on the copy engine (host transport)."""
    import json

    from typer.testing import CliRunner

    from nanosched.cli import app

    make_hf("qwen2", tmp_path / "qwen", seed=9, num_key_value_heads=1, vocab_size=251)
    outs = []
    for tp, collective in (("1", "nccl"), ("2", "nccl"), ("2", "copy_engine")):
        r = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "qwen"), "--json",
                                     "--prompt-ids", "4,8,15,16,23,42", "--max-tokens", "10",
                                     "--kv-cache-dtype", "fp8", "--tp", tp,
                                     "--collective", collective])
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.stdout.strip().splitlines()[-1])["output_ids"])
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 10
