"""Start-up memory: how many KV blocks this engine gets, and what to change when memory runs out.

The arithmetic lives in memory_plan (torch-free, shared with `kvserve plan`); this module measures the
device and runs the start-up phases. Each phase turns an out-of-memory error into a StartupMemoryError
naming the phase, the numbers (needed, available, held by others) and one flag with a value.

Fault injection (tests): KVSERVE_INJECT_OOM="<phase>[,<phase>...]" raises torch.OutOfMemoryError at the
start of those phases (load_weights, profile, kv_cache, cuda_graphs) or, for "step", in the next step
(once per process: an injected step OOM is consumed when raised).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import torch

from kvserve.config import EngineConfig
from kvserve.sizing import memory_plan
from kvserve.sizing.memory_plan import GiB

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = memory_plan.DEFAULT_CPU_KV_CACHE_BYTES

LOADING_WEIGHTS = "loading weights"
PROFILING = "profiling activations"
ALLOCATING_KV = "allocating KV cache"
CAPTURING_GRAPHS = "capturing CUDA graphs"
_PHASE_KEYS = {LOADING_WEIGHTS: "load_weights", PROFILING: "profile", ALLOCATING_KV: "kv_cache",
               CAPTURING_GRAPHS: "cuda_graphs"}
INJECT_ENV = "KVSERVE_INJECT_OOM"
_step_injections = {"setting": None, "used": 0}


def maybe_inject_oom(key: str) -> None:
    """Raise an injected OOM when KVSERVE_INJECT_OOM names `key` (tests only)."""
    setting = os.environ.get(INJECT_ENV, "")
    wanted = [k.strip() for k in setting.split(",") if k.strip()]
    if key not in wanted:
        return
    if key == "step":
        # "step" fails as many steps as it is listed (counted afresh whenever the setting changes).
        if _step_injections["setting"] != setting:
            _step_injections.update(setting=setting, used=0)
        if _step_injections["used"] >= wanted.count("step"):
            return
        _step_injections["used"] += 1
    raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {INJECT_ENV}={key})")


def reset_oom_injection() -> None:
    _step_injections.update(setting=None, used=0)


class StartupMemoryError(ValueError):
    """Start-up ran out of memory (or would): which phase, the numbers, and the one flag to change."""

    def __init__(self, phase: str, message: str, flag: str, value=None, needed: int | None = None,
                 available: int | None = None, others: int | None = None):
        self.phase, self.flag, self.value = phase, flag, value
        self.needed, self.available, self.others = needed, available, others
        suggestion = flag if value is None else f"{flag} {value}"
        super().__init__(f"Out of memory while {phase}: {message} Try {suggestion}.")


# ---- shared arithmetic, with this engine's settings ----------------------------------------------
def parallel_sizes(config: EngineConfig) -> tuple[int, int]:
    args = config.args
    return getattr(args, "tensor_parallel_size", 1) or 1, getattr(args, "pipeline_parallel_size", 1) or 1


def plan_inputs(config: EngineConfig, total_gpu_bytes: int | None = None, others_bytes: int = 0
                ) -> memory_plan.PlanInputs:
    """The engine's settings as memory_plan sees them (the same inputs `kvserve plan` builds)."""
    args = config.args
    tp, pp = parallel_sizes(config)
    return memory_plan.PlanInputs(
        model_config=config.model_config, dtype=config.dtype, max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), tensor_parallel_size=tp,
        pipeline_parallel_size=pp, **memory_plan.weights_format(config.quant_config),
        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
        enforce_eager=args.enforce_eager, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override, total_gpu_bytes=total_gpu_bytes,
        others_bytes=others_bytes, draft_model_config=config.draft_model_config,
    )


def rank_shape(config: EngineConfig, stage: int = 0) -> memory_plan.RankShape:
    tp, pp = parallel_sizes(config)
    expert_parallel = getattr(config.args, "enable_expert_parallel", False)
    return memory_plan.rank_shapes(config.model_config, tp, pp, expert_parallel)[stage]


def kv_bytes_per_block(config: EngineConfig, stage: int = 0) -> int:
    kv_dtype = memory_plan.kv_cache_dtype_bytes(getattr(config.args, "kv_cache_dtype", "auto"), config.dtype)
    target = memory_plan.kv_bytes_per_block(rank_shape(config, stage), kv_dtype, config.args.block_size)
    return target + draft_kv_bytes_per_block(config)


