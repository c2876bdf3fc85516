"""OpenAI request bodies → validated jobs, and OpenAI-style errors.

The bodies are pydantic models, as vLLM's and SGLang's protocol modules declare them; a body
that fails is answered with the first failing field (in the order below) as an `ApiError` that
names it, with this module's message for it. More in docs/runtime.md, module notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

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
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI's bound on stop strings; a sane length
WHY_UNSUPPORTED = {"seed": "the engine samples each batch with one generator, so a request's "
                           "draws would depend on the requests beside it; a per-request seed "
                           "cannot be honoured"}
TOOL_FIELDS = ("tool_calls", "function_call", "tool_call_id")  # a message's tool fields
TOOL_ROLES = ("tool", "function")
MAX_NESTING = 32  # OpenAI bodies nest a handful of levels; deeper is refused before any work
SHOW_CHARS = 80  # an echoed value is cut to this many characters


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
class ModelLimits:
    """What the served model accepts."""

    name: str
    vocab_size: int
    context: int
    aliases: tuple[str, ...] = ()  # other names a request may give the model (`accepts`)

    def accepts(self, model: str) -> bool:
        return model == self.name or model in self.aliases


def short_repr(value: Any) -> str:
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


# ---- refusals raised inside validation -----------------------------------------------------
def _refuse(message: str, param: str | None = None, status: int = 400,
            code: str = "invalid_value") -> PydanticCustomError:
    """A refusal with this module's message; `param` when it is not the failing field."""
    return PydanticCustomError("nanosched", "{message}", {"message": message, "param": param,
                                                          "status": status, "code": code})


def _utf8(value: str) -> str:
    """`value` if it is valid Unicode; a lone surrogate (JSON "\\ud800") cannot be encoded
    to UTF-8, so the tokenizer and the response writer would fail on it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _refuse(f"contains a lone UTF-16 surrogate at character {exc.start} "
                      f"({value[exc.start]!a}); send valid Unicode text") from None
    return value


Text = Annotated[str, Field(strict=True), AfterValidator(_utf8)]
PositiveInt = Annotated[StrictInt, Field(gt=0)]
Number = StrictFloat  # an int is taken as a float too; a bool is not a number
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]


# ---- the bodies ----------------------------------------------------------------------------
class _Head(BaseModel):
    """What both routes check first: the model's name, then the fields not served here."""

    model_config = ConfigDict(extra="allow", strict=True)  # unknown fields are ignored
    model: StrictStr
    best_of: Any = None
    echo: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    seed: Any = None
    suffix: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None

    @field_validator("model")
    @classmethod
    def _served(cls, model: str, info: ValidationInfo) -> str:
        limits: ModelLimits = info.context["limits"]
        if not limits.accepts(model):
            others = "".join(f" (or {a!r})" for a in limits.aliases)
            raise _refuse(f"{short_repr(model)} is not served here; the served model is "
                          f"{limits.name!r}{others}", status=404, code="model_not_found")
        return model

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = UNSUPPORTED[info.field_name]
        if value not in allowed:
            why = WHY_UNSUPPORTED.get(info.field_name, "")
            raise _refuse(f"{short_repr(value)} is not supported by this server (allowed: "
                          f"{', '.join(map(repr, allowed))}){'; ' + why if why else ''}")
        return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: StrictBool | None = None


