"""Kernel and interference profiling on the GPU, and the profile contract (`format`)."""
