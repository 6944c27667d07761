"""Benchmarks, distillation and the GPU check: programs run by hand (``python -m tools.<...>``),
not part of the runtime (``gpu/``) or of any service (``services/``)."""
