"""OpenAI request bodies → validated jobs, and OpenAI-style errors.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanosched.errors import ConfigError
from nanosched.runtime.requests import SamplingParams
from nanosched.runtime.server.text import PromptTooLong, TemplateRefused, TextCodec

# field -> the values accepted (anything else is refused as unsupported)
UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False),
               "logprobs": (None, False), "top_logprobs": (None, 0),
               "seed": (None,), "suffix": (None, ""),
               "response_format": (None, {"type": "text"}), "tools": (None, []),
               "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "logit_bias": (None, {}),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "repetition_penalty": (None, 1), "min_tokens": (None, 0),
               "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,)}
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # choices per request (prompts x n): each is an engine request
WHY_UNSUPPORTED = {"seed": "the engine samples each batch with one generator, so a request's "
                           "draws would depend on the requests beside it; a per-request seed "
                           "cannot be honoured"}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the field at fault and a code."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = \
            status, message, param, code, kind
        self.headers = headers or {}  # e.g. Retry-After on 429, WWW-Authenticate on 401

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class Job:
    """A validated request: prompt ids, sampling settings, and how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    is_chat: bool
    stop: tuple[str, ...] = ()  # the text ends before the first of these
    include_usage: bool = False  # a stream ends with a chunk carrying `usage`
    prompts: tuple[list[int], ...] = ()  # every prompt of the request (prompt_ids is the first)
    n: int = 1  # choices per prompt

    @property
    def num_choices(self) -> int:
        return max(1, len(self.prompts)) * self.n


@dataclass(frozen=True)
class Limits:
    """What the served model accepts."""

    name: str
    vocab_size: int
    context: int
    aliases: tuple[str, ...] = ()  # other names a request may give the model (`accepts`)

    def accepts(self, model: str) -> bool:
        return model == self.name or model in self.aliases


MAX_NESTING = 32  # OpenAI bodies nest a handful of levels; deeper is refused before any work
SHOW_CHARS = 80  # an echoed value is cut to this many characters


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def show(value: Any) -> str:
    """`repr(value)` cut to SHOW_CHARS, for error messages (a body may be megabytes)."""
    if isinstance(value, (list, dict)) and len(value) > SHOW_CHARS:
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= SHOW_CHARS else text[:SHOW_CHARS] + "..."


def check_nesting(body: Any) -> None:
    """Refuse bodies nested deeper than MAX_NESTING (walked without recursion): deep nesting
    serves no OpenAI field and would exhaust the stack of code that recurses over it."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (list, dict)):
            if depth > MAX_NESTING:
                raise ApiError(400, f"the request body nests more than {MAX_NESTING} levels of "
                                    f"arrays and objects", code="invalid_body")
            stack += [(v, depth + 1) for v in (value.values() if isinstance(value, dict)
                                                else value)]


def _text(param: str, value: str) -> str:
    """`value` if it is valid Unicode; a lone surrogate (JSON "\\ud800") cannot be encoded
    to UTF-8, so the tokenizer and the response writer would fail on it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(param, f"contains a lone UTF-16 surrogate at character {exc.start} "
                          f"({value[exc.start]!a}); send valid Unicode text") from None
    return value