class _Tail(BaseModel):
    """What both routes check after the prompt: streaming, choices, sampling, stop strings."""

    model_config = ConfigDict(extra="allow", strict=True)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    n: PositiveInt | None = Field(None, validate_default=True)
    temperature: Number | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: Number | None = Field(None, gt=0, le=1)
    ignore_eos: StrictBool | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = \
        Field(None, union_mode="left_to_right")

    @field_validator("stream_options", mode="before")
    @classmethod
    def _with_stream(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("stream", True) is not True:
            raise _refuse("is only allowed with \"stream\": true")
        return value

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int | None, info: ValidationInfo) -> int:
        n = n or 1
        prompts = info.data.get(cls.prompts_field)
        if prompts is None:  # the prompt was refused
            return n
        num = len(prompts)
        if n > MAX_N or n * num > MAX_CHOICES:
            raise _refuse(f"{n} choices per prompt for {num} prompt(s); at most {MAX_N} per "
                          f"prompt and {MAX_CHOICES} per request")
        if info.data.get("stream") and n * num > 1:
            raise _refuse(f"{n * num} choices ({num} prompt(s) x n={n}) are answered whole "
                          f"only: send \"stream\": false, or one prompt with n 1 per streamed "
                          f"request", param="stream")
        return n

    prompts_field: ClassVar[str] = "prompt"  # it holds the prompts' token ids once validated
    _job: Any = PrivateAttr(None)

    def _answer(self, prompts: list[list[int]], max_tokens: int, is_chat: bool,
                limits: ModelLimits) -> Job:
        """The job, once the prompts and max_tokens are known to fit the context."""
        for ids in prompts:
            if len(ids) + max_tokens > limits.context:
                raise _refuse(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                              f"the model's context of {limits.context} tokens",
                              param="max_tokens")
        params = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, max_tokens=max_tokens,
            ignore_eos=bool(self.ignore_eos))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        usage = bool(self.stream_options and self.stream_options.include_usage)
        return Job(prompts[0], params, bool(self.stream), is_chat, stop, usage,
                   tuple(prompts), self.n or 1)


class _CompletionHead(_Head):
    prompt: StrictStr | list[StrictInt] | list[StrictStr | list[Any]] = \
        Field(union_mode="left_to_right")
    max_tokens: PositiveInt | None = None

    @field_validator("prompt")
    @classmethod
    def _ids(cls, prompt: Any, info: ValidationInfo) -> list[list[int]]:
        """One prompt (text, or a list of token ids) or a non-empty list of them."""
        codec, limits = info.context["codec"], info.context["limits"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > MAX_CHOICES:
                raise _refuse(f"{len(prompt)} prompts; at most {MAX_CHOICES} per request")
            if len(prompt) == 1:  # one prompt in a batch of one
                return [_prompt_ids(prompt[0], codec, limits)]
            return [_prompt_ids(p, codec, limits, f"prompt[{i}]") for i, p in enumerate(prompt)]
        return [_prompt_ids(prompt, codec, limits)]


class CompletionRequest(_Tail, _CompletionHead):  # fields in checking order: head, prompt, tail
    """A /v1/completions body; `prompt` holds the prompts' token ids once validated."""

    @model_validator(mode="after")
    def _fits(self, info: ValidationInfo) -> CompletionRequest:
        self._job = self._answer(self.prompt, self.max_tokens or 16, False, info.context["limits"])
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    tool_calls: Any = None
    function_call: Any = None
    tool_call_id: Any = None
    role: Text
    content: Text | list[TextPart] = Field(union_mode="left_to_right")

    @field_validator(*TOOL_FIELDS)
    @classmethod
    def _no_tools(cls, value: Any) -> Any:
        """A message of a tool conversation is refused as `tools` is: the server runs no
        tools, and a template would drop or mangle the calls silently."""
        if value not in (None, [], ""):
            raise _refuse(f"{short_repr(value)} is not supported by this server: it serves no "
                          f"tools (as `tools` is refused)")
        return value

    @field_validator("role")
    @classmethod
    def _no_tool_role(cls, role: str) -> str:
        if role in TOOL_ROLES:
            raise _refuse(f"{role!r} messages are not supported by this server: it serves no "
                          f"tools (as `tools` is refused)")
        return role

    def text(self) -> str:
        """The content: a string, or its text parts (as the openai SDK and LangChain send
        them) joined by newlines; other parts (images, audio) are refused: the served models
        read text only."""
        return self.content if isinstance(self.content, str) else \
            "\n".join(p.text for p in self.content)


class _ChatHead(_Head):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    max_tokens: PositiveInt | None = None

    @field_validator("messages")
    @classmethod
    def _ids(cls, msgs: list[Message], info: ValidationInfo) -> list[list[int]]:
        codec: TextCodec = info.context["codec"]
        limits: ModelLimits = info.context["limits"]
        if not codec.has_tokenizer:
            raise _refuse(f"model {limits.name!r} has no tokenizer, so chat is not available: "
                          f"use /v1/completions with token-id prompts")
        turns = [{"role": m.role, "content": m.text()} for m in msgs]
        try:
            ids = codec.chat_prompt(turns, limits.context - 1)
        except PromptTooLong as exc:
            raise _too_long(exc, limits) from None
        except TemplateRefused as exc:
            raise _refuse(f"the model's chat template refused this conversation: "
                          f"{short_repr(str(exc))}") from None
        return [_prompt_ids(ids, codec, limits)]


class ChatRequest(_Tail, _ChatHead):
    """A /v1/chat/completions body; `messages` holds the prompt's token ids once validated."""

    prompts_field: ClassVar[str] = "messages"

    @model_validator(mode="after")
    def _fits(self, info: ValidationInfo) -> ChatRequest:
        ids = self.messages[0]
        given = self.max_completion_tokens or self.max_tokens
        self._job = self._answer(self.messages, given or info.context["limits"].context - len(ids),
                             True, info.context["limits"])
        return self


def _prompt_ids(prompt: Any, codec: TextCodec, limits: ModelLimits,
                param: str = "prompt") -> list[int]:
    if isinstance(prompt, str):
        if not codec.has_tokenizer:
            raise _refuse(f"model {limits.name!r} has no tokenizer: send the prompt as a list "
                          f"of token ids", param)
        try:
            ids = codec.encode(_text(prompt, param), limits.context - 1)
        except PromptTooLong as exc:
            raise _too_long(exc, limits, param) from None
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in prompt):
        ids = prompt
    else:
        raise _refuse(PROMPT_SHAPE, param)
    if not ids:
        raise _refuse("is empty", param)
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise _refuse(f"token {bad[0]} is outside the vocabulary 0..{limits.vocab_size - 1}",
                      param)
    if len(ids) >= limits.context:
        raise _refuse(f"{len(ids)} tokens leave no room in the model's context of "
                      f"{limits.context} tokens", param)
    return ids


