"""bench/analysis/tp_op_cost.py: both profile formats read alike, the grid interpolated, and a
layer whose ops halve exactly at tp = 2 keeps a per-GPU efficiency of 1 without its all-reduces."""

from __future__ import annotations

import json

import pytest

from bench.analysis import tp_op_cost as t

FIELDS = ["op", "tokens", "time_us", "sms", "mechanism", "impl", "context", "best", "modelled",
          "clock_mhz", "power_w"]


def _rows(scale: float) -> list[dict]:
    rows = []
    for tokens in (256, 512, 1024):
        for op in (*t.TOKEN_OPS, "attn_prefill"):
            rows.append({"op": op, "tokens": tokens, "context": 0 if op != "attn_prefill"
                         else 1024, "time_us": tokens * scale, "sms": 132})
        for ctx in (512, 1536):
            rows.append({"op": "attn_decode", "tokens": tokens, "context": ctx,
                         "time_us": tokens * ctx / 1000 * scale, "sms": 132})
    # a slower implementation and a partition's row, which the prices must skip
    rows.append({"op": "ug", "tokens": 512, "context": 0, "time_us": 1e6, "sms": 132})
    rows.append({"op": "ug", "tokens": 512, "context": 0, "time_us": 1.0, "sms": 66})
    return [{"mechanism": "full", "impl": "x", "best": True, "modelled": False,
             "clock_mhz": 1800.0, "power_w": 700.0, **r} for r in rows]


def test_a_layer_that_halves_keeps_one_per_gpu_without_its_all_reduces(tmp_path):
    (tmp_path / "p1.json").write_text(json.dumps({"kernels": _rows(1.0)}))
    partial = {"kernel_fields": FIELDS,
               "kernels": [[r[f] for f in FIELDS] for r in _rows(0.5)]}
    (tmp_path / "p2.partial.json").write_text(json.dumps(partial))
    t1 = t.best_times(t.kernel_rows(tmp_path / "p1.json"))
    t2 = t.best_times(t.kernel_rows(tmp_path / "p2.partial.json"))
    assert t1[("ug", 512, 0)] == 512.0
    assert t.op_us(t1, "attn_decode", 384, 1024) == pytest.approx(384 * 1.024)
    assert t.op_us(t1, "kqv", 768, 0) == pytest.approx(768)
    rows = t.layer(t1, t2, 1024, 256, 1024, ar_us=50.0)
    assert all(r["per_gpu_ratio"] == pytest.approx(1.0) for r in rows if r["per_gpu_ratio"])
    tp1, tp2 = sum(r["tp1_us"] for r in rows), sum(r["tp2_us"] for r in rows)
    assert tp1 == pytest.approx(2 * (tp2 - 100.0))


def test_nccl_rows_are_priced_by_bytes(tmp_path):
    rec = {"alone": [{"impl": "nccl", "T": 512, "us": 50.0},
                     {"impl": "nccl", "T": 2048, "us": 140.0},
                     {"impl": "copy_engine", "T": 512, "us": 1.0}]}
    (tmp_path / "ce.json").write_text(json.dumps(rec))
    # [1024, 4096] bf16 is the bytes of [512, 8192]
    assert t.nccl_us(tmp_path / "ce.json", 1024 * t.HIDDEN * 2) == pytest.approx(50.0)
    assert t.nccl_us(tmp_path / "ce.json", 1280 * 8192 * 2) == pytest.approx(95.0)
