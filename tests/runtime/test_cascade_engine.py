"""`--decode-attention cascade` in the engine, on a tiny random Llama on the CPU: greedy tokens
equal the default's over shared-prefix workloads (eager, graph-bucket layout, FP8 cache, the
asynchronous loop), the decode attention gets prefix groups, and the scheduler puts the decode
rows of a shared first page side by side (each request still reads back its own tokens)."""

import pytest
import torch
from runtime_helpers import make_engine, tiny_engine_model

from nanosched.kernels import dispatch
from nanosched.kernels.dispatch import KernelOptions
from nanosched.runtime.request_scheduler import RequestScheduler
from nanosched.runtime.requests import Request, SamplingParams, make_requests


def shared_requests():
    """Interleaved groups (request i in group i % 3) of a 21-token prefix and own tokens."""
    prefixes = [[(11 * g + 5 * j) % 97 for j in range(21)] for g in range(3)]
    return [Request(i, prefixes[i % 3] + [(i * 7 + j) % 97 for j in range(3 + i % 4)],
                    SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(12)]


def trace():
    return make_requests("shared-prefix:groups=2,prefix=18,unique=3,output=5", None, None, 8,
                         vocab_size=97, max_len=120, seed=3)


def serve(reqs, cascade, monkeypatch, **kw):
    """Output ids of `reqs` and the prefix groups every decode attention got."""
    model = tiny_engine_model()
    if cascade:
        model.kernels = KernelOptions(decode_impl="cascade")
    seen = []
    real = dispatch.decode_attention

    def spy(*args, groups=None, **kwargs):
        seen.append(groups)
        return real(*args, groups=groups, **kwargs)

    monkeypatch.setattr(dispatch, "decode_attention", spy)
    pages = kw.pop("pages", 64)
    eng = make_engine(model, dense_batch=24, num_pages=pages, page_size=4,
                      prefix_caching=True, **kw)
    for r in reqs:
        eng.add_request(r)
    with torch.inference_mode():
        eng.run_to_completion()
    monkeypatch.setattr(dispatch, "decode_attention", real)
    assert eng.ws.kv.allocator.num_free == pages and not any(eng.ws.kv.allocator.refs)
    return [r.output_ids for r in reqs], seen


CASES = {
    "eager": dict(),
    "graph layout": dict(graphs="layout", graph_align=4),
    "fp8 KV, evictions": dict(pages=24, kv_dtype="fp8"),
    "fp8 KV, graph layout": dict(kv_dtype="fp8", graphs="layout", graph_align=4),
    "async loop, graph layout": dict(async_loop=True, graphs="layout", graph_align=4),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("make", [shared_requests, trace], ids=["interleaved", "trace"])
def test_greedy_tokens_with_cascade_equal_the_default(case, make, monkeypatch):
    want, plain = serve(make(), False, monkeypatch, **CASES[case])
    got, seen = serve(make(), True, monkeypatch, **CASES[case])
    assert got == want
    assert all(g is None for g in plain)
    shared = [g for g in seen if g is not None and g.prefix_lens.max() > 0]
    assert shared, "no decode attention got a group with a shared prefix"
    for g in shared:
        starts = g.starts.tolist()
        assert starts == sorted(starts) and g.max_prefix_len >= g.prefix_lens.max()


def test_scheduler_puts_decodes_of_a_shared_first_page_side_by_side():
    model = tiny_engine_model()
    model.kernels = KernelOptions(decode_impl="cascade")
    eng = make_engine(model, dense_batch=24, num_pages=64, page_size=4, prefix_caching=True)
    assert isinstance(eng.scheduler, RequestScheduler) and eng.scheduler.group_decodes
    form, orders = eng.scheduler.form, []

    def spy(*args):
        batch = form(*args)
        orders.append([eng.ws.kv.tables[e.request.request_id][0] for e in batch.entries
                       if e.is_decode])
        return batch

    eng.scheduler.form = spy
    for r in shared_requests():
        eng.add_request(r)
    with torch.inference_mode():
        eng.run_to_completion()
    assert max(len(o) - len(set(o)) for o in orders) > 3  # batches with shared first pages
    for firsts in orders:
        runs = [p for i, p in enumerate(firsts) if i == 0 or firsts[i - 1] != p]
        assert len(runs) == len(set(runs)), f"first pages {firsts} are not side by side"
