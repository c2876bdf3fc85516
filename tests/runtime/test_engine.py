"""The engine on a tiny random Llama on the CPU: same tokens as one-request greedy decoding."""

import pytest
import torch
from runtime_helpers import TINY_SPEC_KW, apply_batch, make_engine, step, tiny_engine_model

from nanosched.errors import ConfigError
from nanosched.models.spec import ModelSpec
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.engine import Engine
from nanosched.runtime.requests import Request, SamplingParams, make_requests
from nanosched.runtime.strategies import TwoBatchOverlap

SPEC = ModelSpec(**TINY_SPEC_KW)


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model()


def reference(model, prompt, n):
    """Greedy decoding of one request alone, through the paged cache."""
    ws = model.new_workspace(max_tokens=len(prompt), num_pages=32)
    out = []
    logits = step(model, ws, [(0, prompt, False)])[0]
    while len(out) < n:
        out.append(int(logits.argmax()))
        logits = step(model, ws, [(0, [out[-1]], True)])[0]
    return out


def requests(seed=0, n=12):
    reqs = make_requests("sharegpt", None, None, n, vocab_size=97, max_len=120, seed=seed)
    for r in reqs:  # keep it quick: short outputs
        r.params = SamplingParams(max_tokens=min(r.params.max_tokens, 9), ignore_eos=True)
        r.prompt_ids = r.prompt_ids[:40]
    return reqs


def run_engine(model, reqs, **kw):
    eng = make_engine(model, dense_batch=kw.pop("dense_batch", 24),
                      num_pages=kw.pop("pages", 64), **kw)
    for r in reqs:
        eng.add_request(r)
    done = eng.run_to_completion()
    assert eng.ws.kv.allocator.num_free == eng.ws.kv.allocator.num_pages  # no page leaks
    return eng, done


def test_every_request_finishes_once_with_its_reference_tokens(model):
    reqs = requests()
    eng, done = run_engine(model, reqs)
    assert sorted(r.request_id for r in done) == list(range(len(reqs)))
    assert max(eng.stats.batch_sizes) <= 24 and eng.stats.iterations > 3
    for r in reqs:
        assert r.output_ids == reference(model, r.prompt_ids, r.params.max_tokens), r.request_id


def test_two_batch_overlap_gives_the_same_tokens(model):
    a, b = requests(seed=1), requests(seed=1)
    run_engine(model, a)
    eng, _ = run_engine(model, b, strategy=TwoBatchOverlap(n_tiles=2, num_sms=4, tile_m=8))
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert eng.stats.fallbacks == 0


@pytest.mark.parametrize("strategy", [None, TwoBatchOverlap()])
def test_graph_bucket_layout_gives_the_reference_tokens(model, strategy):
    """Batches padded into CUDA-graph buckets (run eagerly on the CPU): the same tokens."""
    reqs = requests(seed=5)
    eng, done = run_engine(model, reqs, graphs="layout", graph_align=4, strategy=strategy)
    assert len(done) == len(reqs)
    for r in reqs:
        assert r.output_ids == reference(model, r.prompt_ids, r.params.max_tokens)
    g = eng.stats.graphs
    assert g.eager_bucket + g.unbucketed == eng.stats.iterations and g.eager_bucket > 0
    assert g.padded_rows > 0 and len(g.buckets) > 1 and g.captures == g.replays == 0


def test_graphs_on_needs_a_gpu_model(model):
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA model"):
        Engine(model, EngineConfig(dense_batch=8, num_pages=8, graphs="on"))
    with pytest.raises(ConfigError, match="graphs must be 'off', 'on' or 'layout'"):
        Engine(model, EngineConfig(dense_batch=8, num_pages=8, graphs="yes"))
    with pytest.raises(ConfigError, match="dense_batch and num_pages must be set"):
        Engine(model, EngineConfig(num_pages=8))


