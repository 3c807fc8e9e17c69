"""benchmarks/smollm2_checkpoint.py: the HF checkpoint vLLM loads in gpu_spec.py's part d is the model kvserve
serves. kvserve reads its config as the GGUF's, HF transformers on it (fp32) decodes the same greedy tokens
as kvserve's LLM on the embedded GGUF (fp32), and the bf16 checkpoint holds those weights rounded to bf16."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.smollm2_checkpoint import write_checkpoint
from kvserve import LLM, SamplingParams

MAX_TOKENS = 24
# One answer ends with the model's eos within MAX_TOKENS, the other runs to MAX_TOKENS.
TASKS = ["Repeat this sentence word for word: the committee met on Tuesday to review the budget for the coming year.",
         "Write a Python function that returns the n-th Fibonacci number."]


@pytest.fixture(scope="module")
def gguf(smollm2_gguf):
    return smollm2_gguf


@pytest.fixture(scope="module")
def fp32_checkpoint(gguf, tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("smollm2-fp32")), dtype=torch.float32)


@pytest.mark.slow
def test_checkpoint_decodes_as_kvserve_serves_the_gguf(gguf, fp32_checkpoint, smol_tokenizer):
    import transformers
    from safetensors import safe_open

    from kvserve.model.model_config import ModelConfig

    path = fp32_checkpoint
    served = ModelConfig.from_path(gguf)
    assert ModelConfig.from_path(path) == served
    assert served.vocab_size == len(smol_tokenizer) == 49152 and served.tie_word_embeddings
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    hf_config = transformers.AutoConfig.from_pretrained(path)
    assert (hf_config.vocab_size, hf_config.tie_word_embeddings, hf_config.eos_token_id) == (
        49152, True, served.eos_token_ids[0])

    saved_tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert saved_tokenizer.eos_token_id == smol_tokenizer.eos_token_id
    prompts = []
    for task in TASKS:
        text = smol_tokenizer.apply_chat_template([{"role": "user", "content": task}], tokenize=False,
                                                  add_generation_prompt=True)
        prompts.append(smol_tokenizer.encode(text))
        assert saved_tokenizer.encode(text) == prompts[-1]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():  # greedy until the eos of the checkpoint's config or MAX_TOKENS
        for prompt in prompts:
            expected.append(hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                              pad_token_id=smol_tokenizer.eos_token_id)[0, len(prompt):].tolist())
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sorted(o.outputs[0].finish_reason for o in outs) == ["length", "stop"]


@pytest.mark.slow
def test_bf16_checkpoint_is_the_fp32_one_rounded(tmp_path, fp32_checkpoint):
    from safetensors.torch import load_file

    path = write_checkpoint(str(tmp_path / "bf16"))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    saved = load_file(f"{path}/model.safetensors")
    weights = load_file(f"{fp32_checkpoint}/model.safetensors")
    assert set(saved) == set(weights) and all(w.dtype == torch.float32 for w in weights.values())
    for name, weight in weights.items():
        assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], weight.to(torch.bfloat16)), name
