"""Batch formation and admission, driven by a simulated model that emits one token per entry."""

import math
import random

import pytest

from nanosched.errors import ConfigError
from nanosched.runtime.request_scheduler import RequestScheduler, peak_kv_tokens
from nanosched.runtime.requests import Request, SamplingParams


def req(i, prompt, out, arrival=0.0):
    return Request(i, list(range(prompt)), SamplingParams(max_tokens=out, ignore_eos=True),
                   arrival_s=arrival)


def apply(scheduler, batch):
    """What the engine does after a step: advance prefills, append tokens, retire."""
    finished = []
    for e in batch.entries:
        r = e.request
        if not e.is_decode:
            assert e.start == r.num_prefilled  # a chunk resumes exactly where the last stopped
            r.num_prefilled += e.num_tokens
        if e.samples:
            r.output_ids.append(7)
            if len(r.output_ids) == r.params.max_tokens:
                r.finished = True
                finished.append(r)
    scheduler.retire(finished)
    return finished


def kv_tokens_in_use(scheduler):
    return sum(r.num_prefilled + max(0, len(r.output_ids) - 1) + 1 for r in scheduler.running)


def test_peak_kv_tokens_by_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 6)
        held = [rng.randint(1, 50) for _ in range(n)]
        rem = [rng.randint(0, 20) for _ in range(n)]
        pairs = list(zip(held, rem, strict=True))
        brute = max(sum(h + t for h, r in pairs if r >= t) for t in range(0, 21))
        assert peak_kv_tokens(held, rem) == brute


def test_decode_first_then_chunked_prefill():
    b = RequestScheduler(dense_batch=8, kv_capacity_pages=100, page_size=4, max_context=100)
    b.add(req(0, 10, 3))
    b.add(req(1, 5, 2))
    first = b.form()
    assert [(e.request.request_id, e.start, e.num_tokens) for e in first.entries] == [(0, 0, 8)]
    apply(b, first)
    second = b.form()
    # request 0's prompt resumes at 8 (2 tokens), request 1 starts and is cut at the budget
    assert [(e.request.request_id, e.start, e.num_tokens, e.is_decode)
            for e in second.entries] == [(0, 8, 2, False), (1, 0, 5, False)]
    apply(b, second)
    third = b.form()
    assert [e.is_decode for e in third.entries] == [True, True]
    assert third.entries[0].start == 10  # decode feeds the last token at position prompt_len


def test_requests_that_never_fit_are_rejected():
    b = RequestScheduler(dense_batch=8, kv_capacity_pages=10, page_size=4, max_context=64)
    with pytest.raises(ConfigError, match="prompt \\(60\\) \\+ max_tokens \\(10\\) = 70 exceeds"
                                          " the model's context of 64"):
        b.add(req(0, 60, 10))
    with pytest.raises(ConfigError, match="needs 50 KV tokens \\(14 pages\\) but the cache "
                                          "holds 40 tokens"):
        b.add(req(1, 40, 10))


@pytest.mark.slow
def test_random_arrivals_10000_steps_never_overflow_starve_or_lose():
    rng = random.Random(1)
    dense, pages, page = 64, 120, 16
    b = RequestScheduler(dense, pages, page, max_context=512)
    made, done, step = [], [], 0
    while step < 10_000:
        if rng.random() < 0.3 and len(made) < 5000:
            r = req(len(made), rng.randint(1, 200), rng.randint(1, 60))
            made.append(r)
            b.add(r)
        batch = b.form()
        decoding = [r for r in b.running if not r.is_prefilling]
        assert batch.num_tokens <= dense
        # every request past its prompt decodes in every iteration: none starves
        assert {id(e.request) for e in batch.entries if e.is_decode} == {id(r) for r in decoding}
        done += apply(b, batch)
        held_pages = sum(math.ceil((r.num_prefilled + len(r.output_ids)) / page)
                         for r in b.running)
        assert held_pages <= pages
        assert b.predicted_peak_pages() <= pages
        step += 1
    while b.has_work:  # drain
        done += apply(b, b.form())
    assert sorted(r.request_id for r in done) == list(range(len(made)))
    assert all(len(r.output_ids) == r.params.max_tokens for r in made)
    assert not b.running and not b.waiting
