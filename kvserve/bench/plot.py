"""`bench serve --plot FILE.png`: TTFT and ITL distributions and output throughput over time, one figure.

matplotlib is an optional extra (`pip install 'kvserve[plot]'`); check_available() lets the command
fail before the benchmark runs rather than after.
"""

from __future__ import annotations

from kvserve.bench.metrics import RequestResult, output_throughput_over_time

INSTALL_HINT = "--plot needs matplotlib: pip install 'kvserve[plot]' (or pip install matplotlib)."


def check_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ValueError(INSTALL_HINT) from e


def save_plot(results: list[RequestResult], duration: float, path: str, title: str = "") -> None:
    check_available()
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in results if r.success]
    ttft_ms = [r.ttft * 1000 for r in ok]
    itl_ms = [g * 1000 for r in ok for g in r.itl]
    times, tok_s = output_throughput_over_time(results, duration)

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=90)
    for ax, values, color, name, unit in ((axes[0], ttft_ms, "tab:blue", "Time to first token", "requests"),
                                          (axes[1], itl_ms, "tab:orange", "Inter-token latency", "gaps")):
        ax.hist(values, bins=40, color=color)
        if values:
            median = float(np.median(values))
            p99 = float(np.percentile(values, 99))
            ax.axvline(median, color="black", linestyle="--", linewidth=1, label=f"median {median:.1f} ms")
            ax.axvline(p99, color="black", linestyle=":", linewidth=1, label=f"P99 {p99:.1f} ms")
            ax.legend(fontsize=8)
        ax.set(title=name, xlabel="ms", ylabel=unit)
    if times:
        step = times[1] - times[0] if len(times) > 1 else duration
        axes[2].step([t + step for t in times], tok_s, where="pre", color="tab:green")
    axes[2].set(title="Output throughput", xlabel="s since start", ylabel="tokens/s")
    axes[2].set_ylim(bottom=0)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
