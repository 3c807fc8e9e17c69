"""How many KV blocks this engine gets, and a clear error when max_model_len cannot fit."""

from __future__ import annotations

import logging

from kvserve.config import EngineConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 2 * GiB


def kv_cache_bytes_cpu(config: EngineConfig, bytes_per_block: int) -> int:
    """On CPU there is no device memory to measure: a fixed budget (like vLLM's CPU KV space), capped at
    what max_num_seqs requests of max_model_len tokens could ever use."""
    args = config.args
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes
    blocks_per_seq = -(-config.max_model_len // args.block_size)
    useful = args.max_num_seqs * blocks_per_seq * bytes_per_block
    return min(DEFAULT_CPU_KV_CACHE_BYTES, useful)


def num_blocks_from_bytes(kv_bytes: int, bytes_per_block: int) -> int:
    return kv_bytes // bytes_per_block


def check_max_model_len_fits(config: EngineConfig, num_blocks: int, bytes_per_block: int, kv_bytes: int) -> None:
    """Fail at start-up, not mid-request, when one full-length request cannot fit in the KV cache."""
    block_size = config.args.block_size
    capacity_tokens = num_blocks * block_size
    if capacity_tokens >= config.max_model_len:
        return
    needed_blocks = -(-config.max_model_len // block_size)
    needed = needed_blocks * bytes_per_block
    where = "--kv-cache-memory-bytes" if config.device == "cpu" else "--gpu-memory-utilization (or --kv-cache-memory-bytes)"
    raise ValueError(
        f"The model's max seq len ({config.max_model_len}) is larger than the maximum number of tokens "
        f"that can be stored in the KV cache ({capacity_tokens}). One request of max_model_len tokens "
        f"needs {needed / GiB:.3f} GiB of KV cache, but only {kv_bytes / GiB:.3f} GiB is available. "
        f"Use --max-model-len {capacity_tokens} or less, or give the KV cache more memory with "
        f"{where}."
    )


def log_kv_cache(config: EngineConfig, num_blocks: int, kv_bytes: int) -> None:
    tokens = num_blocks * config.args.block_size
    logger.info("Available KV cache memory: %.2f GiB", kv_bytes / GiB)
    logger.info("%s KV cache size: %d tokens", "GPU" if config.device == "cuda" else "CPU", tokens)
    logger.info(
        "Maximum concurrency for %d tokens per request: %.2fx", config.max_model_len, tokens / config.max_model_len
    )