def _text(value: str, param: str) -> str:
    try:
        return _utf8(value)
    except PydanticCustomError as exc:
        raise _refuse(exc.context["message"], param) from None


def _too_long(exc: PromptTooLong, limits: ModelLimits, param: str | None = None) -> Exception:
    return _refuse(f"{exc}: more than fit in the model's context of {limits.context} tokens",
                   param)


# ---- validation errors -> ApiError ---------------------------------------------------------
PROMPT_SHAPE = "must be a string, a list of token ids, or a list of such prompts"
BOOL = "must be true or false, got {}"
POSITIVE = "must be a positive integer, got {}"
RULES = {  # a field (list indices as []) -> its message for pydantic's own errors
    "prompt": PROMPT_SHAPE, "max_tokens": POSITIVE, "max_completion_tokens": POSITIVE,
    "n": POSITIVE, "stream": BOOL, "ignore_eos": BOOL, "stream_options.include_usage": BOOL,
    "stream_options": "must be an object with only include_usage (true or false), got {}",
    "stop": f"must be a string or a list of at most {MAX_STOPS} strings of 1 to "
            f"{MAX_STOP_CHARS} characters, got {{}}",
    "messages": "must be a non-empty list of {{role, content}} objects, got {}",
    "messages[]": "must be an object with a string role and a content, got {}",
    "messages[].content": "must be a string or an array of text parts, got {}",
    "messages[].content[]": "only {{\"type\": \"text\", \"text\": ...}} parts are supported, "
                            "got {}",
    "messages[].content[].text": "must be a string, got {}",
}
RANGES = {"temperature": f"must be a finite number in [0, {MAX_TEMPERATURE:g}], got {{}}",
          "top_p": "must be in (0, 1], got {}"}


