"""--block-size left out: the engine takes the Triton backend's preference (64 where its long prefills load K/V
tiles with TMA: a 16-bit cache of heads wider than 128 on CUDA), else 16; a given block size is kept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.config import DEFAULT_BLOCK_SIZE, EngineArgs, EngineConfig, default_block_size


@pytest.mark.parametrize("device,backend,dtype,kv_cache_dtype,head_dim,expected", [
    ("cuda", "triton", "bfloat16", "auto", 256, 64),  # Gemma 2/3
    ("cuda", "triton", "float16", "auto", 256, 64),
    ("cuda", "triton", "bfloat16", "auto", 128, DEFAULT_BLOCK_SIZE),  # Llama, Qwen: no TMA path yet
    ("cuda", "triton", "bfloat16", "fp8", 256, DEFAULT_BLOCK_SIZE),  # an fp8 cache gathers
    ("cuda", "triton", "float32", "auto", 256, DEFAULT_BLOCK_SIZE),
    ("cuda", "torch", "bfloat16", "auto", 256, DEFAULT_BLOCK_SIZE),
    ("cpu", "torch", "float32", "auto", 256, DEFAULT_BLOCK_SIZE),
])
def test_default_block_size(device, backend, dtype, kv_cache_dtype, head_dim, expected):
    assert default_block_size(device, backend, dtype, kv_cache_dtype, head_dim) == expected


def test_preferred_block_size_is_a_long_prefill_key_step():
    from kvserve.ops.triton_attention import TritonAttentionBackend

    assert TritonAttentionBackend.preferred_block_size(256, "bfloat16") == \
        TritonAttentionBackend.WIDE_HEAD_LONG_PREFILL_CONFIG[1]
    assert TritonAttentionBackend.preferred_block_size(128, "bfloat16") is None


def test_the_same_without_triton():
    """`kvserve plan` on a machine without triton sizes the cache with the block size the GPU server will use."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "from kvserve.config import default_block_size\n"
            "print([default_block_size('cuda', 'triton', d, 'auto', w) for d in ('bfloat16', 'float32') "
            "for w in (128, 256)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str([default_block_size("cuda", "triton", d, "auto", w)
                                      for d in ("bfloat16", "float32") for w in (128, 256)])
    assert "64" in out.stdout


def test_engine_config_resolves_and_keeps(tiny_model_factory):
    path, _ = tiny_model_factory("gemma3")
    config = EngineConfig.from_args(EngineArgs(model=path, device="cpu"), count_devices=False)
    assert config.args.block_size == DEFAULT_BLOCK_SIZE
    config = EngineConfig.from_args(EngineArgs(model=path, device="cpu", block_size=32), count_devices=False)
    assert config.args.block_size == 32
    with pytest.raises(ValueError, match="block-size"):
        EngineArgs(model=path, block_size=48)
