"""The engine loader on the CPU: weights, dtype, dense batch, KV pages, EOS and the strategy
that `--schedule` names, a mismatched schedule refused before any weight loads."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_models import make_hf
from runtime_helpers import DATA

from nanosched.constants import DEFAULT_NUM_SMS, PAGE_SIZE
from nanosched.errors import ConfigError, ScheduleError
from nanosched.models.spec import load_spec
from nanosched.runtime import loader
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.requests import Request, SamplingParams
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap
from nanosched.runtime.strategies.replay_set import ReplaySet

SCHEDULE = str(DATA / "tiny_llama_schedule.json")  # tiny, tp=1, dense batch 256, synthetic-h100


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    make_hf("llama", folder, seed=3, eos_token_id=7)
    return folder


@pytest.fixture()
def config_only(tmp_path):
    (tmp_path / "config.json").write_text((DATA / "tiny_llama_config.json").read_text())
    return str(tmp_path / "config.json")


def test_checkpoint_folder_loads_its_weights_in_fp32_with_its_eos(hf_folder):
    req = Request(0, [1, 2, 3], SamplingParams(max_tokens=40))
    with loader.load_engine(EngineConfig(model=str(hf_folder), device="cpu"),
                            requests=[req]) as loaded:
        c, model = loaded.config, loaded.model
        assert model.dtype == torch.float32 and model.device.type == "cpu"
        assert c.dense_batch == loader.DEFAULT_DENSE_BATCH["cpu"] == 256
        assert c.num_pages == -(-43 // PAGE_SIZE) + 1  # what the one request can ever need
        assert c.max_context == 43 and c.eos_ids == frozenset({7}) and c.graphs == "off"
        assert isinstance(loaded.engine.strategy, Sequential) and loaded.streams is None
        assert loaded.engine.config is c and loaded.engine.eos_ids == {7}
    from safetensors.torch import load_file

    emb = load_file(next(hf_folder.glob("*.safetensors")))["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens[: emb.shape[0]], emb.float())


def test_weights_random_unless_a_folder_holds_safetensors(hf_folder, config_only):
    assert loader.resolve_weights(str(hf_folder), None) == str(hf_folder)
    assert loader.resolve_weights(str(hf_folder), "random") == "random"
    assert loader.resolve_weights(config_only, None) == "random"
    assert loader.resolve_weights("llama3-8b", None) == "random"


def test_schedule_strategies(config_only):
    spec = load_spec(config_only)
    cpu = torch.device("cpu")

    def choose(schedule, **kw):
        return loader.choose_strategy(EngineConfig(schedule=schedule, **kw), spec, cpu)

    assert isinstance(choose("sequential").strategy, Sequential)
    two = choose("two_batch")
    assert isinstance(two.strategy, TwoBatchOverlap) and two.strategy.num_sms == DEFAULT_NUM_SMS
    auto = choose("auto")  # nothing is shipped for this tiny model
    assert isinstance(auto.strategy, Sequential) and auto.schedule is None
    forced = choose(SCHEDULE, force=True)
    assert isinstance(forced.strategy, ReplaySet) and forced.dense_batch == 256
    assert "gpu" in [r.split(":")[0] for r in forced.forced_past]
    assert forced.name == f"replay:{SCHEDULE}"


def test_a_strategy_is_its_registry_entry(config_only, monkeypatch):
    """`--schedule NAME` builds whatever strategies.NAMED registers under NAME, for the GPU's
    SM count, and a tensor-parallel worker rebuilds it from its name alone."""
    from nanosched.runtime import choice, strategies

    spec, cpu = load_spec(config_only), torch.device("cpu")
    assert set(strategies.NAMED) == {"sequential", TwoBatchOverlap.name}

    class Halves(TwoBatchOverlap):
        name = "halves"

        @classmethod
        def for_gpu(cls, num_sms):
            return cls(num_sms=num_sms // 2)

    monkeypatch.setitem(strategies.NAMED, Halves.name, Halves)
    picked = loader.choose_strategy(EngineConfig(schedule="halves"), spec, cpu)
    assert isinstance(picked.strategy, Halves) and picked.name == "halves"
    assert picked.strategy.num_sms == DEFAULT_NUM_SMS // 2 and picked.schedule is None
    again = choice.named_choice(picked.name, None, spec, cpu)
    assert isinstance(again.strategy, Halves) and again.name == "halves"
    monkeypatch.delitem(strategies.NAMED, Halves.name)
    with pytest.raises(ScheduleError, match="schedule halves does not exist"):  # a file name now
        loader.choose_strategy(EngineConfig(schedule="halves"), spec, cpu)


def test_a_mismatched_schedule_is_refused_before_the_weights_load(config_only, monkeypatch):
    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the schedule was checked")

    monkeypatch.setattr(loader, "load_model", no_weights)
    with pytest.raises(ScheduleError, match="schedule is for 'synthetic-h100', running on "
                                            "'cpu'"):
        loader.load_engine(EngineConfig(model=config_only, device="cpu", schedule=SCHEDULE))
    with pytest.raises(ConfigError, match="--dense-batch 128 differs from the schedule's 256"):
        loader.load_engine(EngineConfig(model=config_only, device="cpu", schedule=SCHEDULE,
                                        force=True, dense_batch=128))
    with pytest.raises(ConfigError, match="--graphs on needs a CUDA GPU"):
        loader.load_engine(EngineConfig(model=config_only, device="cpu", graphs="on"))


def test_forced_schedule_replays_with_its_dense_batch(config_only):
    with loader.load_engine(EngineConfig(model=config_only, device="cpu", schedule=SCHEDULE,
                                         force=True, graphs="auto")) as loaded:
        assert loaded.config.dense_batch == 256 and loaded.config.graphs == "off"
        assert isinstance(loaded.engine.strategy, ReplaySet)
        assert loaded.config.eos_ids == frozenset()  # the config.json names none
        assert loaded.config.max_context is None  # unknown requests: the model's positions
        assert loaded.engine.scheduler.max_context == 512


def test_one_model_many_engines(config_only):
    spec = load_spec(config_only)
    model = loader.load_model(spec, "random", torch.device("cpu"), seed=1)
    cfg = EngineConfig(model=config_only, dense_batch=32, num_pages=20)
    outs = []
    for schedule in ("sequential", "two_batch"):
        choice = loader.choose_strategy(EngineConfig(schedule=schedule), spec, model.device)
        with loader.build_engine(model, cfg, choice) as loaded:
            req = Request(0, list(range(5, 25)), SamplingParams(max_tokens=5, ignore_eos=True))
            loaded.engine.add_request(req)
            with torch.inference_mode():
                loaded.engine.run_to_completion()
            assert loaded.config.num_pages == 20 and loaded.config.dense_batch == 32
            outs.append(req.output_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 5


def test_loaded_engine_closes_its_partitions_once(config_only):
    class Streams:
        closed = 0

        def close(self):
            self.closed += 1

    streams = Streams()
    loaded = loader.LoadedEngine(None, EngineConfig(), None, None, streams)
    with loaded:
        pass
    loaded.close()
    assert streams.closed == 1 and loaded.streams is None


def test_engine_config_refuses_nonsense():
    with pytest.raises(ConfigError, match="--dense-batch must be positive, got 0"):
        EngineConfig(dense_batch=0)
    with pytest.raises(ConfigError, match="page_size must be at least 1"):
        EngineConfig(page_size=0)
    with pytest.raises(ConfigError, match="mem_util must be in"):
        EngineConfig(mem_util=1.5)
    with pytest.raises(ConfigError, match="EngineConfig.model is not set"):
        loader.load_engine(EngineConfig())


@pytest.mark.slow
def test_serving_imports_no_benchmark_or_search_code():
    code = ("import sys, nanosched.runtime.server.startup, nanosched.runtime.generate\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('nanosched.benchmarks', "
            "'nanosched.autosearch', 'ortools')))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent)


def test_generate_through_the_engine_matches_hf_greedy(hf_folder, tmp_path):
    from nanosched.runtime.generate import GenerateConfig, generate

    folder = shutil.copytree(hf_folder, tmp_path / "noeos")
    cfg = GenerateConfig(EngineConfig(model=str(folder), device="cpu", eos_ids=frozenset()),
                         prompt_ids=(5, 9, 2, 77), max_tokens=5)
    res = generate(cfg)
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    seq = [5, 9, 2, 77]
    with torch.no_grad():
        for _ in range(5):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    assert res.output_ids == seq[4:] and not res.random_weights


def test_kv_pages_size_this_ranks_shard_of_the_cache():
    """At tp = 2 a rank's page holds its half of the KV heads: twice the pages fit the same
    memory (the CPU path: 1 GiB of cache at most, all of it used by long requests)."""
    from nanosched.models.model import CausalLM
    from nanosched.models.parallel import TensorParallel

    spec = load_spec("stories15m")
    reqs = [Request(i, [1] * 200, SamplingParams(max_tokens=spec.max_position_embeddings - 200))
            for i in range(4000)]
    pages = [loader.kv_pages(CausalLM(spec, tp=TensorParallel(0, tp)), 256, PAGE_SIZE, 0.9,
                             reqs) for tp in (1, 2)]
    assert 2 * pages[0] <= pages[1] <= 2 * pages[0] + 1  # 1 GiB // page bytes, floored


TINY_MOE = dict(name="tiny-moe", arch="mixtral", hidden_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=100,
                num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("moe_fp8", [False, True])
def test_reserve_counts_the_buffers_a_workspace_allocates(moe_fp8):
    """The memory kept beside weights and KV pages counts a workspace's activation buffers
    exactly (laid out on the meta device), the logits of a full batch of sampled rows, the
    sampler's chunked temporaries and the fixed margin."""
    from nanosched.models.model import CausalLM
    from nanosched.models.spec import ModelSpec
    from nanosched.runtime.sampling import transient_bytes

    if moe_fp8:
        spec = ModelSpec(**TINY_MOE)
        model = CausalLM(spec, dtype=torch.bfloat16, quantization="fp8")
    else:
        spec = load_spec("stories15m")
        model = CausalLM(spec)
    ws = model.new_workspace(384, 4)
    allocated = sum(t.numel() * t.element_size() for t in vars(ws).values()
                    if isinstance(t, torch.Tensor))
    assert model.buffer_bytes(384) == allocated > 0
    logits = 384 * spec.vocab_size * model.dtype.itemsize
    assert loader.reserve_bytes(model, 384) == (allocated + logits + loader.RESERVE_MARGIN
                                                + transient_bytes(384, spec.vocab_size))
