"""What a router asks of a replica (`fleet.py`): /server_info and /model_info (and their
/get_... names) describe the served model with the engine's own figures, /get_load counts the
running and waiting requests and the KV tokens they hold, and the API key guards the first two
as it guards /v1/models."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from repo import DATA
from serve_helpers import EngineGate, ThreadServer, server_fixtures

from nanosched.models.spec import load_spec
from nanosched.runtime.server.fleet import load, model_info
from nanosched.runtime.server.text import TextCodec

folder, srv, http = server_fixtures("fleet", timeout=30)


def test_server_info_reports_the_engines_own_figures(srv, http, folder):
    body = http.get(f"{srv.url}/server_info").json()
    b = srv.worker.engine.scheduler
    models = http.get(f"{srv.url}/v1/models").json()["data"][0]
    assert body == {"model_path": str(folder), "served_model_name": "tiny", "tp_size": 1,
                    "dp_size": 1, "context_length": models["max_model_len"],
                    "max_total_tokens": b.capacity_pages * 16, "max_prefill_tokens": 64,
                    "max_running_requests": 64, "max_queued_requests": 512, "page_size": 16,
                    "disable_radix_cache": False, "strategy": "sequential",
                    "version": "0.1.0"}
    assert b.capacity_pages > 0 and models["max_model_len"] == 512
    assert http.get(f"{srv.url}/get_server_info").json() == body


def test_model_info_names_the_model_its_tokenizer_and_architecture(srv, http, folder):
    body = http.get(f"{srv.url}/model_info").json()
    assert body == {"model_path": str(folder), "tokenizer_path": str(folder),
                    "is_generation": True, "has_image_understanding": False,
                    "has_audio_understanding": False, "model_type": "llama",
                    "architectures": ["LlamaForCausalLM"]}
    assert http.get(f"{srv.url}/get_model_info").json() == body


def test_load_counts_running_and_waiting_requests_and_their_kv_tokens(srv, http):
    assert http.get(f"{srv.url}/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    ask = {"model": srv.model, "max_tokens": 8, "temperature": 0}
    with ThreadPoolExecutor(2) as pool, EngineGate(srv.worker.engine) as gate:
        first = pool.submit(http.post, f"{srv.url}/v1/completions",
                            json=ask | {"prompt": list(range(1, 41))})  # 40 tokens: 3 pages
        gate.wait_held()  # the first request ran its prefill; the engine waits
        second = pool.submit(http.post, f"{srv.url}/v1/completions",
                             json=ask | {"prompt": [5, 6, 7]})
        got = _wait_load(http, srv.url, lambda e: e["num_reqs"] == 2)
        pages = srv.worker.engine.ws.kv.allocator.num_in_use
        assert got == {"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 1,
                       "num_tokens": pages * 16}
        assert pages >= math.ceil(40 / 16)
        gate.release()
        assert first.result(30).status_code == 200 and second.result(30).status_code == 200
    assert _wait_load(http, srv.url, lambda e: e["num_reqs"] == 0)["num_tokens"] == 0


def _wait_load(http, url, pred, timeout_s=10.0):
    """The one /get_load entry once `pred` holds for it (polled for `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        (entry,) = http.get(f"{url}/get_load").json()
        if pred(entry):
            return entry
        assert time.monotonic() < deadline, entry
        time.sleep(0.02)


def test_model_info_of_registered_models():
    """A registered name is no path: a tokenizer shipped in the package has no tokenizer_path
    a router could load; the HF model type and class follow the spec's architecture."""
    for name, arch, cls, has_tokenizer in (("stories15m", "llama", "LlamaForCausalLM", True),
                                           ("qwen2.5-0.5b", "qwen2", "Qwen2ForCausalLM", False)):
        served = SimpleNamespace(spec=load_spec(name), model_path=name,
                                 codec=TextCodec.for_model(name))
        assert served.codec.has_tokenizer is has_tokenizer
        info = model_info(served)
        assert (info["model_path"], info["tokenizer_path"]) == (name, None)
        assert (info["model_type"], info["architectures"]) == (arch, [cls])


def test_load_from_a_snapshot():
    snap = {"requests_running": 3, "queue_length": 2, "kv_pages_in_use": 5}
    assert load(snap, 16) == [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2,
                               "num_tokens": 80}]


@pytest.fixture(scope="module")
def keyed():
    """A config without a tokenizer, prefix caching off, behind an API key."""
    s = ThreadServer(model=str(DATA / "tiny_llama_config.json"), dense_batch=32,
                     prefix_caching=False, api_key="sekrit")
    yield s
    s.close()


def test_without_tokenizer_or_prefix_caching_and_behind_a_key(keyed):
    key = {"Authorization": "Bearer sekrit"}
    with httpx.Client(timeout=30) as c:
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            r = c.get(f"{keyed.url}{path}")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        info = c.get(f"{keyed.url}/server_info", headers=key).json()
        model = c.get(f"{keyed.url}/model_info", headers=key).json()
        assert c.get(f"{keyed.url}/get_load").status_code == 200  # a probe, as /metrics
    config = str(DATA / "tiny_llama_config.json")
    assert info["model_path"] == config and info["served_model_name"] == "tiny_llama_config"
    assert info["disable_radix_cache"] is True and info["max_running_requests"] == 32
    assert model["model_path"] == config and model["tokenizer_path"] is None
