"""The op table (models/ops.py): each op's name spelled in at most 4 files of nanosched/, the
facts other packages keep agreeing with it, and a new op (a Qwen3-style QK-norm) added as one
entry, priced by the cost model, placed in the op graph and known to the schedule validator."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from nanosched.autosearch.opgraph import Edge, layer_graph
from nanosched.errors import ScheduleError
from nanosched.hardware import get_gpu
from nanosched.kernels import impls as kernel_impls
from nanosched.models import ops
from nanosched.models.costmodel import BatchMix, op_costs, op_demands
from nanosched.models.spec import load_spec
from nanosched.schedules import validate

ROOT = Path(__file__).resolve().parents[2] / "nanosched"
MAX_FILES = 4


def literal_files(root: Path, names: tuple[str, ...]) -> dict[str, set[str]]:
    """name -> the files under `root` holding a string literal equal to it (comments, prose
    inside longer strings and identifiers are not literals)."""
    out: dict[str, set[str]] = {n: set() for n in names}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value in out:
                out[node.value].add(str(path.relative_to(root)))
    return out


def test_each_op_name_is_a_literal_in_at_most_four_files():
    over = {n: sorted(f) for n, f in literal_files(ROOT, ops.ALL_NAMES).items()
            if len(f) > MAX_FILES}
    assert over == {}


def test_the_counter_sees_a_planted_literal(tmp_path):
    pkg = tmp_path / "nanosched"
    pkg.mkdir()
    for i in range(MAX_FILES + 1):
        (pkg / f"m{i}.py").write_text(f"OP = {ops.KQV!r}  # {ops.ROPE_APPEND}\n")
    found = literal_files(pkg, (ops.KQV, ops.ROPE_APPEND))
    assert len(found[ops.KQV]) == MAX_FILES + 1 and found[ops.ROPE_APPEND] == set()


def test_the_kernels_families_are_the_tables():
    """kernels/ may not import models/ (tests/test_layering.py), so it keeps its own map of
    op -> implementation family: it must say what the table says, plus the all-reduces."""
    assert kernel_impls.OP_FAMILY == {**ops.OP_FAMILY,
                                      **{c: kernel_impls.NETWORK for c in ops.COLLECTIVES}}


def test_every_op_has_a_cost_and_a_kernel_or_a_collective_group():
    for op in ops.OPS:
        assert op.cost is not None
        assert (op.family is None) == (op.collective is not None), op.name
        assert (op.gemm is None) != (op.bytes is None) or op.collective, op.name


QK_NORM = "qk_norm"


def _qk_norm_cost(spec, tp, mix, s8):
    rows = mix.dense_batch * (spec.num_heads + spec.num_kv_heads)
    return 4.0 * rows * spec.head_dim, 2.0 * rows * spec.head_dim * spec.dtype_bytes, 0.0


@pytest.fixture
def with_qk_norm(monkeypatch):
    """The table with one more entry: RMSNorm of q and k per head, between kqv and rope."""
    entry = ops.OpSpec(QK_NORM, ops.OTHER, lambda spec: "RMSNorm of q and k per head",
                       ("qkv",), ("qkv",), ((ops.KQV, 0),), cost=_qk_norm_cost,
                       bytes=lambda spec, tp, t, c: 0.0, family=ops.ELEMENTWISE)
    table = []
    for op in ops.OPS:
        if op.name == ops.ROPE_APPEND:  # the op that read kqv's output now reads the norm's
            op = dataclasses.replace(op, inputs=((QK_NORM, 0),))
        table.append(op)
        if op.name == ops.KQV:
            table.append(entry)
    table = tuple(table)
    monkeypatch.setattr(ops, "OPS", table)
    monkeypatch.setattr(ops, "BY_NAME", {op.name: op for op in table})
    monkeypatch.setattr(ops, "ALL_NAMES", ops.all_names(table))


def test_a_new_op_is_one_table_entry(with_qk_norm):
    spec = load_spec("llama3-8b")
    names = [op.name for op in ops.layer_ops(spec)]
    assert names[:3] == [ops.KQV, QK_NORM, ops.ROPE_APPEND]
    mix = BatchMix(1024, 256, 768, 1500.0, 700.0, 260)
    flops, mem, net = op_demands(spec, 1, mix, QK_NORM)
    assert flops > 0 and mem > 0 and net == 0
    priced = {c.name: c for c in op_costs(spec, get_gpu("h100"), 1, mix)}
    assert priced[QK_NORM].flops == flops * spec.num_layers
    edges = {(e.src, e.dst, e.shift) for e in layer_graph(spec, 1).edges}
    assert {(ops.KQV, QK_NORM, 0), (QK_NORM, ops.ROPE_APPEND, 0)} <= edges
    assert (ops.KQV, ops.ROPE_APPEND, 0) not in edges
    validate._check_ranges(_ranges({QK_NORM: [(0, 128)]}), "schedule")
    assert validate.op_domain(QK_NORM, 1024, 256) == (0, 1024)


def test_without_the_entry_the_validator_refuses_the_op():
    with pytest.raises(ScheduleError, match=QK_NORM):
        validate._check_ranges(_ranges({QK_NORM: [(0, 128)]}), "schedule")


def test_edges_come_from_the_table_inputs():
    spec = load_spec("llama3-8b")
    g = layer_graph(spec, 1)
    assert Edge(ops.ADD_NORM_ATTN, ops.KQV, 1) in g.edges
    assert Edge(ops.ROPE_APPEND, ops.ATTN_PREFILL, 0, "prompt") in g.edges


def _ranges(ranges):
    return SimpleNamespace(ranges=ranges, batch=SimpleNamespace(dense_batch=128, num_decode=0))
