"""Admission policies and preemption of the request scheduler on synthetic requests (no model):
a paged cache with one-element pages holds the block tables, `apply` stands in for the engine."""

import re

import pytest
import torch
from runtime_helpers import apply_batch

from bench.analysis.kvsim import sim_cost
from nanosched.errors import ConfigError
from nanosched.models.kvcache import KVCache
from nanosched.runtime.kv_pool import AdmissionConfig, KVPool
from nanosched.runtime.predict import OutputLengths
from nanosched.runtime.request_scheduler import RequestScheduler
from nanosched.runtime.requests import Request, SamplingParams

PAGE = 4


def req(i, prompt, out):
    return Request(i, list(range(prompt)), SamplingParams(max_tokens=out, ignore_eos=True))


def scheduler(pages, dense=64, swap=False, **cfg):
    kv = KVCache(1, pages, 1, 1, torch.float32, page_size=PAGE)
    if cfg.get("policy") == "reserve":
        return RequestScheduler(dense, pages, PAGE, max_context=1024), kv
    admission = AdmissionConfig(preemption="swap" if swap else "recompute", **cfg)
    pool = KVPool(kv, admission, sim_cost(True))
    return RequestScheduler(dense, pages, PAGE, max_context=1024, pool=pool), kv


def ids(rs):
    return [r.request_id for r in rs]


def test_use_admits_what_reserve_holds_back():
    # 4 requests of 8 prompt tokens that may generate 40: each peaks at 12 pages, 40 are free
    reserve, _ = scheduler(40, policy="reserve")
    use, kv = scheduler(40)
    for b in (reserve, use):
        for i in range(4):
            b.add(req(i, 8, 40))
        b.form()
    assert len(reserve.running) == 3  # 3 x (12 + 1) pages of predicted peak fit in 40
    assert len(use.running) == 4 and kv.allocator.num_free == 40 - 4 * 2  # prompts' pages only


def test_decode_that_lacks_a_page_preempts_the_newest_request_first():
    b, kv = scheduler(10)
    reqs = [req(i, 12, 20) for i in range(3)]  # 3 pages each; every 4th decode needs a page
    for r in reqs:
        b.add(r)
    apply_batch(b, kv, b.form())
    assert ids(b.running) == [0, 1, 2] and kv.allocator.num_free == 1
    apply_batch(b, kv, b.form())  # first decodes: request 0 takes the free page, 1 lacks one
    assert ids(b.running) == [0, 1] and ids(b.waiting) == [2]
    assert b.pool.stats.recomputed == 1 and kv.num_held(2) == 0
    victim = b.waiting[0]
    assert victim.num_recompute == 1 and victim.num_prefilled == 0 and victim.prefill_len == 13
    for _ in range(3):  # no admission while the two decode: request 2 needs 4 pages, 2 free
        apply_batch(b, kv, b.form())
        assert ids(b.waiting) == [2]
    for _ in range(100):  # to the end: request 0, the oldest, is never preempted
        if not b.has_work:
            break
        apply_batch(b, kv, b.form())
        assert 0 not in ids(b.waiting)
    assert not b.has_work and kv.allocator.num_free == 10 and b.pool.stats.recomputed >= 2
    for r in reqs:  # every token once, in order: none lost or sampled twice by a recompute
        assert r.output_ids == list(range(20))


def test_victims_go_back_to_the_queue_head_in_admission_order():
    b, kv = scheduler(10, dense=256)
    for i, prompt in enumerate((16, 16, 4, 4)):  # 4, 4, 1 and 1 pages: the cache is full
        b.add(req(i, prompt, 8))
    b.add(req(9, 1, 1))
    apply_batch(b, kv, b.form())
    assert ids(b.running) == [0, 1, 2, 3] and kv.allocator.num_free == 0
    batch = b.form()  # every decode needs a page: 3 goes for 0's, then 2 for 1's
    assert ids(b.running) == [0, 1] and ids(b.waiting) == [2, 3, 9]
    assert [e.request.request_id for e in batch.entries] == [0, 1]  # no admission this step


