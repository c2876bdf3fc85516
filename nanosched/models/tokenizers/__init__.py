"""Tokenizers shipped with registered models that have no checkpoint folder (package data).

`stories15m` (llama2.c's 15M TinyStories Llama, run on random weights) ships a byte-level BPE
of its 32,000 ids made by the project (make_stories15m.py says how) and a chat template, so
that `serve --model stories15m` answers text and chat requests and `generate --prompt` works
on a fresh install. The template writes each message as `<|role|>` (a special token for
system, user and assistant), a newline, the content and `<|end|>`, then `<|assistant|>` and a
newline where the reply begins; the text starts with `<s>`.
"""

from __future__ import annotations

import gzip
from functools import cache
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
SHIPPED_TOKENIZERS = {"stories15m": "stories15m.tokenizer.json.gz"}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def has_shipped_tokenizer(model: str) -> bool:
    return model in SHIPPED_TOKENIZERS


@cache
def shipped_tokenizer(model: str) -> Any:
    """The transformers tokenizer shipped for the registered `model` (KeyError if none)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = gzip.decompress((HERE / SHIPPED_TOKENIZERS[model]).read_bytes()).decode("utf-8")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(raw), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE)
