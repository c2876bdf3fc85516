"""Text in and out of the server: tokenizer, chat template, and streamed detokenization.

With a tokenizer (the checkpoint folder has one) prompts may be text, chat messages go through
the tokenizer's `apply_chat_template` when it has a template, and outputs are decoded text.
Chat without a template uses the plain fallback: each message as "role: content\\n", joined,
then "assistant: ". Without a tokenizer only token-id prompts work, and the text of a token is
" <id>" (so streamed pieces concatenate to the non-streamed text: " 5 9 2").

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

from typing import Any

from nanosched.models.checkpoint import model_tokenizer

PROBE_CHARS_PER_TOKEN = 8  # the first prefix tokenized: this many characters per allowed token
PROBE_GROWTH = 8  # each next prefix is this much longer
PROBE_SLACK = 16  # tokens a prefix may hold beyond the whole text's (its cut end re-tokenized)
# (a prefix cut inside a word may tokenize that word into more pieces than the whole text does)


class PromptTooLong(ValueError):
    """A text holds more tokens than allowed; `at_least` of them, found without tokenizing
    it whole."""

    def __init__(self, at_least: int, how: str) -> None:
        super().__init__(f"at least {at_least} tokens ({how})")
        self.at_least, self.how = at_least, how


class TemplateRefused(ValueError):
    """The chat template refused the conversation (its `raise_exception`, or another template
    error), with the template's message."""


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The fallback chat template: "role: content\\n" per message, then "assistant: "."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class TextCodec:
    """Encodes prompts and decodes outputs for one served model."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def for_model(cls, model: str) -> TextCodec:
        """The checkpoint folder's tokenizer, or the one shipped for a registered model, or
        none (token-id prompts only)."""
        return cls(model_tokenizer(model))

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, limit: int | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`; with `limit`, PromptTooLong when it holds more than `limit`
        tokens, found before the whole text is tokenized (see the module docstring)."""
        if limit is not None:
            self._bound(text, limit, special)
        return self._ids(text, special)

    def _ids(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _bound(self, text: str, limit: int, special: bool) -> None:
        size = limit * PROBE_CHARS_PER_TOKEN
        while size < len(text):
            found = len(self._ids(text[:size], special)) - PROBE_SLACK
            if found > limit:
                raise PromptTooLong(found, f"in its first {size} of {len(text)} characters")
            size *= PROBE_GROWTH

    def chat_prompt(self, messages: list[dict[str, str]], limit: int | None = None) -> list[int]:
        """Token ids of a conversation, ending where the assistant's reply begins; with
        `limit`, bounded as `encode` bounds a text."""
        if self.has_chat_template:
            text = self._render(messages)
            return self.encode(text, limit, special=False)
        return self.encode(plain_chat_prompt(messages), limit)

    def _render(self, messages: list[dict[str, str]]) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True)
        except TemplateError as exc:
            raise TemplateRefused(str(exc) or type(exc).__name__) from None

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return "".join(f" {t}" for t in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Streamed text: each `push` returns the new text since the last one, decoding only the
    tokens not yet emitted behind those of the previous push (the window that tokenizers such
    as SentencePiece need to place a leading space), so a stream of n tokens costs O(n), not
    O(n^2). A piece that ends in an incomplete character (U+FFFD) is held back until the next
    tokens complete it, or the output ends."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: the window, already emitted
        self.read = 0  # ids[read:]: not yet emitted

    def push(self, tokens: list[int], final: bool = False) -> str:
        if not self.codec.has_tokenizer:
            return self.codec.decode(tokens)
        self.ids += tokens
        before = self.codec.decode(self.ids[self.prefix:self.read])
        text = self.codec.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


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

