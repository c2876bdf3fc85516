"""Benchmark harnesses: `nanosched bench` (throughput.py), the per-strategy forward timeline
(timeline.py) and their shared helpers (common.py). They may import the search (to predict
what they measure); the runtime never imports them."""
