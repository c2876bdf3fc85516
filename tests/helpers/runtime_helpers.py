"""Test helpers for the runtime: a device that reorders streams the way a GPU may, the tiny
Llama of tests/data, and an engine run to completion."""

import random

from repo import DATA  # noqa: F401  (re-exported: the tests import it from here)

# the engine tests' model: two tiny Llama layers, seeded random weights, fp32 on the CPU
TINY_SPEC_KW = dict(name="tiny", arch="llama", hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=97,
                    max_position_embeddings=256)


def tiny_engine_model():
    """A CausalLM of `TINY_SPEC_KW` with the weights of seed 0 (and its spec as `.spec`)."""
    from nanosched.models.model import CausalLM
    from nanosched.models.spec import ModelSpec
    from nanosched.models.weights import init_random

    m = CausalLM(ModelSpec(**TINY_SPEC_KW))
    init_random(m, seed=0)
    return m


def tiny_llama(folder, seed=1):
    """The tiny Llama of tests/data/tiny_llama_config.json (what its schedule was made for),
    random weights; `folder` is a temporary folder for its config."""
    from nanosched.models.model import CausalLM
    from nanosched.models.spec import load_spec
    from nanosched.models.weights import init_random

    (folder / "config.json").write_text((DATA / "tiny_llama_config.json").read_text())
    m = CausalLM(load_spec(str(folder)))
    init_random(m, seed=seed)
    return m


def llama3_8b_layers(folder, num_layers=2):
    """A config.json of Llama-3-8B's shapes with `num_layers` layers in `folder` (random
    weights: the GPU tests' model); returns the folder as a string."""
    import json

    from nanosched.models.spec import REGISTRY

    spec = REGISTRY["llama3-8b"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": spec.hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size, "max_position_embeddings": 4096,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu"}))
    return str(folder)


ENGINE_OBJECTS = ("strategy", "fallback", "device", "stream_configs", "on_token")


def make_engine(model, **kw):
    """`Engine(model, EngineConfig(...), ...)` from flat keywords: the objects an engine runs
    with (strategy, fallback, device, stream_configs, on_token) go beside the config."""
    from nanosched.runtime.config import EngineConfig
    from nanosched.runtime.engine import Engine

    objects = {k: kw.pop(k) for k in ENGINE_OBJECTS if k in kw}
    if "eos_ids" in kw:
        kw["eos_ids"] = frozenset(kw["eos_ids"])
    return Engine(model, EngineConfig(**kw), **objects)


def step(model, ws, chunks):
    """Run one batch through the model's sequential forward; chunks are (request id, new
    token ids, is_decode), decode first. Returns the fp32 logits [len(chunks), V] at each
    chunk's last token (the reference the engine's tokens are checked against)."""
    import torch

    meta = ws.kv.plan([(req, len(ids), is_decode) for req, ids, is_decode in chunks])
    flat = [t for _, ids, _ in chunks for t in ids]
    ws.token_ids[: len(flat)].copy_(torch.tensor(flat, dtype=torch.int64))
    rows = torch.tensor(meta.seg_ends, dtype=torch.int64, device=model.device) - 1
    with torch.inference_mode():
        return model(ws, meta, rows).float()


def serve_all(model, reqs, num_pages, **engine_kw):
    """Run `reqs` through a fresh Engine to completion (inference mode); checks that every KV
    page came back and no page is still referenced (prefix caching's counts). Returns (every
    request's output ids, the engine)."""
    import torch

    eng = make_engine(model, num_pages=num_pages, **engine_kw)
    for r in reqs:
        eng.add_request(r)
    with torch.inference_mode():
        eng.run_to_completion()
    assert eng.ws.kv.allocator.num_free == num_pages and not any(eng.ws.kv.allocator.refs)
    return [r.output_ids for r in reqs], eng


def batch_logits(model, strategy, device, n_decode, total=256):
    """Logits of one batch of `total` rows run by `strategy` on `device`: `n_decode` decode
    tokens with 20 cached tokens each, then two prompt chunks (none when
    `total` is all decode; random K/V, seeded)."""
    import torch

    from nanosched.runtime.backend import Backend
    from nanosched.runtime.modelprogram import model_program
    from nanosched.runtime.opsched import run_program

    ws = model.new_workspace(max_tokens=total, num_pages=600)
    g = torch.Generator().manual_seed(0)
    for r in range(n_decode):
        ws.kv.plan([(r, 20, False)])
    ws.kv.k.normal_(generator=g)
    ws.kv.v.normal_(generator=g)
    rest = total - n_decode
    halves = [(900, rest // 2, False), (901, rest - rest // 2, False)]
    chunks = [(r, 1, True) for r in range(n_decode)] + [c for c in halves if c[1] > 0]
    meta = ws.kv.plan(chunks)
    ws.token_ids[:total].copy_(torch.randint(0, 100, (total,), generator=g))
    segments, row = [], 0
    for _, n, is_decode in chunks:
        segments.append((row, row + n, is_decode))
        row += n
    program = model_program(model, ws, meta, segments)
    run_program(program, strategy, Backend(device))
    return model.logits(ws, torch.arange(total))


class ShuffledDevice:
    """Queues each stream's launches; `join()` runs them in a random interleaving that
    respects only stream order and event waits. A result that differs from a serial run
    means a missing event."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.queues = {}
        self.done_events = set()
        self.num_events = 0

    def stream(self, name):
        self.queues.setdefault(name, [])
        return name

    def launch(self, stream, fn):
        self.queues[stream].append(("run", fn))

    def record(self, stream):
        self.num_events += 1
        ev = self.num_events
        self.queues[stream].append(("record", ev))
        return ev

    def wait(self, stream, event):
        self.queues[stream].append(("wait", event))

    def join(self):
        while any(self.queues.values()):
            runnable = [s for s, q in self.queues.items()
                        if q and (q[0][0] != "wait" or q[0][1] in self.done_events)]
            assert runnable, "deadlock: every stream waits for an event never recorded"
            kind, item = self.queues[self.rng.choice(runnable)].pop(0)
            if kind == "run":
                item()
            elif kind == "record":
                self.done_events.add(item)


def apply_batch(scheduler, kv, batch):
    """The engine's step after `batch`, without a model: plan it into the cache, emit a token
    per sampler (its index in the output), retire and free the requests that reached
    max_tokens. Returns them."""
    kv.plan([(e.request.request_id, e.num_tokens, e.is_decode) for e in batch.entries])
    done = []
    for e in batch.entries:
        r = e.request
        if not e.is_decode:
            r.num_prefilled += e.num_tokens
        if e.samples:
            r.output_ids.append(len(r.output_ids))
            if len(r.output_ids) == r.params.max_tokens:
                r.finished = True
                done.append(r)
    for r in done:
        kv.release(r.request_id)
    scheduler.retire(done)
    return done
