"""nanosched: profile a GPU, search a nano-batch pipeline, replay it when serving."""

__version__ = "0.1.0"
