"""Every request body of a corpus (each field's good, neutral and hostile values, one fault at a
time, on both routes, with and without a tokenizer) gets the same answer as recorded in
tests/data/protocol_answers.json: the same error body and status, or the same job. The record
was written by the hand-written validation that the pydantic models replaced; run this module
as a script to write it again."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from nanosched.runtime.server.protocol import ApiError, ModelLimits, parse_chat, parse_completion
from nanosched.runtime.server.text import TextCodec

RECORD = Path(__file__).parents[2] / "data" / "protocol_answers.json"
LIMITS = ModelLimits("tiny", 100, 512, ("/models/tiny",))
TOOL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
NEUTRAL = {"best_of": 1, "echo": False, "logprobs": False, "top_logprobs": 0, "suffix": "",
           "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
           "functions": [], "function_call": "none", "logit_bias": {}, "presence_penalty": 0,
           "frequency_penalty": 0.0, "repetition_penalty": 1, "min_tokens": 0}
REFUSED = {"best_of": 2, "echo": True, "logprobs": 1, "top_logprobs": 2, "seed": 7,
           "suffix": "x", "response_format": {"type": "json_object"},
           "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
           "functions": [{"name": "f"}], "function_call": "auto", "logit_bias": {"5": 100},
           "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
           "min_tokens": 3, "guided_json": {}, "guided_regex": "x", "guided_choice": ["a"]}
SHARED = {  # fields both routes take -> values tried one at a time
    "model": [None, 5, "gpt-4", "/models/tiny", "\ud800", ["tiny"]],
    "max_tokens": [0, -3, "8", True, 1.5, None, 600, 5, 2**70],
    "temperature": [-0.5, "hot", 2.5, math.inf, math.nan, 0, 2, None, True, 1, 0.7],
    "top_p": [0, 1.5, math.nan, 0.5, None, "x", True, 1],
    "n": [17, 0, 2, True, "2", None, 1.0, 16],
    "stream": ["yes", True, False, None, 1],
    "stop": [["a", "b", "c", "d", "e"], [""], 5, "x" * 300, "w3", ["w3", "w4"], None, [],
             "\ud800", [5], ["w1", None]],
    "ignore_eos": [True, "y", None, 0, False],
    "user": ["someone", {"a": [1]}],
}
COMPLETION = {
    "prompt": [[], [1, 100], {"ids": [1]}, "w1 w2", "", [[1], [2]], [[1], 2], [[1]] * 65,
               ["w1", "w2"], [True], [1.0], "w1 \ud800", ["\udfff"], [[]], ["w1"], [[1]],
               [1] * 512, [1] * 511, "w1 " * 600, [-1], None, 5, [[1], [2, 100]], [[1]] * 64],
}
CHAT = {
    "messages": [[], "x", [5], [{"role": "user"}], [{"content": "x"}],
                 [{"role": 5, "content": "x"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": None}],
                 [{"role": "user", "content": [{"type": "text", "text": "w1"},
                                               {"type": "text", "text": "w2"}]}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                 [{"role": "user", "content": [5]}], [{"role": "user", "content": []}],
                 [{"role": "user", "content": {"text": "w1"}}],
                 [{"role": "\udc00", "content": "w1"}], [{"role": "user", "content": "hi \ud83d"}],
                 [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
                 [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": None, "tool_calls": TOOL}],
                 [{"role": "assistant", "content": "", "function_call": {"name": "f"}}],
                 [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}],
                 [{"role": "tool", "content": "42", "tool_call_id": "c1"}],
                 [{"role": "function", "content": "42"}],
                 [{"role": "assistant", "content": "yo", "tool_calls": [],
                   "function_call": None, "tool_call_id": ""}],
                 [{"role": "user", "content": "w1 " * 600}], [{"role": "user", "content": ""}],
                 [{"role": "user", "content": "w1", "name": "bob"}], None, {"role": "user"}],
    "max_completion_tokens": [0, 5, "5", None, 600],
}


def _cases() -> list[tuple[str, str, object]]:
    """(route, tokenizer or not, body) of the corpus, each with an id."""
    base = {"completions": {"model": "tiny", "prompt": [1, 2]},
            "chat": {"model": "tiny", "messages": [{"role": "user", "content": "w1"}]}}
    out = []
    for route, own in (("completions", COMPLETION), ("chat", CHAT)):
        b = base[route]
        out += [(route, "tok", b), (route, "tok", [1, 2]), (route, "tok", None),
                (route, "tok", "x"), (route, "tok", 5), (route, "tok", {})]
        for field, values in {**SHARED, **own}.items():
            out.append((route, "tok", {k: v for k, v in b.items() if k != field}))
            out += [(route, "tok", {**b, field: v}) for v in values]
        out += [(route, "tok", {**b, k: v}) for k, v in {**NEUTRAL, **REFUSED}.items()]
        out += [(route, "tok", {**b, "stream": s, "stream_options": o})
                for s in (True, False, None)
                for o in ({"include_usage": True}, {"x": 1}, {"include_usage": 1}, None, [],
                          {"include_usage": None}, {}, {"include_usage": False, "x": 2})]
        out += [(route, "tok", {**b, "n": 2, "stream": True}),
                (route, "tok", {**b, "n": 4, "max_tokens": 3, "stop": "w5"}),
                (route, "tok", {**b, "temperature": "hot", "top_p": 5, "n": 0}),
                (route, "tok", {**b, "model": "gpt-4", "temperature": "hot"}),
                (route, "tok", {**b, "seed": 1, "echo": True, "n": 99}),
                (route, "tok", {**b, "max_tokens": 5, "max_completion_tokens": 7}),
                (route, "none", b)]
    c = base["completions"]
    out += [("completions", "tok", {**c, "prompt": [[1], [2]], "stream": True}),
            ("completions", "tok", {**c, "prompt": [[1]] * 5, "n": 16}),
            ("completions", "tok", {**c, "prompt": [[1]] * 4, "n": 16}),
            ("completions", "tok", {**c, "prompt": [[1], [2]], "n": 3, "max_tokens": 2}),
            ("completions", "tok", {**c, "prompt": [1] * 500, "max_tokens": 20}),
            ("completions", "tok", {**c, "prompt": [1, 100], "max_tokens": "8"}),
            ("completions", "none", {**c, "prompt": "w1 w2"}),
            ("completions", "none", {**c, "prompt": ["w1", "w2"]})]
    return out


CASES = _cases()


def answer(route: str, tok: str, body: object, codec: TextCodec) -> dict:
    parse = parse_completion if route == "completions" else parse_chat
    try:
        job = parse(body, codec if tok == "tok" else TextCodec(None), LIMITS)
    except ApiError as exc:
        return {"status": exc.status, **exc.body()}
    return {"job": json.loads(json.dumps(asdict(job)))}


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    from serve_helpers import tiny_folder

    return TextCodec.for_model(str(tiny_folder(tmp_path_factory.mktemp("protocol"))))


@pytest.fixture(scope="module")
def record():
    return json.loads(RECORD.read_text())


@pytest.mark.parametrize("i", range(len(CASES)))
def test_the_answer_is_the_recorded_one(i, codec, record):
    route, tok, body = CASES[i]
    assert record[i]["case"] == [route, tok, repr(body)[:200]]
    assert answer(route, tok, body, codec) == record[i]["answer"]


if __name__ == "__main__":  # write the record again
    sys.path.insert(0, str(Path(__file__).parents[2] / "helpers"))
    import tempfile

    from serve_helpers import tiny_folder

    codec = TextCodec.for_model(str(tiny_folder(Path(tempfile.mkdtemp()))))
    RECORD.write_text(json.dumps([{"case": [r, t, repr(b)[:200]], "answer": answer(r, t, b, codec)}
                                  for r, t, b in CASES], indent=1, ensure_ascii=True) + "\n")
    print(f"{len(CASES)} answers written to {RECORD}")
