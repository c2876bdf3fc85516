"""The runtime: the scheduler API, strategies, streams and CUDA graphs, the engine and its loader,
the server. It reads schedules, never the search that makes them."""
