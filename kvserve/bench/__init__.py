"""Benchmarks behind `kvserve bench throughput | latency | serve` (datasets, metrics, HTTP client, plots).

Nothing here is imported by the engine; the subcommands import what they need lazily.
"""
