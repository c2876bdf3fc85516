"""How the shipped `stories15m` tokenizer was made; run again to make it again:
`python -m nanosched.models.tokenizers.make_stories15m` (writes stories15m.tokenizer.json.gz
beside this file).

A byte-level BPE (every byte is a token, so any text encodes and every id decodes) of exactly
the model's 32,000 ids, trained by HF `tokenizers` on the Python standard library's source text
(the `*.py` files of the running interpreter's lib folder, tests left out; the shipped file was
made from CPython 3.11's): English prose in docstrings and comments, and code. The special
tokens come first, as llama2.c's: <unk> 0, <s> 1 (prepended to every encoded text), </s> 2,
then the chat markers. Gzipped (about 370 KB) since the JSON is about 1 MB.
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

VOCAB_SIZE = 32_000  # the stories15m spec's vocab_size
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
OUT = Path(__file__).with_name("stories15m.tokenizer.json.gz")
SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3"}


def corpus() -> list[str]:
    """The standard library's source files, in a fixed order."""
    v = sys.version_info
    lib = Path(sys.base_prefix) / "lib" / f"python{v.major}.{v.minor}"
    files = [p for p in sorted(lib.glob("*.py")) + sorted(lib.glob("*/*.py"))
             if not SKIP & set(p.parts)]
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    return text.split("\n\n")


def make() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"the corpus gave {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok.to_str()


if __name__ == "__main__":
    OUT.write_bytes(gzip.compress(make().encode("utf-8"), 9, mtime=0))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
