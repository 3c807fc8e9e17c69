"""Serving metrics from per-request timings, with vLLM's definitions (benchmarks/serve.py):

- TTFT: request sent -> first streamed chunk carrying output.
- ITL: the gaps between consecutive output chunks of one request (all gaps of all requests pooled).
- TPOT: (E2E - TTFT) / (output_tokens - 1), per request with more than one output token.
- E2E latency: request sent -> last output chunk.
Throughputs divide token counts of successful requests by the benchmark's wall time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

METRIC_NAMES = {  # key -> (short name, section header), in vLLM's print order
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class RequestResult:
    """What one streamed request gave. Times are seconds; start_time is relative to the benchmark start."""

    success: bool = False
    prompt_len: int = 0  # the server's usage.prompt_tokens when given, else the dataset's count
    output_tokens: int = 0  # usage.completion_tokens when given, else counted on the client
    ttft: float = 0.0
    latency: float = 0.0  # E2E
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # relative to the benchmark start
    generated_text: str = ""
    error: str = ""


def tpot(result: RequestResult) -> float | None:
    """Mean time per output token after the first; undefined for a single-token reply."""
    if result.output_tokens <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


@dataclass
class Distribution:
    """One latency metric in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, seconds: list[float], percentiles: list[float]) -> Distribution:
        import numpy as np

        if not seconds:  # e.g. no request had two chunks: report zeros, as vLLM does
            return cls(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {p: float(np.percentile(ms, p)) for p in percentiles})


@dataclass
class ServingMetrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_output_throughput: float
    latencies: dict[str, Distribution]  # keys of METRIC_NAMES


def output_throughput_over_time(results: list[RequestResult], duration: float,
                                bin_s: float | None = None) -> tuple[list[float], list[float]]:
    """(bin start times, output tokens/s per bin). A request's tokens are spread evenly over its chunks,
    so servers that pack several tokens in a chunk still add up to the reported totals."""
    import numpy as np

    if bin_s is None:
        bin_s = max(duration / 50, 0.05) if duration > 0 else 1.0
    n_bins = max(1, math.ceil(duration / bin_s)) if duration > 0 else 1
    tokens = np.zeros(n_bins)
    for r in results:
        if not r.success or not r.chunk_times:
            continue
        per_chunk = r.output_tokens / len(r.chunk_times)
        for t in r.chunk_times:
            tokens[min(int(t / bin_s), n_bins - 1)] += per_chunk
    return [i * bin_s for i in range(n_bins)], (tokens / bin_s).tolist()


def calculate_metrics(results: list[RequestResult], duration: float,
                      percentiles: list[float] = (99,)) -> ServingMetrics:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in map(tpot, ok) if t is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    _, per_second = output_throughput_over_time(results, duration, bin_s=1.0)  # vLLM's peak: 1 s buckets
    safe = duration if duration > 0 else float("inf")
    return ServingMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration=duration,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / safe,
        output_throughput=total_output / safe,
        total_token_throughput=(total_input + total_output) / safe,
        peak_output_throughput=max(per_second, default=0.0),
        latencies={k: Distribution.of(v, list(percentiles)) for k, v in samples.items()},
    )


def _pct_word(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def format_report(m: ServingMetrics, request_rate: float | None = None, max_concurrency: int | None = None) -> str:
    """vLLM's "Serving Benchmark Result" block, line for line (so existing log parsers keep working)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt=""):
        lines.append("{:<40} {:<10{fmt}}".format(label, value, fmt=fmt))

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate is not None:
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", m.duration, ".2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", m.peak_output_throughput, ".2f")
    row("Total Token throughput (tok/s):", m.total_token_throughput, ".2f")
    for key, (name, header) in METRIC_NAMES.items():
        d = m.latencies[key]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", d.mean, ".2f")
        row(f"Median {name} (ms):", d.median, ".2f")
        for p, v in d.percentiles.items():
            row(f"P{_pct_word(p)} {name} (ms):", v, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def metrics_json(m: ServingMetrics) -> dict:
    """Flat keys as vLLM's result JSON names them (mean_ttft_ms, p99_itl_ms, ...)."""
    out = {
        "duration": m.duration, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput, "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput, "max_output_tokens_per_s": m.peak_output_throughput,
    }
    for key, d in m.latencies.items():
        out[f"mean_{key}_ms"] = d.mean
        out[f"median_{key}_ms"] = d.median
        out[f"std_{key}_ms"] = d.std
        for p, v in d.percentiles.items():
            out[f"p{_pct_word(p)}_{key}_ms"] = v
    return out
