"""The runtime: the scheduler API, strategies, executor, engine and server. It reads schedules,
never the search (tests/test_layering.py)."""