def _first(exc: ValidationError, order: list[str]) -> dict[str, Any]:
    """The error to answer: that of the first field in `order`, and of a union's alternatives
    the one that went deepest (a list of parts is reported at the part, not as "not a
    string")."""
    errors = [dict(e, loc=tuple(p for p in e["loc"] if isinstance(p, int) or p in FIELDS))
              for e in exc.errors()]
    errors.sort(key=lambda e: order.index(e["loc"][0]) if e["loc"] and e["loc"][0] in order
                else len(order))
    first = errors[0]
    deeper = [e for e in errors if e["loc"][:len(first["loc"])] == first["loc"]]
    return max(deeper, key=lambda e: len(e["loc"]))


def _path(loc: tuple) -> tuple[str, str]:
    """(the param as the error names it: messages[0].content, the rule's key: messages[].content)"""
    param = key = ""
    for p in loc:
        param += f"[{p}]" if isinstance(p, int) else f".{p}" if param else p
        key += "[]" if isinstance(p, int) else f".{p}" if key else p
    return param, key


def _value(body: Any, loc: tuple) -> Any:
    for p in loc:
        try:
            body = body[p]
        except (KeyError, IndexError, TypeError):
            return None
    return body


def _api_error(exc: ValidationError, body: dict, order: list[str], limits: ModelLimits) -> ApiError:
    e = _first(exc, order)
    loc = e["loc"]
    if e["type"] == "nanosched":
        ctx = e["ctx"]
        while loc and _path(loc)[1] not in PARAMS:
            loc = loc[:-1]  # a stop string's index: `stop`
        param = ctx["param"] or _path(loc)[0]
        return ApiError(ctx["status"], f"{param}: {ctx['message']}", param=param,
                        code=ctx["code"])
    if e["type"] == "missing" and _path(loc)[1] == "messages[].content":
        loc = loc[:-1]  # a message without content is not a message
    while loc and _path(loc)[1] not in RULES | RANGES | {"model": ""}:
        loc = loc[:-1]  # a message's role, a part's type: the whole message or part
    param, key = _path(loc)
    value = _value(body, loc)
    if key == "model":
        message = f"must be the model's name as a string ({limits.name!r}), got {short_repr(value)}"
    elif e["type"] == "missing" and key == "prompt":
        message = "is required"
    elif key in RANGES:
        message = RANGES[key].format(float(value)) if e["type"] != "float_type" else \
            f"must be a number, got {short_repr(value)}"
    else:
        message = RULES.get(key, "is not valid, got {}").format(short_repr(value))
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


FIELDS = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields) | \
    set(Message.model_fields) | set(TextPart.model_fields) | set(StreamOptions.model_fields)
PARAMS = {*RULES, *RANGES, "model", *UNSUPPORTED, "messages[].role",
          *(f"messages[].{f}" for f in TOOL_FIELDS)}  # what a refusal may name
COMPLETION_ORDER = list(CompletionRequest.model_fields)
CHAT_ORDER = list(ChatRequest.model_fields)


def _parse(kind: type[_Tail], order: list[str], body: Any, codec: TextCodec,
           limits: ModelLimits) -> Job:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got "
                            f"{type(body).__name__}", code="invalid_body")
    try:
        return kind.model_validate(body, context={"codec": codec, "limits": limits})._job
    except ValidationError as exc:
        raise _api_error(exc, body, order, limits) from None


def parse_completion(body: Any, codec: TextCodec, limits: ModelLimits) -> Job:
    """Validate a /v1/completions body."""
    return _parse(CompletionRequest, COMPLETION_ORDER, body, codec, limits)


def parse_chat(body: Any, codec: TextCodec, limits: ModelLimits) -> Job:
    """Validate a /v1/chat/completions body."""
    return _parse(ChatRequest, CHAT_ORDER, body, codec, limits)
