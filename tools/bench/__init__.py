"""Benchmarks of the engine, quantization, speculation, the mesh and its routing, each runnable
as ``python -m tools.bench.<name>``; ``hops`` breaks a request's TTFT down by trace span."""
