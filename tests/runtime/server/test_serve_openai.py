"""The OpenAI surface added for issue 18 with the real server over loopback: `n` choices, a list
of prompts, response ids unique across servers, and a KV cache smaller than the model's
context (max_model_len is what fits; a chat request without max_tokens gets it)."""

from __future__ import annotations

import re

from serve_helpers import ThreadServer, server_fixtures

folder, srv, http = server_fixtures("openai", timeout=60)


def ask(http, srv, path="/v1/completions", **body):
    return http.post(f"{srv.url}{path}", json={"model": srv.model, **body})


def test_n_gives_n_choices_indexed_in_order(srv, http):
    r = ask(http, srv, prompt=[1, 2, 3], max_tokens=3, n=3, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    one = ask(http, srv, prompt=[1, 2, 3], max_tokens=3, temperature=0).json()
    greedy = one["choices"][0]["token_ids"]
    assert all(c["token_ids"] == greedy for c in body["choices"])  # greedy: all alike
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}


def test_a_list_of_prompts_gives_one_choice_per_prompt(srv, http):
    prompts = [[5, 6], [7], [8, 9, 10]]
    r = ask(http, srv, prompt=prompts, max_tokens=2, temperature=0)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for p, c in zip(prompts, choices, strict=True):
        alone = ask(http, srv, prompt=p, max_tokens=2, temperature=0).json()["choices"][0]
        assert c["token_ids"] == alone["token_ids"] and c["text"] == alone["text"]
    assert r.json()["usage"]["prompt_tokens"] == 6


def test_text_prompts_and_n_together(srv, http):
    r = ask(http, srv, prompt=["w1 w2", "w3"], max_tokens=1, n=2, temperature=0)
    assert r.status_code == 200, r.text
    ids = [c["token_ids"] for c in r.json()["choices"]]
    assert len(ids) == 4 and ids[0] == ids[1] and ids[2] == ids[3]


def test_chat_n(srv, http):
    r = ask(http, srv, "/v1/chat/completions", messages=[{"role": "user", "content": "w1"}],
            max_tokens=2, n=2)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_response_ids_are_unique_uuids_across_servers(folder, srv, http):
    ids = {ask(http, srv, prompt=[1], max_tokens=1).json()["id"] for _ in range(3)}
    other = ThreadServer(model=str(folder), dense_batch=64)
    try:
        ids.add(ask(http, other, prompt=[1], max_tokens=1).json()["id"])
    finally:
        other.close()
    assert len(ids) == 4
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids), ids


def test_a_kv_cache_smaller_than_the_context_sets_max_model_len(folder, http):
    """num_pages 9 of 16 tokens: a request needs ceil(tokens / 16) + 1 pages, so 128 tokens
    fit of the model's 512."""
    small = ThreadServer(model=str(folder), dense_batch=64, num_pages=9)
    try:
        models = http.get(f"{small.url}/v1/models").json()["data"][0]
        assert models["max_model_len"] == 128
        r = ask(http, small, "/v1/chat/completions", ignore_eos=True,
                messages=[{"role": "user", "content": "w1 w2"}])
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] == 128
        r = ask(http, small, prompt=[1] * 100, max_tokens=29)
        assert r.status_code == 400 and "128" in r.json()["error"]["message"]
    finally:
        small.close()
