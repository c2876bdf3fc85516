"""Automatic prefix caching in the engine on a tiny random Llama on the CPU: greedy tokens equal
with the cache on and off (shared prefixes, evictions, preemption by recompute and by swap, an
FP8 cache, the asynchronous loop, graph bucket layout), decode-filled pages reused by a later
turn, the last prompt token always computed, and no leaked or over-held page after aborts."""

import pytest
import torch
from runtime_helpers import TINY_SPEC_KW, make_engine, tiny_engine_model

from nanosched.models.spec import ModelSpec
from nanosched.runtime.kv_pool import AdmissionConfig
from nanosched.runtime.requests import Request, SamplingParams, make_requests

SPEC = ModelSpec(**TINY_SPEC_KW)


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model()


def shared_requests(n=12, max_tokens=10):
    """Three groups of a 21-token prefix (five full 4-token pages) and 3 + i % 4 own tokens."""
    prefixes = [[(11 * g + 5 * j) % 97 for j in range(21)] for g in range(3)]
    return [Request(i, prefixes[i % 3] + [(i * 7 + j) % 97 for j in range(3 + i % 4)],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i in range(n)]


def serve(model, reqs, caching, pages=64, **kw):
    """Every request's output ids and the engine, served to completion; checks that every
    page came back and that no page is still referenced."""
    eng = make_engine(model, dense_batch=kw.pop("dense_batch", 24), num_pages=pages,
                      page_size=4, prefix_caching=caching, **kw)
    for r in reqs:
        eng.add_request(r)
    with torch.inference_mode():
        eng.run_to_completion()
    alloc = eng.ws.kv.allocator
    assert alloc.num_free == pages and not any(alloc.refs) and not eng.ws.kv.tables
    return [r.output_ids for r in reqs], eng


CASES = {
    "plenty of pages": dict(),
    "evictions, recompute": dict(pages=24),
    "evictions, swap": dict(pages=24, admission=AdmissionConfig(preemption="swap")),
    "fp8 KV, swap": dict(pages=24, kv_dtype="fp8",
                         admission=AdmissionConfig(preemption="swap")),
    "async loop, graph layout": dict(pages=24, async_loop=True, graphs="layout",
                                     graph_align=4),
    "reserve": dict(pages=40, admission=AdmissionConfig(policy="reserve")),
    "predict": dict(pages=24, admission=AdmissionConfig(policy="predict")),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_are_the_same_with_the_cache_on_and_off(model, case):
    kw = CASES[case]
    want, off = serve(model, shared_requests(), False, **kw)
    got, on = serve(model, shared_requests(), True, **kw)
    assert got == want
    cache = on.scheduler.prefix_report()
    assert cache["enabled"] and cache["hits_tokens"] > 0 and cache["hits_tokens"] % 4 == 0
    preempted = on.scheduler.report()["preemptions"]["preemptions"]
    if not preempted:  # a request re-admitted after a preemption queries again
        assert cache["queries_tokens"] == sum(r.prompt_len for r in shared_requests())
    assert off.scheduler.prefix_report()["hits_tokens"] == 0
    assert on.stats.prefill_tokens < off.stats.prefill_tokens
    if case.startswith("evictions"):
        assert preempted > 0 and cache["evicted_pages"] > 0


def test_hits_are_counted_in_tokens_and_the_last_prompt_token_is_computed(model):
    prompt = list(range(1, 17))  # exactly four full pages
    reqs = [Request(i, list(prompt), SamplingParams(max_tokens=4, ignore_eos=True),
                    arrival_s=0.0) for i in range(2)]
    eng = make_engine(model, dense_batch=24, num_pages=16, page_size=4)
    eng.add_request(reqs[0])
    with torch.inference_mode():
        eng.run_to_completion()
        eng.add_request(reqs[1])
        eng.step()
    # three pages hit: the fourth holds the last prompt token, whose logits must be computed
    assert eng.scheduler.stats.prefix_queries == 32 and eng.scheduler.stats.prefix_hits == 12
    assert eng.stats.prefill_tokens == 16 + 4
    with torch.inference_mode():
        eng.run_to_completion()
    assert reqs[1].output_ids == reqs[0].output_ids


@pytest.mark.parametrize("together", [True, False])
def test_choices_of_one_prompt_share_its_pages_while_they_run(model, together):
    """The second copy of a prompt (a choice of n > 1, added with the first or a step later)
    holds the first's full pages, one reference more each, and frees none of them while the
    first runs; added together, it waits a step for them rather than compute them again."""
    prompt = [(3 * j + 2) % 97 for j in range(30)]
    a, b = (Request(i, list(prompt), SamplingParams(max_tokens=8, ignore_eos=True))
            for i in range(2))
    eng = make_engine(model, dense_batch=64, num_pages=32, page_size=4)
    eng.add_request(a)
    if together:
        eng.add_request(b)
    with torch.inference_mode():
        eng.step()
        assert eng.stats.prefill_tokens == 30
        if not together:
            eng.add_request(b)
        eng.step()
        assert eng.stats.prefill_tokens == 30 + 2  # b computes its last page's two tokens
        kv = eng.ws.kv
        shared = kv.tables[0][:7]
        assert kv.tables[1][:7] == shared and all(kv.allocator.refs[p] == 2 for p in shared)
        assert kv.allocator.num_in_use == len(set(kv.tables[0]) | set(kv.tables[1]))
        eng.run_to_completion()
    assert a.output_ids == b.output_ids and not any(kv.allocator.refs)


def test_a_later_turn_reuses_the_pages_its_decode_filled(model):
    first = Request(0, [(5 * j + 1) % 97 for j in range(10)],
                    SamplingParams(max_tokens=12, ignore_eos=True))
    eng = make_engine(model, dense_batch=24, num_pages=32, page_size=4)
    eng.add_request(first)
    with torch.inference_mode():
        eng.run_to_completion()
        # prompt + outputs but the last output have KV: 21 tokens, five full pages
        turn = Request(1, first.prompt_ids + first.output_ids + [3, 4, 5],
                       SamplingParams(max_tokens=4, ignore_eos=True))
        eng.add_request(turn)
        eng.run_to_completion()
    assert eng.scheduler.stats.prefix_hits == 20
    want, _ = serve(model, [Request(1, list(turn.prompt_ids),
                                    SamplingParams(max_tokens=4, ignore_eos=True))], False)
    assert turn.output_ids == want[0]


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_aborts_of_sharing_requests_leak_no_page(model, preemption):
    """Aborts while waiting, prefilling, decoding and preempted: every page comes back, no
    reference is left, and the others' tokens are those of a run without the aborted ones."""
    reqs = shared_requests(n=12, max_tokens=14)
    eng = make_engine(model, dense_batch=16, num_pages=20, page_size=4,
                      admission=AdmissionConfig(preemption=preemption))
    for r in reqs:
        eng.add_request(r)
    aborted = set()
    with torch.inference_mode():
        steps = 0
        while eng.has_work:
            eng.step()
            steps += 1
            for rid in {1: [3, 11], 4: [0], 7: [5], 12: [7]}.get(steps, []):
                if eng.abort(rid) is not None:
                    aborted.add(rid)
    alloc = eng.ws.kv.allocator
    assert alloc.num_free == 20 and not any(alloc.refs) and not eng.ws.kv.tables
    assert aborted and eng.scheduler.prefix_report()["hits_tokens"] > 0
    kept = [r for r in reqs if r.request_id not in aborted]
    want, _ = serve(model, [Request(r.request_id, list(r.prompt_ids), r.params) for r in kept],
                    False, pages=64)
    assert [r.output_ids for r in kept] == want


@pytest.mark.parametrize("workload", ["shared-prefix:groups=2,prefix=18,unique=3,output=5",
                                      "multi-turn:turns=3,prompt=9,user=4,output=5"])
def test_bench_workloads_hit_the_cache(model, workload):
    def reqs():
        return make_requests(workload, None, None, 8, vocab_size=97, max_len=120, seed=3)

    want, _ = serve(model, reqs(), False)
    got, eng = serve(model, reqs(), True)
    assert got == want and eng.scheduler.prefix_report()["hit_rate"] > 0.3
