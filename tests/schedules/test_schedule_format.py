import json

import pytest
from search_fixtures import small_schedule

from nanosched.errors import ScheduleError
from nanosched.models.spec import load_spec
from nanosched.schedules.format import (
    Schedule,
    check_compatible,
    load_schedule,
    save_schedule,
)


def test_round_trip_unchanged(tmp_path):
    sched = small_schedule()
    path = tmp_path / "s.json"
    save_schedule(sched, path)
    again = load_schedule(path)
    assert again == sched
    assert again.to_json() == sched.to_json() == json.loads(path.read_text())
    assert not list(tmp_path.glob(".*tmp"))


def _first(data, op):
    return next(n for n in data["nano_ops"] if n["op"] == op)


def _cycle(d):
    """kqv.0 waits (same layer) on the last nano-op of the layer (all in one period; resource
    waits on the next layer's nano-ops, shift -1, dropped, and every start moved into the first
    period as layer offset 0 requires, so the cycle is the first fault)."""
    kqv = _first(d, "kqv")
    kqv["deps"].append({"id": d["nano_ops"][-1]["id"], "shift": 0, "kind": "data"})
    for n in d["nano_ops"]:
        n["layer_offset"] = 0
        n["start_us"] = 0.0
        n["deps"] = [dep for dep in n["deps"] if dep["shift"] >= 0]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="x/9"), "format is 'x/9'"),
    (lambda d: d.pop("batch"), r"missing field\(s\) \['batch'\]"),
    (lambda d: d["nano_ops"][0].update(colour=1), r"unknown field\(s\) \['colour'\]"),
    (lambda d: d["ranges"]["ug"].__setitem__(0, [0, 200]),
     r"ranges\[ug\]: .* covering \[0, 768\) without overlap"),
    (lambda d: _first(d, "o")["deps"].append({"id": "nope.7", "shift": 0, "kind": "data"}),
     r"nano_ops\[o.0\].deps: 'nope.7' does not exist"),
    (_cycle, "form a cycle within a period"),
    (lambda d: _first(d, "kqv").update(order=99), r"streams\[compute\]: issue orders .* not a "
                                                  "permutation"),
    (lambda d: _first(d, "kqv").update(stream="memory"), "compute op cannot run on the memory"),
    (lambda d: [n["alloc"].update(share=1.0) for n in d["nano_ops"]],
     r"nano_ops.alloc: GPU capacity exceeded at [0-9.]+ us"),
])
def test_bad_schedules_name_the_first_problem(tmp_path, mutate, message):
    data = small_schedule().to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match=message):
        load_schedule(path)


def test_other_model_tp_or_gpu_is_refused_with_the_reason():
    sched = small_schedule()
    spec = load_spec("llama3-8b")
    assert check_compatible(sched, spec, 1, "NVIDIA H100 80GB HBM3") == []
    with pytest.raises(ScheduleError, match="model: schedule is for 'llama3-8b'.*running "
                                            "'llama3-70b'"):
        check_compatible(sched, load_spec("llama3-70b"), 1, "h100")
    with pytest.raises(ScheduleError, match="tp: schedule is for tp=1, running tp=2"):
        check_compatible(sched, spec, 2, "h100")
    with pytest.raises(ScheduleError, match="gpu: schedule is for 'synthetic-h100', running on "
                                            "'NVIDIA A100"):
        check_compatible(sched, spec, 1, "NVIDIA A100-SXM4-80GB")
    reasons = check_compatible(sched, spec, 2, "a100", force=True)
    assert [r.split(":")[0] for r in reasons] == ["tp", "gpu"]


def test_not_json_and_missing_file(tmp_path):
    with pytest.raises(ScheduleError, match="does not exist"):
        load_schedule(tmp_path / "none.json")
    (tmp_path / "cut.json").write_text("{")
    with pytest.raises(ScheduleError, match="not valid JSON"):
        load_schedule(tmp_path / "cut.json")
    with pytest.raises(ScheduleError, match="expected a JSON object"):
        Schedule.from_json([1])
