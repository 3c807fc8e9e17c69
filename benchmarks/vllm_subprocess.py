"""vLLM in a subprocess of the benchmark that compares against it.

vLLM is importable only on the GPU machine, from the bundle unpacked into VLLM_SITE, and it must not share
a process (or the GPU memory) with kvserve's engines. A benchmark runs its own script again with the
arguments of its vLLM part; `run_part` puts VLLM_SITE first on that process's path (vLLM's workers inherit
it), keeps it offline, and returns the JSON the part wrote with `write_result` to the file named by the
`--result-file` argument it adds. A part that cannot run writes {"not_run": reason} (`unavailable` says
why); a subprocess that wrote nothing is reported the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

VLLM_SITE = "/tmp/vllmsite"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_part(script: str, args: list[str], result_file: str) -> dict:
    """`script` again with `args` and `--result-file result_file`, vLLM's site first on its path; its result."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [VLLM_SITE, REPO, env.get("PYTHONPATH", "")] if p)
    cmd = [sys.executable, os.path.abspath(script), *args, "--result-file", result_file]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, check=False)
    print(f"== vLLM subprocess: rc {proc.returncode} after {time.perf_counter() - t0:.0f} s", flush=True)
    try:
        with open(result_file) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"not_run": f"the vLLM subprocess wrote no result (rc {proc.returncode})"}


def write_result(result_file: str, result: dict) -> None:
    with open(result_file, "w") as f:
        json.dump(result, f, indent=2)


def unavailable(cpu_run: bool) -> str | None:
    """Inside the subprocess: why vLLM cannot run here (None: it can). `cpu_run`: the benchmark runs without
    a GPU on purpose (a dry run)."""
    try:
        import vllm
    except ImportError as e:
        return f"vllm cannot be imported ({e}); unpack the bundle: bash .vllm/install.sh"
    import torch

    if cpu_run or not torch.cuda.is_available():
        return f"vLLM {vllm.__version__} runs on the GPU only"
    return None
