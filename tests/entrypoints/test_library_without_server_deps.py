"""The library and the CLI parser run without the server's dependencies (fastapi, uvicorn, pydantic,
starlette) and without gguf (needed for .gguf files only): the GPU image has torch, triton and transformers
but not those, and `pytest -m gpu` must run there. A subprocess whose import system refuses them builds
every `kvserve` command's parser and runs `LLM.generate` on a tiny HF checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

NOT_ON_GPU_IMAGE = ("fastapi", "uvicorn", "pydantic", "starlette", "gguf")

SCRIPT = r"""
import importlib.abc, json, sys
blocked = set(sys.argv[2].split(","))

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is not installed here")

sys.meta_path.insert(0, Refuse())
from kvserve import LLM, SamplingParams
from kvserve.entrypoints.cli import build_parser

ns = build_parser().parse_args(["bench", "throughput", "--model", sys.argv[1], "--num-prompts", "2"])
llm = LLM(sys.argv[1], max_model_len=64, kv_cache_memory_bytes=4 << 20)
out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                   use_tqdm=False)
print(json.dumps({"tokens": list(out[0].outputs[0].token_ids),
                  "leaked": sorted(m for m in sys.modules if m.split(".")[0] in blocked)}))
"""


def test_library_and_cli_parser_import_without_server_deps(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, path, ",".join(NOT_ON_GPU_IMAGE)], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[2], check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) == 4 and result["leaked"] == []
