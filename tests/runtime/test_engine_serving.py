"""The engine's serving hooks: `on_token` sees every token in order; `abort` frees pages."""

import pytest
from test_engine import SPEC, reference

from nanosched.models.model import CausalLM
from nanosched.models.weights import init_random
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.engine import Engine
from nanosched.runtime.kv_pool import AdmissionConfig
from nanosched.runtime.requests import Request, SamplingParams


@pytest.fixture(scope="module")
def model():
    m = CausalLM(SPEC)
    init_random(m, seed=0)
    return m


def make(n, max_tokens=8):
    return [Request(i, list(range(3 + i, 20 + 2 * i)),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i in range(n)]


@pytest.mark.parametrize("is_async", [False, True])
def test_on_token_reports_each_token_once_in_order(model, is_async):
    seen: dict[int, list[int]] = {}
    eng = Engine(model, EngineConfig(dense_batch=24, num_pages=64, async_loop=is_async),
                 on_token=lambda r, t: seen.setdefault(r.request_id, []).append(t))
    reqs = make(4)
    for r in reqs:
        eng.add_request(r)
    eng.run_to_completion()
    assert seen == {r.request_id: r.output_ids for r in reqs}
    assert all(len(v) == 8 for v in seen.values())


@pytest.mark.parametrize("is_async", [False, True])
def test_abort_running_and_waiting_requests_frees_their_pages(model, is_async):
    eng = Engine(model, EngineConfig(dense_batch=24, num_pages=9, async_loop=is_async,
                                     admission=AdmissionConfig(policy="reserve")))  # 2 fit
    reqs = make(4, max_tokens=12)
    for r in reqs:
        eng.add_request(r)
    for _ in range(4):  # requests 0 and 1 decode; 2 and 3 still wait for batch room
        eng.step()
    running = {r.request_id for r in eng.scheduler.running}
    waiting = {r.request_id for r in eng.scheduler.waiting}
    assert 0 in running and waiting, (running, waiting)
    victim, queued = reqs[0], reqs[max(waiting)]
    if is_async:
        assert victim.pending == 1  # a token of it is still in flight
    got = len(victim.output_ids)
    assert eng.abort(victim.request_id) is victim and eng.abort(queued.request_id) is queued
    assert victim.request_id not in eng.ws.kv.tables
    assert eng.abort(victim.request_id) is None and eng.abort(999) is None
    eng.run_to_completion()
    assert victim.finish_reason == "abort" and len(victim.output_ids) == got
    assert queued.finish_reason == "abort" and queued.output_ids == []
    assert eng.ws.kv.allocator.num_free == 9 and not eng.has_work
    assert {r.request_id for r in eng.finished} == {r.request_id for r in reqs} - {0, 3}
    for r in eng.finished:
        assert r.output_ids == reference(model, r.prompt_ids, 12)
