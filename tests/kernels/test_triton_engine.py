"""The GPU code path (Triton attention + fused kernels) on a tiny model, run on the CPU through Triton's
interpreter: greedy tokens identical to the torch reference path, with a prefix hit, chunked prefill and
preemption in the same run.

TRITON_INTERPRET must be set before triton is imported, so the triton run happens in a subprocess; the
reference run (torch attention, unfused torch elementwise ops) happens here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.engine.test_scheduling_features import _shared_prefix_prompts  # noqa: E402

ENGINE_KWARGS = dict(
    max_model_len=192, num_gpu_blocks_override=24, max_num_batched_tokens=16, max_num_seqs=4,
    enable_prefix_caching=True, block_size=8,
)
MAX_TOKENS = 6

SCRIPT = r"""
import json, sys
from kvserve import LLM, SamplingParams
path, backend, kwargs, prompts, max_tokens = json.loads(sys.stdin.read())
llm = LLM(path, attention_backend=backend, **kwargs)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
s = llm.llm_engine.get_stats()
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "preemptions": s.num_preemptions,
                  "prefix_hits": s.prefix_cache_hits}))
"""


def _run(path, backend, prompts, interpret: bool):
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"}
    payload = json.dumps([path, backend, ENGINE_KWARGS, prompts, MAX_TOKENS])
    proc = subprocess.run([sys.executable, "-c", SCRIPT], input=payload, capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_path_matches_torch_path(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    prompts = _shared_prefix_prompts(5, seed=11)
    reference = _run(path, "torch", prompts, interpret=False)
    triton_run = _run(path, "triton", prompts, interpret=True)
    assert reference["preemptions"] > 0 and reference["prefix_hits"] > 0
    assert triton_run["preemptions"] > 0 and triton_run["prefix_hits"] > 0
    assert triton_run["tokens"] == reference["tokens"]
