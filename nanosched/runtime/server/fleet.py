"""What a router in front of several `nanosched serve` replicas asks of each one.

sglang-router (docs/usage.md, "Several replicas behind a router") registers a worker by GET
/health, then /server_info (falling back to /get_server_info on a 404) and /model_info (then
/get_model_info); with its power_of_two policy it polls /get_load every few seconds. The bodies
use SGLang's field names, each with this server's own value, and nothing SGLang reports that
has no counterpart here: /server_info the model, served name, tp, context, KV tokens, dense
batch, queue, page size and prefix caching; /model_info the model's paths and architecture;
/get_load the requests running and waiting and the tokens their KV pages hold.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

from typing import Any

import nanosched
from nanosched.models.checkpoint import model_folder
from nanosched.runtime.server.startup import Served

RUNS_AS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "mixtral": "MixtralForCausalLM"}  # ModelSpec.arch -> the HF class it runs as


def server_info(served: Served, context: int, max_queue: int) -> dict[str, Any]:
    """/server_info: how this replica serves (`context`: the longest request it runs)."""
    b = served.engine.scheduler
    return {"model_path": served.model_path, "served_model_name": served.name,
            "tp_size": served.tp, "dp_size": 1, "context_length": context,
            "max_total_tokens": b.capacity_pages * b.page_size,
            "max_prefill_tokens": b.dense_batch, "max_running_requests": b.dense_batch,
            "max_queued_requests": max_queue, "page_size": b.page_size,
            "disable_radix_cache": b.prefix_seed is None, "strategy": served.strategy,
            "version": nanosched.__version__}


def model_info(served: Served) -> dict[str, Any]:
    """/model_info: what the model is."""
    arch, folder = served.spec.arch, model_folder(served.model_path)
    return {"model_path": served.model_path,
            "tokenizer_path": str(folder) if folder and served.codec.has_tokenizer else None,
            "is_generation": True, "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": arch,
            "architectures": [RUNS_AS[arch]]}


def load(snapshot: dict[str, Any], page_size: int) -> list[dict[str, int]]:
    """/get_load from a worker snapshot: SGLang's list of one entry per dp rank."""
    running, waiting = snapshot["requests_running"], snapshot["queue_length"]
    return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
             "num_tokens": snapshot["kv_pages_in_use"] * page_size}]