def _draft_bytes(config: EngineConfig) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of the draft model on this rank; (0, 0) without one."""
    kv_dtype = memory_plan.kv_cache_dtype_bytes(getattr(config.args, "kv_cache_dtype", "auto"), config.dtype)
    return memory_plan.draft_bytes(getattr(config, "draft_model_config", None), parallel_sizes(config)[0],
                                   memory_plan.DTYPE_BYTES[config.dtype], kv_dtype, config.max_model_len)


def draft_kv_bytes_per_block(config: EngineConfig) -> int:
    """What a draft model adds to each block on this rank: its K/V of the block's tokens."""
    return _draft_bytes(config)[1] * config.args.block_size


def estimated_weight_bytes(config: EngineConfig, stage: int = 0) -> int:
    """The target's weights on this stage, and the draft model's (stage 0 holds it)."""
    quant = getattr(config.args, "quantization", None)
    experts = memory_plan.weights_format(config.quant_config).get("experts_quantization")
    target = memory_plan.weight_bytes(rank_shape(config, stage), memory_plan.DTYPE_BYTES[config.dtype],
                                      None if quant in (None, "none") else quant, experts)
    return target + (_draft_bytes(config)[0] if stage == 0 else 0)


def kv_cache_bytes_cpu(config: EngineConfig, bytes_per_block: int) -> int:
    args = config.args
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes
    return memory_plan.cpu_kv_cache_bytes(args.max_num_seqs, config.max_model_len, args.block_size, bytes_per_block,
                                          config.model_config.kv_cache_group_windows)


def num_blocks_from_bytes(kv_bytes: int, bytes_per_block: int) -> int:
    return kv_bytes // bytes_per_block


