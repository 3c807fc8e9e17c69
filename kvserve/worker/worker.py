"""One device's worker: joins the process groups, loads its shard of the model, sizes its KV-cache shard
and runs steps. The executor drives one Worker per rank (in this process for `uni`, in a worker process
or Ray actor otherwise)."""

from __future__ import annotations

import logging
import os
import socket
import time

import torch

from kvserve.config import EngineConfig
from kvserve.distributed import parallel_state
from kvserve.distributed.parallel_state import get_parallel_state, init_distributed
from kvserve.worker import memory

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None):
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.runner = None
        self.layer_range = None
        self.startup = None
        self.weights_bytes = 0
        self.kv_bytes = 0

    def init_device(self) -> None:
        config, args = self.config, self.config.args
        if config.device == "cuda":
            torch.cuda.set_device(self.local_rank)
        if args.world_size > 1:
            init_distributed(self.rank, args.tensor_parallel_size, args.pipeline_parallel_size,
                             self.distributed_init_method, "nccl" if config.device == "cuda" else "gloo",
                             expert_parallel=args.enable_expert_parallel)
        # Every rank draws the same random numbers: tensor-parallel ranks sample identical tokens.
        torch.manual_seed(args.seed)

    def load_model(self) -> None:
        from kvserve.worker.model_runner import ModelRunner

        config = self.config
        ps = get_parallel_state()
        # Each phase that can run out of memory says which phase, the numbers, and the flag to change.
        self.startup = memory.StartupMemory(config)
        if ps.world_size == 1:
            self.startup.check_weights_fit()
        self.layer_range = (config.layer_ranges[ps.pp_rank] if config.layer_ranges
                            else (0, config.model_config.num_hidden_layers))
        t0 = time.perf_counter()
        with self.startup.phase(memory.LOADING_WEIGHTS, needed=memory.estimated_weight_bytes(config, ps.pp_rank)):
            self.runner = ModelRunner(config, self.layer_range)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.runner.model.parameters())
        if self.runner.draft_runner is not None:
            self.weights_bytes += self.runner.draft_runner.weights_bytes
        logger.info("rank %d: loaded %s in %.1f s (%s, %s)", self.rank, config.model_path,
                    time.perf_counter() - t0, config.dtype, config.device)
        logger.info("rank %d: model weights take %.4f GiB as stored (quantization: %s)", self.rank,
                    self.weights_bytes / memory.GiB,
                    config.quant_config.name if config.quant_config is not None else "none")

    def determine_kv_cache_bytes(self) -> tuple[int, int]:
        """(bytes this rank can give its KV cache, bytes one block takes on this rank)."""
        bytes_per_block = self.runner.kv_bytes_per_block()
        with self.startup.phase(memory.PROFILING):
            kv_bytes = self.startup.kv_cache_bytes(self.runner, bytes_per_block)
        return kv_bytes, bytes_per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        with self.startup.phase(memory.ALLOCATING_KV, needed=num_blocks * self.runner.kv_bytes_per_block()):
            self.runner.initialize_kv_cache(num_blocks)
        self.kv_bytes = num_blocks * self.runner.kv_bytes_per_block()
        with self.startup.phase(memory.CAPTURING_GRAPHS):
            self.runner.capture_cuda_graphs(self.config.args.max_num_seqs)

    # ---- swap preemption (--swap-space) ----------------------------------------------------------------
    def initialize_swap_space(self, num_cpu_blocks: int) -> None:
        self.runner.initialize_swap_space(num_cpu_blocks)

    def measure_preemption_costs(self, num_tokens: int) -> tuple[float, float]:
        return self.runner.measure_preemption_costs(num_tokens)

    def execute_model(self, sched_out):
        if parallel_state.COMM_TIMER is not None and sched_out.total_num_scheduled_tokens:
            parallel_state.COMM_TIMER.begin_step()  # steps with work only (pipelining schedules empty ones)
        return self.runner.execute_async(sched_out)

    def sample_deferred(self, bitmask, mask_row: dict[str, int]) -> None:
        self.runner.sample_deferred(bitmask, mask_row)

    # ---- measurements for benchmarks (benchmarks/gpu_multi.py) ------------------------------------------
    def comm_stats(self, reset: bool = False) -> dict | None:
        """Seconds and calls per collective since the last reset (KVSERVE_COMM_TIMER=1), else None."""
        timer = parallel_state.COMM_TIMER
        if timer is None:
            return None
        stats = timer.summary()
        if reset:
            timer.reset()
        return stats

    def memory_report(self) -> dict:
        """This rank's device memory now: used by the whole device, and torch's allocated and peak."""
        if self.config.device != "cuda":
            return dict(rank=self.rank, device="cpu")
        free, total = torch.cuda.mem_get_info()
        return dict(rank=self.rank, device=f"cuda:{torch.cuda.current_device()}", used_gib=(total - free) / 2**30,
                    total_gib=total / 2**30, allocated_gib=torch.cuda.memory_allocated() / 2**30,
                    peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30)

    def probe_all_reduce(self, num_tokens: int, iters: int = 20) -> float | None:
        """Seconds of one TP all-reduce of [num_tokens, hidden] activations (what a CUDA-graph step does
        2 x layers times, invisible to the timer), measured eagerly; None without tensor parallelism."""
        ps = get_parallel_state()
        if ps.tp_size == 1:
            return None
        import torch.distributed as dist

        hidden = self.config.model_config.hidden_size
        x = torch.zeros(num_tokens, hidden, dtype=self.runner.dtype, device=self.runner.device)
        for _ in range(3):
            dist.all_reduce(x, group=ps.tp_group)
        if self.config.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                dist.all_reduce(x, group=ps.tp_group)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x, group=ps.tp_group)
        return (time.perf_counter() - t0) / iters

    def describe(self) -> dict:
        """Where this rank runs and what it holds (the start-up layout log)."""
        ps = get_parallel_state()
        device = f"cuda:{torch.cuda.current_device()}" if self.config.device == "cuda" else "cpu"
        return dict(rank=self.rank, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank, node=socket.gethostname(),
                    pid=os.getpid(), device=device, layers=self.layer_range, weights_bytes=self.weights_bytes,
                    kv_bytes=self.kv_bytes)
