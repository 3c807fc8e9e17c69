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
    kv_dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    logger.info("%s KV cache size: %d tokens (dtype %s)", "GPU" if config.device == "cuda" else "CPU", tokens, kv_dtype)
    logger.info(
        "Maximum concurrency for %d tokens per request: %.2fx", config.max_model_len, tokens / config.max_model_len
    )


def check_weights_fit(config: EngineConfig, free_bytes: int, total_bytes: int, dtype_bytes: int) -> None:
    """Before loading: a model whose weights alone exceed the budget fails with what to change."""
    from kvserve.model.quantization import estimate_weight_bytes

    weights = estimate_weight_bytes(config.model_config, dtype_bytes, config.quant_config)
    budget = total_bytes * config.args.gpu_memory_utilization - (total_bytes - free_bytes)
    if weights > budget:
        raise ValueError(
            f"The model's weights need {weights / GiB:.2f} GiB ({config.dtype}), but only {max(budget, 0) / GiB:.2f} "
            f"GiB of the {total_bytes / GiB:.2f} GiB GPU is available to this engine (--gpu-memory-utilization "
            f"{config.args.gpu_memory_utilization}, {(total_bytes - free_bytes) / GiB:.2f} GiB already in use by "
            f"other processes). Use a quantized checkpoint (--quantization), split the model across GPUs "
            f"(--tensor-parallel-size), pick a smaller model, or raise --gpu-memory-utilization."
        )


def kv_cache_bytes_gpu(
    config: EngineConfig, runner, free_at_start: int, total: int, allocated_at_start: int, reserved_at_start: int
) -> int:
    """vLLM's rule: total x gpu_memory_utilization, minus what others held at start, the weights,
    the activation peak of the largest step, memory outside torch's allocator and the graph pool."""
    import torch

    args = config.args
    torch.cuda.synchronize()
    # Differences, not absolutes: other engines in this process count as "others", not as ours.
    allocated_after_load = torch.cuda.memory_allocated()
    weights = allocated_after_load - allocated_at_start
    torch.cuda.reset_peak_memory_stats()
    runner.profile_run(config.max_num_batched_tokens, args.max_num_seqs)
    peak_activation = torch.cuda.max_memory_allocated() - allocated_after_load
    torch.cuda.empty_cache()
    free_now, _ = torch.cuda.mem_get_info()
    others = total - free_at_start
    non_torch = max(0, (free_at_start - free_now) - (torch.cuda.memory_reserved() - reserved_at_start))
    graph_reserve = 0
    if not args.enforce_eager:
        # Graphs hold activations for up to max(max_num_seqs, largest mixed graph) tokens; a margin for
        # the pool's slack.
        from kvserve.worker.cuda_graphs import mixed_capture_sizes

        graph_tokens = max([args.max_num_seqs, *mixed_capture_sizes(config.max_num_batched_tokens)])
        graph_reserve = int(peak_activation * min(1.0, graph_tokens / config.max_num_batched_tokens) * 1.5) + 64 * (1 << 20)
    budget = int(total * args.gpu_memory_utilization)
    kv_bytes = budget - others - weights - peak_activation - non_torch - graph_reserve
    logger.info(
        "Memory: total %.2f GiB x %.2f = %.2f GiB; in use by others %.2f, weights %.2f, activation peak %.2f, "
        "non-torch %.2f, CUDA graph reserve %.2f GiB",
        total / GiB, args.gpu_memory_utilization, budget / GiB, others / GiB, weights / GiB,
        peak_activation / GiB, non_torch / GiB, graph_reserve / GiB,
    )
    if kv_bytes <= 0:
        raise ValueError(
            f"No GPU memory is left for the KV cache: weights {weights / GiB:.2f} GiB + activation peak "
            f"{peak_activation / GiB:.2f} GiB (for --max-num-batched-tokens {config.max_num_batched_tokens}) + "
            f"{(others + non_torch + graph_reserve) / GiB:.2f} GiB other use exceed {budget / GiB:.2f} GiB "
            f"(--gpu-memory-utilization {args.gpu_memory_utilization}). Raise --gpu-memory-utilization, lower "
            f"--max-num-batched-tokens or --max-num-seqs, or use a smaller/quantized model."
        )
    return kv_bytes
