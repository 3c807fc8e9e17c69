"""SmolLM2-135M-Instruct quantized by our reference quantizers (AWQ int4, GPTQ int4 with act-order,
and, in the README's example, FP8 at load with an FP8 KV cache) still answers the capital of France (fp32 CPU reference path). Perplexities per method are
in BENCHMARKS.md (benchmarks/quant_perplexity.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_source():
    from tests.quant_utils import smollm2_weights

    try:
        return smollm2_weights()
    except FileNotFoundError as exc:
        pytest.skip(f"SmolLM2 GGUF not installed: {exc}")


@pytest.mark.parametrize("method,opt,engine_kw", [
    ("awq", {"group_size": 64}, {}),
    ("gptq", {"bits": 4, "group_size": 64, "sym": False, "desc_act": True}, {}),
], ids=["awq-int4", "gptq-int4-act-order"])
def test_quantized_smollm2_answers_paris(smollm2_source, tmp_path, method, opt, engine_kw):
    from tests.quant_utils import make_smollm2_checkpoint

    path = make_smollm2_checkpoint(tmp_path / "m", method, smollm2_source, **opt)
    llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=16 << 20, **engine_kw)
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert "Paris" in out.outputs[0].text, out.outputs[0].text


def test_readme_quantization_example_answers_paris():
    """The README's Quantization example, run as printed: SmolLM2 with --quantization fp8 --kv-cache-dtype fp8."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL) if 'quantization="fp8"' in b]
    assert blocks, "README has no python block with quantization=\"fp8\""
    out = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout, out.stdout
