import json

import pytest
import torch

from nanosched.errors import ConfigError
from nanosched.runtime.requests import make_requests, poisson_arrivals
from nanosched.runtime.sampling import sample


def test_datasets_follow_table4_statistics():
    reqs = make_requests("sharegpt", None, None, 4000, vocab_size=1000, max_len=100_000, seed=3)
    ins = torch.tensor([r.prompt_len for r in reqs], dtype=torch.float64)
    outs = torch.tensor([r.params.max_tokens for r in reqs], dtype=torch.float64)
    assert ins.mean().item() == pytest.approx(246, rel=0.08)
    assert outs.mean().item() == pytest.approx(322, rel=0.05)
    assert outs.std().item() == pytest.approx(244, rel=0.15)
    again = make_requests("sharegpt", None, None, 4000, vocab_size=1000, max_len=100_000, seed=3)
    assert [r.prompt_ids for r in again[:5]] == [r.prompt_ids for r in reqs[:5]]


def test_fixed_lengths_and_poisson():
    reqs = make_requests(None, 16, 4, 100, vocab_size=50, max_len=64)
    assert {(r.prompt_len, r.params.max_tokens) for r in reqs} == {(16, 4)}
    poisson_arrivals(reqs, rate=10.0, seed=0)
    gaps = torch.diff(torch.tensor([r.arrival_s for r in reqs]))
    assert (gaps > 0).all() and gaps.mean().item() == pytest.approx(0.1, rel=0.3)


@pytest.mark.parametrize("lines, message", [
    (['{"prompt_len": 4, "output_len": 2}', ""], r":2: empty line"),
    (["{oops"], r":1: not valid JSON"),
    (['{"prompt_len": 0, "output_len": 2}'], r":1: prompt_len must be a positive integer"),
    (['{"prompt_len": 4, "output_len": -1}'], r":1: output_len must be a positive integer"),
    (['{"prompt_ids": [1, 99], "output_len": 1}'], r":1: prompt_ids\[1\] is 99; .* 0..49"),
    (['{"prompt_len": 60, "output_len": 10}'], r":1: prompt \(60\) \+ output_len \(10\) exceeds"),
])
def test_jsonl_errors_name_the_line(tmp_path, lines, message):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message):
        make_requests(str(path), None, None, 10, vocab_size=50, max_len=64)


def test_jsonl_ok(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 2, 3], "output_len": 2}) + "\n" +
                    json.dumps({"prompt_len": 5, "output_len": 1}) + "\n")
    a, b = make_requests(str(path), None, None, 10, vocab_size=50, max_len=64)
    assert a.prompt_ids == [1, 2, 3] and b.prompt_len == 5 and b.params.max_tokens == 1


@pytest.mark.parametrize("args, message", [
    (("alpaca", None, None), "no such file"),
    ((None, 0, 5), "--input-len must be a positive"),
    ((None, 60, 10), "exceeds the model's context of 64"),
    (("sharegpt", 5, 5), "not both"),
])
def test_bad_bench_inputs(args, message):
    with pytest.raises(ConfigError, match=message):
        make_requests(*args, 10, vocab_size=50, max_len=64)


def test_sampling_greedy_temperature_top_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 1.9]])
    zero, one = torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])
    assert sample(logits, zero, one).tolist() == [1, 0]
    # top_p small keeps only the top token even at high temperature
    assert sample(logits, torch.tensor([5.0, 5.0]), torch.tensor([0.01, 0.01]), g).tolist() \
        == [1, 0]
    draws = torch.stack([sample(logits, one, one, g) for _ in range(2000)])
    freq = (draws[:, 1] == 2).float().mean().item()  # p(2 | row 1) = e^1.9/(e^2+1+e^1.9)
    expected = torch.softmax(logits[1], 0)[2].item()
    assert freq == pytest.approx(expected, abs=0.04)


def test_sampling_told_on_the_host_whether_any_row_is_random_draws_the_same():
    """The engine says `any_random` from the requests' parameters (reading it from the device
    tensor would wait for the GPU); the tokens are those sample() finds by itself."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    top_p = torch.full((6,), 0.9)
    for temps in ([0.0] * 6, [0.0, 0.7, 0.0, 1.0, 0.0, 0.3]):
        temp = torch.tensor(temps)
        own = sample(logits, temp, top_p, torch.Generator().manual_seed(2))
        told = sample(logits, temp, top_p, torch.Generator().manual_seed(2),
                      any_random=any(t > 0 for t in temps))
        assert torch.equal(own, told)
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, torch.zeros(6), top_p, any_random=False), greedy)


def test_sampling_in_chunks_draws_what_one_call_draws(monkeypatch):
    """A batch taller than CHUNK_ROWS is drawn chunk by chunk (the sampler's temporaries stay
    bounded): the same tokens as one call, a failed row still -1, greedy rows their argmax."""
    from nanosched.runtime import sampling

    logits = torch.randn(10, 50, generator=torch.Generator().manual_seed(1))
    logits[3, 7] = float("nan")
    temp = torch.tensor([0.0, 0.7, 0.0, 1.0, 0.0, 0.3, 1.0, 1.2, 0.0, 0.5])
    top_p = torch.full((10,), 0.9)
    whole = sample(logits, temp, top_p, torch.Generator().manual_seed(2))
    monkeypatch.setattr(sampling, "CHUNK_ROWS", 4)
    chunked = sample(logits, temp, top_p, torch.Generator().manual_seed(2))
    assert torch.equal(whole, chunked) and chunked[3] == -1
    greedy = temp == 0
    assert torch.equal(chunked[greedy], logits.argmax(-1)[greedy])
    assert sampling.transient_bytes(10, 50) == 4 * 50 * sampling.TRANSIENT_BYTES_PER_LOGIT
