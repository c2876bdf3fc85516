"""Text in and out of the server: tokenizer, chat template, and streamed detokenization.

With a tokenizer (the checkpoint folder has one) prompts may be text, chat messages go through
the tokenizer's `apply_chat_template` when it has a template, and outputs are decoded text.
Chat without a template uses the plain fallback: each message as "role: content\\n", joined,
then "assistant: ". Without a tokenizer only token-id prompts work, and the text of a token is
" <id>" (so streamed pieces concatenate to the non-streamed text: " 5 9 2").
"""

from __future__ import annotations

from typing import Any

from nanosched.models.checkpoint import load_tokenizer, model_folder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The fallback chat template: "role: content\\n" per message, then "assistant: "."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class TextCodec:
    """Encodes prompts and decodes outputs for one served model."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def for_model(cls, model: str) -> TextCodec:
        """The checkpoint folder's tokenizer, or none (token-id prompts only)."""
        folder = model_folder(model)
        if folder is None or not any((folder / f).is_file() for f in TOKENIZER_FILES):
            return cls(None)
        return cls(load_tokenizer(folder))

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation, ending where the assistant's reply begins."""
        if self.has_chat_template:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self.encode(plain_chat_prompt(messages))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return "".join(f" {t}" for t in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Streamed text: each `push` returns the new text since the last one. A piece that ends
    in an incomplete character (U+FFFD) is held back until the next tokens complete it."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.text = ""

    def push(self, tokens: list[int], final: bool = False) -> str:
        self.ids += tokens
        text = self.codec.decode(self.ids)
        if (text.endswith("\ufffd") and not final) or not text.startswith(self.text):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


class StopText:
    """Cuts streamed text before the first stop string. `push(delta)` returns the text that
    is safe to emit: a tail that could still begin a stop string is held back until the next
    delta settles it, so a stop split across tokens is never half-sent. `done` once a stop
    string was found; `flush()` gives the held-back tail when the output ends otherwise."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""
        self.done = False

    def push(self, delta: str) -> str:
        if self.done or not self.stops:
            return "" if self.done else delta
        text = self.held + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.done, self.held = True, ""
            return text[:min(hits)]
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
