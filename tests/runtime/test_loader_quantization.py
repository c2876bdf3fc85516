"""A schedule runs only on the weights it was searched on: the engine's `--schedule FILE` of
another quantization is refused before any weight loads, naming both; `auto` picks only a
shipped set of the engine's quantization; `verify` builds the set's quantised model."""

from __future__ import annotations

import json

import pytest
import torch
from runtime_helpers import DATA

from nanosched.errors import ScheduleError
from nanosched.models.spec import load_spec
from nanosched.runtime import loader
from nanosched.runtime.choice import engine_quantization
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.strategies import Sequential
from nanosched.schedules.shipped import pick_shipped_schedule

SCHEDULE = DATA / "tiny_llama_schedule.json"  # tiny, tp=1, dense batch 256, synthetic-h100


@pytest.fixture()
def config_only(tmp_path):
    (tmp_path / "config.json").write_text((DATA / "tiny_llama_config.json").read_text())
    return str(tmp_path / "config.json")


@pytest.fixture()
def fp8_schedule(tmp_path):
    path = tmp_path / "fp8.schedule.json"
    path.write_text(json.dumps({**json.loads(SCHEDULE.read_text()), "quantization": "fp8"}))
    return str(path)


def test_a_schedule_of_other_weights_is_refused_before_the_weights_load(config_only,
                                                                       fp8_schedule,
                                                                       monkeypatch):
    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the schedule was checked")

    monkeypatch.setattr(loader, "load_model", no_weights)
    for quantization in ("none", "auto"):  # auto: random weights are unquantised
        with pytest.raises(ScheduleError, match="quantization: schedule was searched on a "
                                                "profile of 'fp8' weights, running "
                                                "--quantization none"):
            loader.load_engine(EngineConfig(model=config_only, device="cpu",
                                            schedule=fp8_schedule, quantization=quantization))
    # an unquantised schedule on FP8 weights, likewise
    with pytest.raises(ScheduleError, match="of 'none' weights, running --quantization fp8"):
        loader.load_engine(EngineConfig(model=config_only, device="cpu", schedule=str(SCHEDULE),
                                        quantization="fp8"))


def test_forced_past_names_the_quantization_and_a_match_passes(config_only, fp8_schedule):
    spec, cpu = load_spec(config_only), torch.device("cpu")

    def forced(quantization):
        cfg = EngineConfig(model=config_only, schedule=fp8_schedule, force=True,
                           quantization=quantization)
        return [r.split(":")[0] for r in loader.choose_strategy(cfg, spec, cpu).forced_past]

    assert "gpu" in forced("fp8") and "quantization" not in forced("fp8")
    assert forced("none") == [*forced("fp8"), "quantization"]


def test_engine_quantization_resolves_auto_before_the_weights_load(config_only):
    assert engine_quantization(EngineConfig(model=config_only)) == "none"
    assert engine_quantization(EngineConfig(model=config_only, quantization="fp8")) == "fp8"
    assert engine_quantization(EngineConfig()) == "none"


def test_auto_picks_only_shipped_sets_of_the_engines_weights():
    spec = load_spec("llama3-8b")
    pick = pick_shipped_schedule(spec, 1, "NVIDIA H100 80GB HBM3", quantization="fp8")
    assert pick.schedule is None and "with fp8 weights" in pick.reason
    cfg = EngineConfig(model="llama3-8b", schedule="auto", quantization="fp8")
    choice = loader.choose_strategy(cfg, spec, torch.device("cpu"))
    assert isinstance(choice.strategy, Sequential)


def test_verify_builds_the_sets_quantised_model(tmp_path, monkeypatch):
    from dataclasses import replace

    from search_fixtures import small_schedule

    from nanosched.benchmarks.verify import run_verify
    from nanosched.schedules.format import save_schedule

    path = tmp_path / "fp8.json"  # llama3-8b: a pipeline `verify` would time
    save_schedule(replace(small_schedule(), quantization="fp8"), path)

    seen = {}

    class Built(Exception):
        pass

    def capture(spec, weights, device, *a, quantization="auto", **k):
        seen["quantization"] = quantization
        raise Built

    monkeypatch.setattr(loader, "load_model", capture)
    with pytest.raises(Built):
        run_verify(str(path), str(tmp_path / "out.json"), "cpu", echo=lambda _: None)
    assert seen == {"quantization": "fp8"}
