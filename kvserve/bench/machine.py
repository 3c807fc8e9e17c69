"""One line naming the machine a number was measured on (a benchmark result means little without it)."""

from __future__ import annotations

import os
import platform


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(device: str = "cpu") -> str:
    """'NVIDIA H200 (1 GPU), torch 2.11' or 'AMD EPYC, 2 cores, 2 torch threads (2 inter-op), torch 2.13.0+cpu'."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return f"{name} ({torch.cuda.device_count()} GPU visible), torch {torch.__version__}"
    env = ", ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ)
    return (f"{_cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads "
            f"({torch.get_num_interop_threads()} inter-op{', ' + env if env else ''}), torch {torch.__version__}")
