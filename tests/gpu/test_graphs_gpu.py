"""CUDA graphs per batch bucket on a GPU: a graph replayed with new batches' metadata computes
what the eager forward over the same bucket computes, for every strategy; the engine with
graphs gives the tokens of the engine laying batches out the same way eagerly."""

from pathlib import Path

import pytest
import torch
from runtime_helpers import make_engine, serve_all

from nanosched.models.model import CausalLM
from nanosched.models.spec import REGISTRY
from nanosched.models.weights import init_random
from nanosched.runtime.backend import Backend
from nanosched.runtime.device import CudaDevice
from nanosched.runtime.graphs import BucketRunner
from nanosched.runtime.requests import Request, SamplingParams, make_requests
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap
from nanosched.runtime.strategies.replay import Replay
from nanosched.schedules.format import load_schedule

pytestmark = pytest.mark.gpu

SPEC = REGISTRY["llama3-8b"].__class__(**{**REGISTRY["llama3-8b"].to_json(), "num_layers": 2,
                                          "name": "llama3-8b-2l"})
SHIPPED = Path(__file__).parents[1] / "data" / "llama3-8b-tp1-h200-b2048-single.json"
DENSE = 2048


@pytest.fixture(scope="module")
def model():
    m = CausalLM(SPEC, dtype=torch.bfloat16, device="cuda")
    init_random(m, seed=0)
    return m


def batches(ws, seed):
    """Three batches of one bucket (640 decode rows, 2,048 rows): decode counts 612..630 with
    900..1,300 tokens of context, then prompt chunks (one continuing) of different lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (nd, cuts) in enumerate([(630, (700, 708)), (615, (40, 900, 468)),
                                    (612, (1000, 300, 100, 8))]):
        base = 100_000 * (k + 1)
        for r in range(nd):
            ws.kv.plan([(base + r, 900 + int(torch.randint(0, 400, (1,), generator=g)),
                         False)])
        ws.kv.plan([(base + 50_000, 256, False)])  # the first prompt continues after 256
        chunks = [(base + r, 1, True) for r in range(nd)]
        chunks += [(base + 50_000 + i, n, False) for i, n in enumerate(cuts)]
        out.append(ws.kv.plan_chunks(chunks))
    return out


def run_batches(model, strategy, device, capture):
    ws = model.new_workspace(max_tokens=DENSE, num_pages=160_000)  # three batches, kept
    ws.kv.k.normal_(generator=torch.Generator("cuda").manual_seed(1))
    ws.kv.v.normal_(generator=torch.Generator("cuda").manual_seed(2))
    runner = BucketRunner(model, ws, Backend(device), strategy, align=32, max_pages=128,
                          capture=capture)
    logits = []
    with torch.inference_mode():
        for i, seqs in enumerate(batches(ws, seed=0)):
            bucket = runner.bucket(seqs)
            assert bucket.num_tokens == DENSE and bucket.num_decode == 640
            ws.token_ids.random_(0, SPEC.vocab_size, generator=torch.Generator("cuda")
                                 .manual_seed(10 + i))
            runner.run(runner.entry(bucket), seqs)
            logits.append(model.logits(ws, torch.arange(DENSE, device="cuda")).float())
    torch.cuda.synchronize()
    return logits, runner


@pytest.mark.parametrize("name", ["sequential", "two_batch", "replay"])
def test_graph_replays_equal_eager_forwards_of_the_bucket(model, name):
    def make():
        if name == "replay":
            replay = Replay(load_schedule(SHIPPED), SPEC.num_layers)
            from nanosched.runtime.streams import ReplayStreams

            streams = ReplayStreams(replay.streams, 0)
            return replay, streams.device, streams
        return {"sequential": Sequential, "two_batch": TwoBatchOverlap}[name](), CudaDevice(), \
            None

    results = []
    for capture in (False, True):
        strategy, device, closer = make()
        try:
            results.append(run_batches(model, strategy, device, capture))
        finally:
            if closer is not None:
                closer.close()
    (eager, _), (graphed, runner) = results
    assert runner.errors == {}
    assert runner.stats.captures == 1 and runner.stats.replays == 2
    for a, b in zip(eager, graphed, strict=True):
        assert torch.equal(a, b) or ((a - b).norm() / a.norm()).item() < 1e-3
    assert not torch.equal(graphed[1], graphed[2])  # each replay computed its own batch


def test_engine_with_graphs_gives_the_tokens_of_the_same_layout_run_eagerly(model):
    outs, stats = [], []
    for graphs in ("layout", "on"):
        reqs = make_requests("sharegpt", None, None, 96, SPEC.vocab_size, 2048, seed=5)
        out, eng = serve_all(model, reqs, 8192, dense_batch=512, graphs=graphs, graph_align=32)
        outs.append(out)
        stats.append(eng.stats.graphs)
    assert outs[0] == outs[1]
    assert stats[1].replays > stats[1].captures > 0 and not stats[1].unbucketed


def test_a_replayed_engine_step_waits_on_the_gpu_only_for_the_last_batch(model):
    """The asynchronous loop keeps the GPU busy only if a step never waits for the GPU but to
    read back the previous batch's tokens (an event). Once every request decodes and its bucket
    is captured, steps run under torch's sync debug mode "error", which raises on any
    synchronising op: a blocking host-to-device copy (`torch.tensor(..., device=...)`), `.item()`
    or the truth of a device tensor; half the requests sample at random, half greedily."""
    g = torch.Generator().manual_seed(3)
    reqs = [Request(i, torch.randint(0, SPEC.vocab_size, (32,), generator=g).tolist(),
                    SamplingParams(temperature=0.8 if i % 2 else 0.0, max_tokens=64,
                                   ignore_eos=True)) for i in range(16)]  # greedy and random
    eng = make_engine(model, num_pages=4096, dense_batch=512, graphs="on", graph_align=32,
                      gpu_timeline=True)
    assert eng.async_loop and eng.gpu_timeline
    for r in reqs:
        eng.add_request(r)
    with torch.inference_mode():
        while not (all(r.output_ids for r in reqs) and eng.stats.graphs.replays >= 2):
            eng.step()
        done = sum(len(r.output_ids) for r in reqs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(8):
                eng.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert sum(len(r.output_ids) for r in reqs) >= done + 7 * len(reqs)
        eng.run_to_completion()
    assert all(len(r.output_ids) == 64 for r in reqs)
    report = eng.gpu_timeline_report()  # the events recorded never made a step wait
    assert report["iterations"] == eng.stats.iterations
    assert report["busy_s"] > 0 and report["idle_s"] >= 0
