"""vLLM 0.26.0 on W2 with the Gemma-3-12B text shape: the baseline of benchmarks/gpu_w2_gemma.py (`--vllm-json`).

GPU machine, after the vLLM bundle is unpacked (bash .vllm/install.sh; BENCHMARKS.md says how the bundle travels):

    OUT=$OUT python3 benchmarks/vllm_w2_gemma.py [--passes 1]

It runs the bundle's own `vllm_bench.py` (imported from .vllm/, not copied) with one more shape, W2_CONFIG from
kvserve/bench/datasets.py (the dummy-weight model kvserve's W2 run loads), and its W2 workload
(make_long_workload(): the same 64 requests as kvserve's w2_requests()), `--latency-in 8192` for the TTFT and
batch-1 rows at 8k. The result is $OUT/vllm_bench_w2_gemma.json, in the bundle script's keys.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, ".vllm"), REPO]

import vllm_bench  # noqa: E402  (the bundle's script; importing it needs no vllm)

from kvserve.bench.datasets import W2_CONFIG, W2_MAX_MODEL_LEN  # noqa: E402

SHAPE = "gemma3-12b-text"
vllm_bench.SHAPES[SHAPE] = W2_CONFIG
MODEL_DIR = "/tmp/gemma3_12b_text"  # the dummy model's config, written by the bundle script
vllm_bench.MODEL_DIR = MODEL_DIR
assert vllm_bench.WORKLOADS["w2"][1] == W2_MAX_MODEL_LEN

if __name__ == "__main__":
    given = sys.argv[1:]
    if "--shape" not in given:  # the bundle script re-executes itself with these same arguments
        sys.argv[1:] = ["--shape", SHAPE, "--workload", "w2", "--latency-in", "8192", "--tag", "_w2_gemma"] + given
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)  # the bundle script writes its JSON there, after the run
    vllm_bench.main()
