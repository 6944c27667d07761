"""A load generator and report for OpenAI-compatible streaming servers.

``python -m loadtest run`` sends a bounded load (Poisson arrivals at a rate, a fixed
concurrency, or a sweep of rates) and writes every request's timings and a summary to JSON;
``report`` plots result files; ``compare`` puts two of them side by side.
"""
