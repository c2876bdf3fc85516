"""CUDA-graph buckets on the CPU: the padded layout computes what the unpadded batch computes,
padded rows never touch a request's pages, and static metadata is rewritten in place."""


import pytest
import torch
from repo import DATA
from runtime_helpers import ShuffledDevice, tiny_llama

from nanosched.errors import ConfigError
from nanosched.models.batch import BatchMeta, SeqChunk
from nanosched.models.bucket import Bucket, BucketMeta
from nanosched.runtime.backend import Backend
from nanosched.runtime.device import SerialDevice
from nanosched.runtime.graphs import BucketRunner
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.opsched import run_program
from nanosched.runtime.request_scheduler import RequestScheduler
from nanosched.runtime.requests import Request, SamplingParams
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap
from nanosched.runtime.strategies.replay import Replay
from nanosched.schedules.format import load_schedule

PAGE = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny"))


def chunk(first_pos, n, is_decode, pages):
    return SeqChunk(tuple(pages), first_pos, n, is_decode)


def test_bucket_rounds_decode_rows_and_rows_and_refuses_what_does_not_fit():
    seqs = [chunk(40, 1, True, [0, 1, 2])] * 37 + [chunk(0, 100, False, range(7)),
                                                   chunk(30, 20, False, range(10, 14))]
    b = Bucket.for_chunks(seqs, page_size=PAGE, align=16, max_tokens=256, max_pages=8)
    assert b == Bucket(num_decode=48, num_tokens=176, num_segments=4, max_pages=8)
    assert Bucket.for_chunks(seqs[:37], page_size=PAGE, align=16, max_tokens=256,
                             max_pages=8) == Bucket(48, 48, 0, 8)
    # 48 decode rows + 120 prompt rows > 160 rows; a request past 8 pages of 16 tokens
    assert Bucket.for_chunks(seqs, page_size=PAGE, align=16, max_tokens=160, max_pages=8) is None
    long = seqs + [chunk(120, 9, False, range(20, 29))]
    assert Bucket.for_chunks(long, page_size=PAGE, align=16, max_tokens=256, max_pages=8) is None
    many = seqs[:2] + [chunk(0, 1, False, [50 + i]) for i in range(5)]
    assert Bucket.for_chunks(many, page_size=PAGE, align=16, max_tokens=256,
                             max_pages=8).num_segments == 8


def test_request_scheduler_leaves_the_padded_decode_rows_free():
    b = RequestScheduler(dense_batch=64, kv_capacity_pages=400, page_size=PAGE, max_context=512,
                decode_align=16)
    for i in range(5):
        r = Request(i, list(range(3, 23)), SamplingParams(max_tokens=4))
        r.num_prefilled, r.output_ids = 20, [7]
        b.running.append(r)
    b.add(Request(9, list(range(100)), SamplingParams(max_tokens=4)))
    batch = b.form()
    assert batch.num_decode == 5 and batch.num_prefill == 64 - 16  # 5 decode rows take 16


def plan(model, ws, n_decode, prompts, gen):
    """Decode requests with 20..40 cached tokens, then prompt chunks (the second continues)."""
    for r in range(n_decode):
        ws.kv.plan([(r, 20 + r % 21, False)])
    ws.kv.plan([(901, 24, False)])  # the continuing prompt's first chunk
    ws.kv.k.normal_(generator=gen)
    ws.kv.v.normal_(generator=gen)
    return ws.kv.plan_chunks([(r, 1, True) for r in range(n_decode)] +
                             [(900, prompts[0], False), (901, prompts[1], False)])