def test_eos_ends_a_request_unless_ignored(model):
    prompt = list(range(5, 20))
    ref = reference(model, prompt, 6)
    eos = ref[2]
    stop = Request(0, prompt, SamplingParams(max_tokens=6))
    keep = Request(1, prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    eng, _ = run_engine(model, [stop, keep], eos_ids={eos})
    first = ref.index(eos)
    assert stop.output_ids == ref[:first + 1] and stop.finish_reason == "stop"
    assert keep.output_ids == ref and keep.finish_reason == "length"


def test_temperature_sampling_is_seeded(model):
    def run(seed):
        reqs = [Request(i, list(range(3, 12 + i)), SamplingParams(temperature=1.0, top_p=0.9,
                                                                    max_tokens=5))
                for i in range(4)]
        run_engine(model, reqs, seed=seed)
        return [r.output_ids for r in reqs]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_small_kv_cache_queues_instead_of_overflowing(model):
    reqs = requests(seed=2, n=10)
    eng, done = run_engine(model, reqs, pages=12)  # fits only a few requests at once
    assert len(done) == 10
    for r in reqs[:3]:
        assert r.output_ids == reference(model, r.prompt_ids, r.params.max_tokens)



def test_async_loop_gives_the_same_tokens_as_the_synchronous_one(model):
    prompt = list(range(5, 20))
    eos = reference(model, prompt, 6)[2]
    outs = []
    for is_async in (False, True):
        reqs = requests(seed=4)
        reqs.append(Request(len(reqs), prompt, SamplingParams(max_tokens=6)))
        eng, done = run_engine(model, reqs, eos_ids={eos}, async_loop=is_async)
        assert eng.async_loop is is_async and len(done) == len(reqs)
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]
    assert outs[1][-1][-1] == eos  # the EOS request ended there, its late token dropped


def _plan_and_advance(kv, scheduler):
    """One step without a model: plan the batch into the cache, emit a token per sampler."""
    apply_batch(scheduler, kv, scheduler.form())


@pytest.mark.slow
def test_no_kv_page_leaks_over_10000_steps_with_random_arrivals():
    """The request scheduler's batches planned into the real paged cache: pages never run out (plan
    would raise) and all come back (no model: the cache only keeps block tables here)."""
    import random

    from nanosched.models.kvcache import KVCache
    from nanosched.runtime.request_scheduler import RequestScheduler

    rng = random.Random(5)
    page, pages = 16, 96
    kv = KVCache(num_layers=1, num_pages=pages, num_kv_heads=1, head_dim=1,
                 dtype=torch.float32, page_size=page)
    b = RequestScheduler(dense_batch=64, kv_capacity_pages=pages, page_size=page, max_context=512)
    made = 0
    for _ in range(10_000):
        if rng.random() < 0.3:
            b.add(Request(made, [1] * rng.randint(1, 150),
                          SamplingParams(max_tokens=rng.randint(1, 50), ignore_eos=True)))
            made += 1
        _plan_and_advance(kv, b)
    assert made > 2500
    while b.has_work:
        _plan_and_advance(kv, b)
    assert kv.allocator.num_free == pages and not kv.tables


def test_gpu_busy_and_idle_from_the_iterations_spans():
    """What `bench` reports of the GPU timeline: the work of each iteration, and the gaps in
    which the GPU had finished one and the CPU had not yet queued the next (overlaps, when the
    CPU ran ahead, are not gaps)."""
    from nanosched.runtime.stats import busy_and_idle

    assert busy_and_idle([]) == (0.0, 0.0)
    assert busy_and_idle([(0.0, 30.0)]) == (30.0, 0.0)
    assert busy_and_idle([(0.0, 30.0), (42.0, 70.0), (70.0, 100.0)]) == (88.0, 12.0)


def test_the_gpu_timeline_is_a_gpu_record_and_off_on_the_cpu(model):
    eng = make_engine(model, num_pages=64, dense_batch=64, gpu_timeline=True)
    assert not eng.gpu_timeline  # nothing to record without a GPU
    for r in make_requests(None, 8, 4, 3, model.spec.vocab_size, 64, seed=1):
        eng.add_request(r)
    eng.run_to_completion()
    assert eng.stats.gpu_marks == [] and eng.gpu_timeline_report() is None


def test_each_forward_is_timed_at_the_shape_it_ran(model):
    """`forward_ms_by_shape`: the GPU time between the marks around each forward, grouped by
    the (D, T) shape `stats.shapes` counts it under (what `bench` sets beside a set's
    prediction for that shape). Events stand in for CUDA's on the CPU: each reads the step
    count it was recorded at."""

    class Mark:
        count = 0

        def __init__(self) -> None:
            Mark.count += 1
            self.at = float(Mark.count)

        def elapsed_time(self, end: "Mark") -> float:
            return end.at - self.at

        def synchronize(self) -> None:
            pass

    eng = make_engine(model, num_pages=64, dense_batch=64)
    eng.gpu_timeline, eng._gpu_mark = True, Mark
    for r in make_requests(None, 8, 4, 3, model.spec.vocab_size, 64, seed=1):
        eng.add_request(r)
    eng.run_to_completion()
    times = eng.forward_ms_by_shape()
    assert {k: len(v) for k, v in times.items()} == dict(eng.stats.shapes)
    # marks per iteration: start, forward start, forward end, end: one mark between the two
    assert all(t == 1.0 for v in times.values() for t in v)
    assert eng.gpu_timeline_report()["iterations"] == eng.stats.iterations
