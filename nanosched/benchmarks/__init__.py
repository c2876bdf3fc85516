"""Benchmark harnesses that run the engine and compare it with the search's predictions: they
may import both the runtime and the search, which the runtime itself never does."""
