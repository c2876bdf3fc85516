"""OpenAI response bodies (whole and streamed chunks) and the Prometheus text of /metrics.

Each choice also carries `token_ids` (the generated ids; in a chunk, the chunk's ids), since
models served without a tokenizer have no other text than " <id>" per token.
"""

from __future__ import annotations

import json
import time
from typing import Any

# name -> (Prometheus type, help, snapshot key)
METRICS = {
    "nanosched_requests_received_total": ("counter", "Requests accepted.", "requests_received"),
    "nanosched_requests_finished_total": ("counter", "Requests that ended (length or stop).",
                                          "requests_finished"),
    "nanosched_requests_aborted_total": ("counter", "Requests aborted (client went away).",
                                         "requests_aborted"),
    "nanosched_requests_rejected_total": ("counter", "Requests refused with 429 (queue full).",
                                          "requests_rejected"),
    "nanosched_requests_running": ("gauge", "Requests admitted to the engine.",
                                   "requests_running"),
    "nanosched_queue_length": ("gauge", "Requests waiting for admission.", "queue_length"),
    "nanosched_iterations_total": ("counter", "Engine iterations.", "iterations"),
    "nanosched_fallback_iterations_total": ("counter", "Iterations run by Sequential because "
                                            "the schedule did not accept the batch.",
                                            "fallbacks"),
    "nanosched_batch_size_tokens": ("gauge", "Tokens in the last iteration's batch.",
                                    "batch_size"),
    "nanosched_tokens_processed_total": ("counter", "Prompt and decode tokens processed.",
                                         "tokens_processed"),
    "nanosched_tokens_generated_total": ("counter", "Output tokens generated.",
                                         "tokens_generated"),
    "nanosched_throughput_tokens_per_second": ("gauge", "Prompt and decode tokens per second "
                                               "over the last 10 s.",
                                               "throughput_tokens_per_s"),
    "nanosched_kv_pages_in_use": ("gauge", "KV cache pages held by requests.",
                                  "kv_pages_in_use"),
    "nanosched_kv_pages_total": ("gauge", "KV cache pages.", "kv_pages_total"),
    "nanosched_prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix "
                                             "cache.", "prefix_cache_queries"),
    "nanosched_prefix_cache_hits_total": ("counter", "Prompt tokens found in the prefix cache "
                                          "(not computed).", "prefix_cache_hits"),
    # vLLM's names for the same two counters, for dashboards made for vLLM
    "vllm:prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix "
                                        "cache.", "prefix_cache_queries"),
    "vllm:prefix_cache_hits_total": ("counter", "Prompt tokens found in the prefix cache.",
                                     "prefix_cache_hits"),
}


def render_metrics(snapshot: dict[str, Any]) -> str:
    """The Prometheus text exposition format (version 0.0.4) of a worker snapshot."""
    lines = []
    for name, (kind, help_, key) in METRICS.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {snapshot[key]}"]
    return "\n".join(lines) + "\n"


def completion_body(rid: str, model: str, is_chat: bool, text: str, ids: list[int],
                    finish_reason: str, prompt_len: int) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "token_ids": ids,
                              "logprobs": None}
    if is_chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if is_chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(prompt_len, len(ids))}


def merge_choices(bodies: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One response of several whole completions (prompt i's j-th choice at index i * n + j,
    as OpenAI numbers them): the choices in order, usage summed (each prompt counted once)."""
    merged = dict(bodies[0])
    merged["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies[::n])
    completion = sum(b["usage"]["completion_tokens"] for b in bodies)
    merged["usage"] = usage(prompt, completion)
    return merged


def usage(prompt_len: int, completion_len: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion_len,
            "total_tokens": prompt_len + completion_len}


def usage_event(rid: str, model: str, is_chat: bool, prompt_len: int,
                completion_len: int) -> str:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return sse({"id": rid, "object": "chat.completion.chunk" if is_chat else "text_completion",
                "created": int(time.time()), "model": model, "choices": [],
                "usage": usage(prompt_len, completion_len)})


def chunk_event(rid: str, model: str, is_chat: bool, text: str | None, ids: list[int],
                finish_reason: str | None, with_usage: bool = False) -> str:
    """One server-sent event of a stream (`text` None: the chat chunk naming the role);
    `with_usage` adds `"usage": null`, as OpenAI does when the last chunk will carry it."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "token_ids": ids,
                              "logprobs": None}
    if is_chat:
        choice["delta"] = {"role": "assistant"} if text is None else {"content": text}
    else:
        choice["text"] = text or ""
    body = {"id": rid, "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}
    if with_usage:
        body["usage"] = None
    return sse(body)


def sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"
