"""The server's text codec under hostile input (issue 36): a long prompt is bounded before it
is tokenized whole, and a stream's text is decoded incrementally (the cost of n tokens is O(n),
the pieces add up to the whole text, a character split across tokens is held back)."""

from __future__ import annotations

import pytest
from serve_helpers import tiny_folder

from nanosched.models.checkpoint import load_tokenizer
from nanosched.runtime.server.text import (
    PROBE_CHARS_PER_TOKEN,
    Detokenizer,
    PromptTooLong,
    TextCodec,
)


class Counting:
    """A tokenizer that records the length of every text it tokenizes and every id list it
    decodes."""

    def __init__(self, inner) -> None:
        self.inner, self.encoded, self.decoded = inner, [], []

    def __call__(self, text, **kw):
        self.encoded.append(len(text))
        return self.inner(text, **kw)

    def decode(self, ids, **kw):
        self.decoded.append(len(ids))
        return self.inner.decode(ids, **kw)


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    return load_tokenizer(tiny_folder(tmp_path_factory.mktemp("text")))


@pytest.fixture(scope="module")
def bytes_bpe():
    """A byte-level BPE whose merges stop inside multi-byte characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["the cat sat on the mat", "a dog ran"] * 20,
                            trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel
                                                .alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw)


def test_growing_prefixes_refuse_a_long_text_before_it_is_tokenized_whole(words):
    tok = Counting(words)
    codec = TextCodec(tok)
    text = "w1 " * 20_000
    with pytest.raises(PromptTooLong, match="at least 1051 tokens .in its first 3200 of 60000 "
                                            "characters"):
        codec.encode(text, limit=400)
    assert tok.encoded == [400 * PROBE_CHARS_PER_TOKEN]  # one prefix, never the whole


def test_a_text_of_few_tokens_passes_however_long(words):
    tok = Counting(words)
    codec = TextCodec(tok)
    spaced = "w5" + " " * 50_000 + "w6"  # two tokens in 50,004 characters
    assert codec.encode(spaced, limit=3) == [5, 6]
    assert tok.encoded[:-1] == [24, 24 * 8, 24 * 64, 24 * 512]  # the prefixes, then whole
    text = "w5  " * 90 + "w7"  # 91 tokens in 362 characters: short, tokenized whole at once
    assert codec.encode(text, limit=100) == codec.encode(text) == [5] * 90 + [7]


@pytest.mark.parametrize("which", ["words", "bytes_bpe"])
def test_a_stream_decodes_each_token_once_and_adds_up_to_the_whole(which, request):
    inner = request.getfixturevalue(which)
    tok = Counting(inner)
    codec = TextCodec(tok)
    text = " ".join(f"w{i % 100}" for i in range(2000)) if which == "words" else \
        "the cat sat on the mät, 日本の猫 ran 🐈 " * 40
    ids = inner(text, add_special_tokens=False)["input_ids"]
    detok = Detokenizer(codec)
    pieces = [detok.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == codec.decode(ids)
    assert sum(tok.decoded) - len(ids) <= 8 * len(ids)  # the whole-output decode, then O(n)
    assert max(tok.decoded[:-1]) <= 8
    if which == "bytes_bpe":
        assert all("\ufffd" not in p for p in pieces)  # split characters were held back


def test_without_a_tokenizer_a_token_is_its_id():
    detok = Detokenizer(TextCodec(None))
    assert detok.push([5, 9]) + detok.push([2], final=True) == " 5 9 2"
