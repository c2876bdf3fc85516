"""GPU primitives that both the profiler and the runtime use (GPU-only modules, imported lazily)."""