def _number(body: dict, key: str, default: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(key, f"must be a number, got {show(v)}")
    return float(v)


def _int(body: dict, key: str, default: int | None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _bad(key, f"must be a positive integer, got {show(v)}")
    return v


def _bool(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(key, f"must be true or false, got {show(v)}")
    return v


def _check_common(body: Any, limits: Limits) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got "
                            f"{type(body).__name__}", code="invalid_body")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", f"must be the model's name as a string ({limits.name!r}), "
                            f"got {show(model)}")
    if not limits.accepts(model):
        others = "".join(f" (or {a!r})" for a in limits.aliases)
        raise ApiError(404, f"model: {show(model)} is not served here; the served model is "
                            f"{limits.name!r}{others}", param="model", code="model_not_found")
    for key, allowed in UNSUPPORTED.items():
        if key in body and body[key] not in allowed:
            why = WHY_UNSUPPORTED.get(key, "")
            raise _bad(key, f"{show(body[key])} is not supported by this server (allowed: "
                            f"{', '.join(map(repr, allowed))}){'; ' + why if why else ''}")


def _params(body: dict, max_tokens: int, prompt_len: int, limits: Limits) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:  # also refuses NaN and Infinity
        raise _bad("temperature", f"must be a finite number in [0, {MAX_TEMPERATURE:g}], got "
                                  f"{temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _bad("top_p", f"must be in (0, 1], got {top_p}")
    if prompt_len + max_tokens > limits.context:
        raise _bad("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) "
                                 f"exceeds the model's context of {limits.context} tokens")
    try:
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                              ignore_eos=_bool(body, "ignore_eos"))
    except ConfigError as exc:  # unreachable after the checks above; kept as a guard
        raise _bad("params", str(exc)) from None


def _prompts(prompt: Any, codec: TextCodec, limits: Limits) -> list[list[int]]:
    """One prompt (text, or a list of token ids) or a non-empty list of them."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise _bad("prompt", f"{len(prompt)} prompts; at most {MAX_CHOICES} per request")
        if len(prompt) == 1:  # one prompt in a batch of one
            return [_prompt_ids(prompt[0], codec, limits)]
        return [_prompt_ids(p, codec, limits, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt_ids(prompt, codec, limits)]


def _prompt_ids(prompt: Any, codec: TextCodec, limits: Limits,
                param: str = "prompt") -> list[int]:
    if isinstance(prompt, str):
        if not codec.has_tokenizer:
            raise _bad(param, f"model {limits.name!r} has no tokenizer: send the prompt as "
                                 f"a list of token ids")
        try:
            ids = codec.encode(_text(param, prompt), limits.context - 1)
        except PromptTooLong as exc:
            raise _too_long(param, exc, limits) from None
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in prompt):
        ids = prompt
    else:
        raise _bad(param, "must be a string, a list of token ids, or a list of such prompts")
    if not ids:
        raise _bad(param, "is empty")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise _bad(param, f"token {bad[0]} is outside the vocabulary "
                             f"0..{limits.vocab_size - 1}")
    if len(ids) >= limits.context:
        raise _bad(param, f"{len(ids)} tokens leave no room in the model's context of "
                             f"{limits.context} tokens")
    return ids


def _too_long(param: str, exc: PromptTooLong, limits: Limits) -> ApiError:
    return _bad(param, f"{exc}: more than fit in the model's context of {limits.context} "
                       f"tokens")


MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI's bound on stop strings; a sane length


def _stop(body: dict) -> tuple[str, ...]:
    """`stop`: a string or a list of at most MAX_STOPS non-empty strings."""
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS
            and all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stops)):
        raise _bad("stop", f"must be a string or a list of at most {MAX_STOPS} strings of 1 to "
                           f"{MAX_STOP_CHARS} characters, got {show(v)}")
    return tuple(_text("stop", x) for x in stops)


def _stream(body: dict) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`); stream_options needs stream true."""
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise _bad("stream_options", "is only allowed with \"stream\": true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise _bad("stream_options", f"must be an object with only include_usage (true or "
                                     f"false), got {show(opts)}")
    return stream, _bool({"stream_options.include_usage": opts.get("include_usage")},
                         "stream_options.include_usage")


def _n(body: dict, num_prompts: int) -> int:
    n = _int(body, "n", 1) or 1
    if n > MAX_N or n * num_prompts > MAX_CHOICES:
        raise _bad("n", f"{n} choices per prompt for {num_prompts} prompt(s); at most {MAX_N} "
                        f"per prompt and {MAX_CHOICES} per request")
    return n


def _job(body: dict, prompts: list[list[int]], max_tokens: int, limits: Limits,
         is_chat: bool) -> Job:
    stream, usage = _stream(body)
    n = _n(body, len(prompts))
    if stream and n * len(prompts) > 1:
        raise _bad("stream", f"{n * len(prompts)} choices ({len(prompts)} prompt(s) x n={n}) "
                             f"are answered whole only: send \"stream\": false, or one prompt "
                             f"with n 1 per streamed request")
    params = [_params(body, max_tokens, len(ids), limits) for ids in prompts]
    return Job(prompts[0], params[0], stream, is_chat, _stop(body), usage, tuple(prompts), n)


def parse_completion(body: Any, codec: TextCodec, limits: Limits) -> Job:
    """Validate a /v1/completions body."""
    _check_common(body, limits)
    if "prompt" not in body:
        raise _bad("prompt", "is required")
    prompts = _prompts(body["prompt"], codec, limits)
    return _job(body, prompts, _int(body, "max_tokens", 16), limits, False)


def _content(i: int, content: Any) -> str:
    """A message's content: a string, or an array of text parts (`{"type": "text", "text":
    ...}`, as the openai SDK and LangChain send) joined by newlines; other parts (images,
    audio) are refused since the served models read text only."""
    if isinstance(content, str):
        return _text(f"messages[{i}].content", content)
    if not isinstance(content, list):
        raise _bad(f"messages[{i}].content", f"must be a string or an array of text parts, "
                                             f"got {show(content)}")
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise _bad(param, f"only {{\"type\": \"text\", \"text\": ...}} parts are "
                              f"supported, got {show(part)}")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{param}.text", f"must be a string, got {show(part.get('text'))}")
        texts.append(_text(f"{param}.text", part["text"]))
    return "\n".join(texts)


TOOL_FIELDS = ("tool_calls", "function_call", "tool_call_id")  # a message's tool fields
TOOL_ROLES = ("tool", "function")


def _no_tools(i: int, m: dict) -> None:
    """A message of a tool conversation is refused as `tools` is: the server runs no tools,
    and a template would drop or mangle the calls silently."""
    for key in TOOL_FIELDS:
        if m.get(key) not in (None, [], ""):
            raise _bad(f"messages[{i}].{key}", f"{show(m[key])} is not supported by this "
                                               f"server: it serves no tools (as `tools` is "
                                               f"refused)")
    if m.get("role") in TOOL_ROLES:
        raise _bad(f"messages[{i}].role", f"{m['role']!r} messages are not supported by this "
                                          f"server: it serves no tools (as `tools` is refused)")


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", f"must be a non-empty list of {{role, content}} objects, got "
                               f"{show(msgs)}")
    for i, m in enumerate(msgs):
        if isinstance(m, dict):
            _no_tools(i, m)
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            raise _bad(f"messages[{i}]", f"must be an object with a string role and a content, "
                                         f"got {show(m)}")
    return [{"role": _text(f"messages[{i}].role", m["role"]), "content": _content(i, m["content"])}
            for i, m in enumerate(msgs)]


def parse_chat(body: Any, codec: TextCodec, limits: Limits) -> Job:
    """Validate a /v1/chat/completions body."""
    _check_common(body, limits)
    msgs = _messages(body)
    if not codec.has_tokenizer:
        raise _bad("messages", f"model {limits.name!r} has no tokenizer, so chat is not "
                               f"available: use /v1/completions with token-id prompts")
    try:
        ids = _prompt_ids(codec.chat_prompt(msgs, limits.context - 1), codec, limits)
    except PromptTooLong as exc:
        raise _too_long("messages", exc, limits) from None
    except TemplateRefused as exc:
        raise _bad("messages", f"the model's chat template refused this conversation: "
                               f"{show(str(exc))}") from None
    given = _int(body, "max_completion_tokens", None) or _int(body, "max_tokens", None)
    return _job(body, [ids], given or limits.context - len(ids), limits, True)