def run_both(model, strategy, device_seed, n_decode, prompts, align, max_tokens):
    """The batch unpadded through Sequential, then laid out in its bucket through `strategy` on
    a serial (device_seed None) or reordering device: (logits, K, V, scratch page, bucket)."""
    results = []
    for padded in (False, True):
        gen = torch.Generator().manual_seed(0)
        ws = model.new_workspace(max_tokens=max_tokens, num_pages=300)
        seqs = plan(model, ws, n_decode, prompts, gen)
        n = sum(c.num_tokens for c in seqs)
        ids = torch.randint(0, 100, (n,), generator=gen)
        if not padded:
            ws.token_ids[:n].copy_(ids)
            meta = BatchMeta.build(seqs, PAGE)
            segments = [(i, i + 1, True) for i in range(n_decode)]
            segments += [(n_decode, n_decode + prompts[0], False), (n_decode + prompts[0], n,
                                                                    False)]
            run_program(model_program(model, ws, meta, segments), Sequential(),
                        Backend(SerialDevice()))
            rows, bucket = torch.arange(n), None
        else:
            device = SerialDevice() if device_seed is None else ShuffledDevice(device_seed)
            runner = BucketRunner(model, ws, Backend(device), strategy, align=align,
                                  max_pages=16, capture=False)
            bucket = runner.bucket(seqs)
            d = bucket.num_decode
            rows = torch.cat([torch.arange(n_decode), torch.arange(d, d + n - n_decode)])
            ws.token_ids[:bucket.num_tokens].fill_(0)
            ws.token_ids[rows] = ids
            entry = runner.entry(bucket)
            assert entry.strategy is strategy
            runner.run(entry, seqs)
        results.append((model.logits(ws, rows), ws.kv.k.clone(), ws.kv.v.clone(),
                        ws.kv.scratch_slot // PAGE, bucket))
    return results


@pytest.mark.parametrize("strategy,n_decode,prompts", [
    ("sequential", 37, (50, 30)), ("two_batch", 20, (70, 21)), ("sequential", 0, (60, 10)),
    ("replay", 37, (100, 108)), ("replay", 70, (80, 96))])
def test_padded_bucket_computes_the_unpadded_batch_and_spares_real_pages(model, strategy,
                                                                          n_decode, prompts):
    schedule = load_schedule(DATA / "tiny_llama_schedule.json")
    make = {"sequential": Sequential, "two_batch": TwoBatchOverlap,
            "replay": lambda: Replay(schedule, model.spec.num_layers)}[strategy]
    for seed in (None, 0, 1):  # serial, then two reorderings (a missing event shows)
        (want, k0, v0, scratch, _), (got, k1, v1, _, bucket) = run_both(
            model, make(), seed, n_decode, prompts, align=16, max_tokens=256)
        assert bucket.num_tokens == (256 if strategy == "replay" else
                                     bucket.num_decode + sum(prompts) + 15) // 16 * 16
        assert bucket.num_decode % 16 == 0 and bucket.num_decode >= n_decode
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        real = torch.ones(k0.shape[1], dtype=torch.bool)
        real[scratch] = False
        torch.testing.assert_close(k1[:, real], k0[:, real], rtol=0, atol=0)
        torch.testing.assert_close(v1[:, real], v0[:, real], rtol=0, atol=0)
        assert not torch.equal(k1[:, scratch], k0[:, scratch])  # padding wrote only there


def write_batch(meta, seqs):
    meta.write(seqs)
    got = {}
    for lo, hi in [(0, 64), (8, 40), (20, 64), (0, 16)]:
        part = meta.slice(lo, hi)
        tables, lens = part.decode_tables()
        got[(lo, hi)] = [part.positions.tolist(), part.slot_mapping.tolist(), tables.tolist(),
                         lens.tolist()]
        if part.num_prefill:
            got[(lo, hi)] += [part.prefill_block_tables().tolist(),
                              part.prefill_tensors().table.tolist()]
    return got


def test_frozen_metadata_is_rewritten_in_place_and_refuses_new_slices():
    b = Bucket(num_decode=16, num_tokens=64, num_segments=4, max_pages=6)
    first = [chunk(p, 1, True, range(10 * i, 10 * i + 6)) for i, p in enumerate((5, 70, 33))]
    first += [chunk(0, 30, False, [60, 61]), chunk(17, 10, False, [62, 63])]
    second = [chunk(90, 1, True, range(20, 26))]
    second += [chunk(40, 20, False, [1, 2, 3, 4]), chunk(0, 9, False, [7]),
               chunk(3, 8, False, [8])]
    frozen = BucketMeta(b, PAGE, scratch_slot=999 * PAGE, device="cpu")
    before = write_batch(frozen, first)
    frozen.freeze()
    assert write_batch(frozen, first) == before
    assert write_batch(frozen, second) == write_batch(
        BucketMeta(b, PAGE, scratch_slot=999 * PAGE, device="cpu"), second)
    p = frozen.slice(20, 64)
    assert p.num_decode == 0 and p.prefill_tensors().table.tolist() == [
        [0, 16, 25, 0], [16, 9, 8, 0], [44, 0, 3, 0]]  # rows 16.. hold 20, 9 and 8 tokens
    assert frozen.slice(0, 16).decode_tables()[1].tolist() == [91] + [0] * 15
    assert frozen.slice(0, 64).slot_mapping[1:16].tolist() == [999 * PAGE] * 15  # padding
    with pytest.raises(ConfigError, match=r"token range \[4, 9\) was not used before"):
        frozen.slice(4, 9)
    with pytest.raises(ConfigError, match="2 decode tokens .* do not fit"):
        BucketMeta(Bucket(1, 8, 1, 6), PAGE, 0, "cpu").write(first[:2])


def test_attention_ops_declare_only_their_own_kind_of_rows(model):
    """A range's attention of the other kind is a no-op and must touch nothing: else prefill
    attention waits behind the decode stream's no-op filler (bench/engine/nanoop_timeline.py)."""
    ws = model.new_workspace(max_tokens=12, num_pages=8)
    meta = ws.kv.plan([(0, 1, True), (1, 1, True), (2, 1, True), (3, 1, True), (9, 6, False),
                       (10, 2, False)])
    segments = [(i, i + 1, True) for i in range(4)] + [(4, 10, False), (10, 12, False)]
    program = model_program(model, ws, meta, segments)
    dec = program.ops[program.index("attn_decode", 0)]
    pre = program.ops[program.index("attn_prefill", 0)]

    def rows(accesses, s, e):
        return {a.buffer: a.rows(s, e) for a in accesses}

    assert rows(dec.writes, 2, 9) == {"attn": (2, 4)}
    assert rows(pre.writes, 2, 9) == {"attn": (4, 9)}
    assert rows(dec.reads, 2, 9) == {"q": (2, 4), "kv0": (2, 4)}
    assert rows(pre.reads, 6, 12) == {"q": (6, 12), "kv0": (4, 12)}  # back to the chunk's start
    assert rows(dec.writes, 4, 12) == {"attn": (4, 4)}  # nothing: no decode rows there
    assert rows(pre.reads, 0, 4) == {"q": (4, 4), "kv0": (4, 4)}


def test_graphs_mode_is_on_with_a_gpu_by_default_and_refused_on_the_cpu():
    from nanosched.runtime.loader import resolve_graphs

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_graphs("auto", cpu, ("on", "off")) == "off"
    assert resolve_graphs("auto", gpu, ("on", "off")) == "on"
    assert resolve_graphs("both", gpu, ("off", "on", "both")) == "both"
    with pytest.raises(ConfigError, match="--graphs on needs a CUDA GPU"):
        resolve_graphs("on", cpu, ("on", "off"))
    with pytest.raises(ConfigError, match="must be one of auto, on, off; got 'both'"):
        resolve_graphs("both", gpu, ("on", "off"))
