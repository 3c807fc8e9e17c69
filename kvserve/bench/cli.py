"""The `kvserve bench {throughput,latency,serve}` subcommands; each command's module owns its flags."""

from __future__ import annotations

from kvserve.bench import latency, serve, throughput

_COMMANDS = {
    "throughput": (throughput, "Offline throughput of LLM.generate on a dataset (optionally vs HF generate)."),
    "latency": (latency, "End-to-end latency of one batch: average and percentiles over iterations."),
    "serve": (serve, "Streamed load against any OpenAI-compatible server: TTFT, TPOT, ITL, throughput."),
}


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="Benchmarks: throughput | latency | serve.")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