def log_kv_cache(config: EngineConfig, num_blocks: int, kv_bytes: int) -> None:
    windows = config.model_config.kv_cache_group_windows
    tokens = memory_plan.kv_cache_tokens(num_blocks, config.args.block_size, windows, config.max_num_batched_tokens)
    logger.info("Available KV cache memory: %.2f GiB", kv_bytes / GiB)
    kv_dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    logger.info("%s KV cache size: %d tokens (dtype %s)", "GPU" if config.device == "cuda" else "CPU", tokens, kv_dtype)
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", config.max_model_len,
                memory_plan.max_concurrency(num_blocks, config.args.block_size, config.max_model_len, windows))


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory (the CPU engine's 'device')."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, total
    except OSError:
        pass
    return total, total


def _gib(b: int | float | None) -> str:
    return "?" if b is None else f"{b / GiB:.2f} GiB"


def _round_down_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


class StartupMemory:
    """Measures the device once before loading, then sizes the KV cache and reports failures by phase."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.on_gpu = config.device == "cuda"
        if self.on_gpu:
            # An engine dropped earlier in this process may still wait for the collector (it is partly a cycle):
            # its memory is freed now rather than counted as held by others.
            gc.collect()
            torch.cuda.empty_cache()
            self.free_at_start, self.total = torch.cuda.mem_get_info()
            self.allocated_at_start = torch.cuda.memory_allocated()
            self.reserved_at_start = torch.cuda.memory_reserved()
        else:
            self.free_at_start, self.total = _host_memory()
            self.allocated_at_start = self.reserved_at_start = 0
        self.others = self.total - self.free_at_start
        # What the GPU sizing measured and reserved (bytes; None until then), for the log and benchmarks.
        self.weights: int | None = None
        self.activation_peak: int | None = None
        self.non_torch: int | None = None
        self.graph_reserve: int | None = None

    def free_now(self) -> int:
        return torch.cuda.mem_get_info()[0] if self.on_gpu else _host_memory()[0]

    @property
    def budget(self) -> int:
        """What this engine may use on its device beyond what others held at start."""
        return memory_plan.gpu_budget_bytes(self.total, self.config.args.gpu_memory_utilization) - self.others

    # ---- phases ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, needed: int | None = None):
        """Runs one start-up phase; an OOM inside becomes a StartupMemoryError with that phase's advice."""
        try:
            maybe_inject_oom(_PHASE_KEYS[name])
            yield
        except torch.OutOfMemoryError as e:
            if self.on_gpu:
                torch.cuda.empty_cache()
            raise self._oom_error(name, needed) from e

    def _oom_error(self, phase: str, needed: int | None) -> StartupMemoryError:
        cfg, args = self.config, self.config.args
        available = self.free_now()
        numbers = (f"needed {_gib(needed)}, available {_gib(available)} free on the {cfg.device} device, "
                   f"{_gib(self.others)} held by other processes at start.")
        if phase == LOADING_WEIGHTS:
            flag, value, why = self._weights_flag(needed or estimated_weight_bytes(cfg), max(self.budget, 1))
        elif phase == PROFILING:
            flag, value = "--max-num-batched-tokens", max(args.max_num_seqs, cfg.max_num_batched_tokens // 2)
            why = (f"The largest step (--max-num-batched-tokens {cfg.max_num_batched_tokens}, "
                   f"--max-num-seqs {args.max_num_seqs}) does not fit next to the weights.")
        elif phase == ALLOCATING_KV:
            if self.on_gpu and args.kv_cache_memory_bytes is None and args.num_gpu_blocks_override is None:
                shortfall = max(0, (needed or 0) - available)
                util = args.gpu_memory_utilization - shortfall / self.total - 0.02
                flag, value = "--gpu-memory-utilization", round(max(0.05, int(util * 100) / 100), 2)
                why = "Memory that was free when the engine sized its KV cache was taken before it allocated it."
            else:
                flag, value = "--kv-cache-memory-bytes", int(available * 0.5)
                why = "The KV cache asked for more memory than the device has free."
        else:
            flag, value = "--enforce-eager", None
            why = (f"CUDA graphs for {len(self._capture_sizes())} batch sizes (up to --max-num-seqs "
                   f"{args.max_num_seqs}) did not fit; or keep graphs with --max-num-seqs "
                   f"{max(1, args.max_num_seqs // 2)}.")
        return StartupMemoryError(phase, f"{why} {numbers}", flag, value, needed, available, self.others)

    def _capture_sizes(self) -> list[int]:
        from kvserve.worker.cuda_graphs import capture_sizes

        return capture_sizes(self.config.args.max_num_seqs)

    def _weights_flag(self, needed: int, available: int) -> tuple[str, object, str]:
        """The smallest tensor-parallel size whose shard fits, else FP8 weights."""
        cfg = self.config
        why = (f"The model's weights need {_gib(needed)} ({cfg.dtype}) per GPU, but only {_gib(available)} of the "
               f"{_gib(self.total)} device is this engine's (--gpu-memory-utilization "
               f"{cfg.args.gpu_memory_utilization}).")
        tp, _ = parallel_sizes(cfg)
        for new_tp in (2, 4, 8):
            if new_tp <= tp or cfg.model_config.num_attention_heads % new_tp:
                continue
            try:
                shard = memory_plan.weight_bytes(memory_plan.rank_shapes(cfg.model_config, new_tp)[0],
                                                 memory_plan.DTYPE_BYTES[cfg.dtype], None,
                                                 memory_plan.weights_format(cfg.quant_config).get(
                                                     "experts_quantization"))
            except ValueError:
                continue
            if shard <= available:
                return "--tensor-parallel-size", new_tp, why
        return "--quantization", "fp8", why + " A smaller model or more GPUs (pipeline stages) would also do."

    # ---- budget checks (before anything runs out) --------------------------------------------------------
    def check_weights_fit(self) -> None:
        needed = estimated_weight_bytes(self.config)
        if self.on_gpu and needed > self.budget:
            flag, value, why = self._weights_flag(needed, max(self.budget, 0))
            raise StartupMemoryError(
                LOADING_WEIGHTS, f"{why} {_gib(self.others)} is held by other processes.", flag, value,
                needed, max(self.budget, 0), self.others)

    def kv_cache_bytes(self, runner, bytes_per_block: int) -> int:
        args = self.config.args
        if args.num_gpu_blocks_override is not None:
            return args.num_gpu_blocks_override * bytes_per_block
        if args.kv_cache_memory_bytes is not None or not self.on_gpu:
            return kv_cache_bytes_cpu(self.config, bytes_per_block)
        return self._kv_cache_bytes_gpu(runner, bytes_per_block)

    def _kv_cache_bytes_gpu(self, runner, bytes_per_block: int) -> int:
        config, args = self.config, self.config.args
        torch.cuda.synchronize()
        # Differences, not absolutes: other engines in this process count as "others", not as ours.
        allocated_after_load = torch.cuda.memory_allocated()
        self.weights = weights = allocated_after_load - self.allocated_at_start
        torch.cuda.reset_peak_memory_stats()
        scratch_kv = runner.profile_run(config.max_num_batched_tokens, args.max_num_seqs)
        self.activation_peak = peak = torch.cuda.max_memory_allocated() - allocated_after_load - scratch_kv
        torch.cuda.empty_cache()
        free_now, _ = torch.cuda.mem_get_info()
        self.non_torch = non_torch = max(0, (self.free_at_start - free_now)
                                         - (torch.cuda.memory_reserved() - self.reserved_at_start))
        self.graph_reserve = graphs = memory_plan.cuda_graph_reserve_bytes(
            peak, args.max_num_seqs, config.max_num_batched_tokens, args.enforce_eager)
        budget = memory_plan.gpu_budget_bytes(self.total, args.gpu_memory_utilization)
        kv_bytes = memory_plan.kv_cache_bytes(budget, self.others, weights, peak, non_torch, graphs)
        logger.info(
            "Memory: total %.2f GiB x %.2f = %.2f GiB; in use by others %.2f, weights %.2f, activation peak %.2f, "
            "non-torch %.2f, CUDA graph reserve %.2f GiB",
            self.total / GiB, args.gpu_memory_utilization, budget / GiB, self.others / GiB, weights / GiB,
            peak / GiB, non_torch / GiB, graphs / GiB,
        )
        one_request = _one_request_blocks(config) * bytes_per_block
        if kv_bytes < one_request:
            self._raise_no_kv(kv_bytes, bytes_per_block, weights, peak + graphs, budget, non_torch)
        return kv_bytes

    def _raise_no_kv(self, kv_bytes, bytes_per_block, weights, activations, budget, non_torch) -> None:
        """The weights loaded, but the step's activations leave too little KV for one request: a smaller
        step budget if that frees enough, else the weights are the problem."""
        cfg, args = self.config, self.config.args
        one_request = _one_request_blocks(cfg) * bytes_per_block
        if kv_bytes >= bytes_per_block:  # some KV is left: the length is what to change
            raise self._length_error(kv_bytes, bytes_per_block)
        shortfall = one_request - kv_bytes
        tokens = cfg.max_num_batched_tokens
        scaled = int(tokens * (1 - shortfall / max(activations, 1)))
        msg = (f"weights {_gib(weights)} + activations and CUDA graphs {_gib(activations)} (for "
               f"--max-num-batched-tokens {tokens}) + {_gib(self.others + non_torch)} other use leave "
               f"{_gib(kv_bytes)} of {_gib(budget)} (--gpu-memory-utilization {args.gpu_memory_utilization}) for "
               f"the KV cache; one request of max_model_len {cfg.max_model_len} needs {_gib(one_request)}.")
        if scaled >= args.max_num_seqs:
            tokens = max(args.max_num_seqs, _round_down_pow2(scaled))
            raise StartupMemoryError(PROFILING, msg, "--max-num-batched-tokens", tokens, one_request, kv_bytes,
                                     self.others)
        flag, value, _ = self._weights_flag(weights + activations + one_request, max(self.budget, 1))
        raise StartupMemoryError(PROFILING, msg, flag, value, one_request, kv_bytes, self.others)

    def _length_error(self, kv_bytes: int, bytes_per_block: int) -> StartupMemoryError:
        return length_error(self.config, kv_bytes, bytes_per_block, self.others)


def _one_request_blocks(cfg: EngineConfig) -> int:
    """Blocks one request of max_model_len tokens holds at once (fewer in windowed KV cache groups)."""
    return memory_plan.request_kv_blocks(cfg.max_model_len, cfg.args.block_size, cfg.model_config.kv_cache_group_windows,
                                         cfg.max_num_batched_tokens)


def length_error(cfg: EngineConfig, kv_bytes: int, bytes_per_block: int, others: int = 0) -> StartupMemoryError:
    args = cfg.args
    capacity = memory_plan.kv_cache_tokens(kv_bytes // bytes_per_block, args.block_size,
                                           cfg.model_config.kv_cache_group_windows, cfg.max_num_batched_tokens)
    needed_blocks = _one_request_blocks(cfg)
    where = ("--kv-cache-memory-bytes" if cfg.device != "cuda" or args.kv_cache_memory_bytes is not None
             else "--gpu-memory-utilization (or --kv-cache-memory-bytes)")
    return StartupMemoryError(
        ALLOCATING_KV,
        f"The model's max seq len ({cfg.max_model_len}) is larger than the maximum number of tokens that can "
        f"be stored in the KV cache ({capacity}). One request of max_model_len tokens needs "
        f"{_gib(needed_blocks * bytes_per_block)} of KV cache, but only {_gib(kv_bytes)} is available. "
        f"Or give the KV cache more memory with {where}.",
        "--max-model-len", capacity, needed_blocks * bytes_per_block, kv_bytes, others)


def check_max_model_len_fits(config: EngineConfig, num_blocks: int, bytes_per_block: int, kv_bytes: int) -> None:
    """Fail at start-up, not mid-request, when one full-length request cannot fit in the KV cache (the
    executor calls it with the block count every rank can hold)."""
    if num_blocks < _one_request_blocks(config):
        raise length_error(config, num_blocks * bytes_per_block, bytes_per_block)
