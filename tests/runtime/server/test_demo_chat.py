"""The CPU demo model answers the `openai` client on a fresh install (issue 36): `stories15m`
ships a tokenizer and chat template, so chat and text prompts work, streamed and not, and the
README's chat request is answered as written there."""

from __future__ import annotations

import json
import re

import pytest
from repo import ROOT
from serve_helpers import ThreadServer

from nanosched.models.tokenizers import SHIPPED_TOKENIZERS, shipped_tokenizer

README = ROOT / "README.md"


@pytest.fixture(scope="module")
def srv():
    s = ThreadServer(model="stories15m", dense_batch=64, stats_interval_s=0)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(srv):
    openai = pytest.importorskip("openai")  # here, not at collection: a second of CPU
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_the_shipped_tokenizer_covers_every_id_and_is_small():
    tok = shipped_tokenizer("stories15m")
    assert len(tok) == 32_000  # the model's vocab_size: every sampled id has a text
    assert (ROOT / "nanosched/models/tokenizers" /
            SHIPPED_TOKENIZERS["stories15m"]).stat().st_size < 400_000
    ids = tok("Once upon a time, a cat 🐈 sat.")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == \
        "Once upon a time, a cat 🐈 sat."


def test_chat_whole_and_streamed_agree(client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me a story about a cat."}]
    whole = client.chat.completions.create(model="stories15m", messages=messages,
                                           max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "length" and text
    assert whole.usage.completion_tokens == 12
    stream = client.chat.completions.create(model="stories15m", messages=messages,
                                            max_tokens=12, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and
              c.choices[0].delta.content is not None]
    assert "".join(pieces) == text and len(pieces) > 1


def test_text_completions_and_models(client):
    r = client.completions.create(model="stories15m", prompt="Once upon a time",
                                  max_tokens=6, temperature=0)
    assert r.choices[0].text and r.usage.prompt_tokens == 5  # <s> + four tokens
    assert [m.id for m in client.models.list().data] == ["stories15m"]


def test_the_readme_chat_request_is_answered(srv):
    import httpx

    readme = README.read_text()
    body = re.search(r"curl -s localhost:8000(/v1/chat/completions) .*?\\\n\s*-d '(.*?)'",
                     readme, re.S)
    assert body, "the README's chat example"
    r = httpx.post(f"{srv.url}{body[1]}", json=json.loads(body[2]), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