def test_headroom_holds_back_admission_unless_nothing_runs():
    b, kv = scheduler(20, headroom=0.5)  # 10 pages must stay free past an admission
    b.add(req(0, 40, 30))  # 10 pages: more than the headroom allows beside others
    b.add(req(1, 4, 1))
    apply_batch(b, kv, b.form())
    assert ids(b.running) == [0]  # admitted alone, headroom waived
    apply_batch(b, kv, b.form())
    assert ids(b.waiting) == [1]  # 10 free - 1 needed < 10 headroom


def test_done_request_frees_its_pages_before_its_last_token_is_read_back():
    b, kv = scheduler(10)
    r = req(0, 4, 1)
    b.add(r)
    b.form()
    kv.plan([(0, 4, False)])
    r.num_prefilled, r.pending = 4, 1  # its only token is in flight (async loop)
    assert kv.num_held(0) == 1
    assert b.form().entries == () and kv.num_held(0) == 0


def test_swap_preemption_resumes_the_request_where_it_stopped():
    b, kv = scheduler(10, swap=True)
    for i in range(3):
        b.add(req(i, 12, 20))
    apply_batch(b, kv, b.form())
    apply_batch(b, kv, b.form())
    victim = b.waiting[0]
    assert b.pool.stats.swapped == 1 and b.pool.swap.holds(2) and kv.num_held(2) == 0
    assert victim.num_prefilled == 12 and victim.num_recompute == 0  # keeps its progress
    b.retire([b.running[1]])  # make room: request 1 ends
    kv.release(1)
    batch = b.form()
    assert ids(b.running) == [0, 2] and 2 not in [e.request.request_id for e in batch.entries]
    assert b.pool.stats.swap_ins == 1 and kv.length(2) == 12 and not b.pool.swap.holds(2)
    assert [e.request.request_id for e in b.form().entries] == [0, 2]  # decodes from now on


def test_requests_that_can_never_fit_are_refused_up_front():
    b, _ = scheduler(10)
    with pytest.raises(ConfigError, match="needs 40 KV tokens \\(11 pages\\) but the cache holds "
                                          "40 tokens"):
        b.add(req(0, 30, 10))
    b.add(req(1, 30, 5))  # 35 tokens: 9 pages + 1 of slack fit alone


@pytest.mark.parametrize("field, value, message", [
    ("policy", "greedy", "--admission must be one of reserve, use, predict; got 'greedy'"),
    ("headroom", 1.0, "--kv-headroom must be in [0, 1)"),
    ("headroom", -0.1, "--kv-headroom must be in [0, 1)"),
    ("preemption", "drop", "--preemption must be one of recompute, swap, auto"),
    ("swap_space_gib", -1.0, "--swap-space must be in [0, 1048576] GiB, got -1.0"),
])
def test_admission_flags_are_range_checked(field, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        AdmissionConfig(**{field: value})


def test_output_length_prediction():
    lengths = OutputLengths(window=4)
    assert lengths.remaining(3, 100) == 97  # nothing ended yet: the conservative bound
    for n in (10, 10, 10, 10):
        lengths.record(n)
    assert lengths.remaining(0, 100) == 10 and lengths.remaining(7, 100) == 3
    assert lengths.remaining(10, 100) == 90  # longer than any seen: the bound again
    assert lengths.remaining(0, 6) == 6  # capped by max_tokens
    for n in (2, 4, 20, 30):  # the window keeps the last 4
        lengths.record(n)
    assert lengths.remaining(3, 100) == 15  # mean of 4-3, 20-3, 30-3 = 15, rounded up
    assert lengths.remaining(0, 100) == 14  # (2 + 4 + 20 + 30) / 4


def test_predict_admits_by_the_peak_of_predicted_outputs():
    b, kv = scheduler(40, policy="predict")
    for n in (2, 2, 2):
        b.output_lengths.record(n)  # requests so far ended after 2 tokens
    for i in range(4):
        b.add(req(i, 8, 40))
    b.form()
    assert len(b.running) == 4  # predicted peak 4 x 10 tokens, not 4 x 48
    fresh, _ = scheduler(40, policy="predict")
    for i in range(4):
        fresh.add(req(i, 8, 40))
    fresh.form()
    assert len(fresh.running) == 3  # no request ended yet: as "reserve"
