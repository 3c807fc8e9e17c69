"""The engine's view of its devices: an executor starts one worker per rank, sizes the KV cache with
them (one block count: the minimum any rank can hold), sends each step and hands back its result."""

from __future__ import annotations

import logging

from kvserve.config import EngineConfig
from kvserve.units import GiB
from kvserve.worker import memory

logger = logging.getLogger(__name__)



class ExecutorDeadError(RuntimeError):
    """A worker died or failed: the engine cannot run another step (in-flight requests fail, it exits)."""


class Executor:
    def __init__(self, config: EngineConfig):
        self.config = config

    @staticmethod
    def create(config: EngineConfig) -> Executor:
        backend = config.args.executor_backend
        if backend == "uni":
            from kvserve.executor.uni_executor import UniExecutor

            return UniExecutor(config)
        if backend == "mp":
            from kvserve.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor(config)
        from kvserve.executor.ray_executor import RayExecutor

        return RayExecutor(config)

    # ---- implemented per backend ----------------------------------------------------------------
    def collective_rpc(self, method: str, *args) -> list:
        """Calls Worker.method(*args) on every rank; their results in rank order."""
        raise NotImplementedError

    def execute_async(self, sched_out):
        """Launches one step on every rank; returns an object whose result() is the RunnerOutput."""
        raise NotImplementedError

    # Whether a step may be launched before its grammar bitmask is known (send_grammar_bitmask follows).
    defers_grammar_bitmask = False

    def send_grammar_bitmask(self, bitmask, mask_row: dict[str, int]) -> None:
        """The bitmask of the step launched last with `grammar_bitmask_deferred`, to every rank."""
        raise NotImplementedError

    def maybe_inject_step_oom(self) -> None:
        """Tests only: raises the out-of-memory error KVSERVE_INJECT_OOM=step asks for, before a step."""
        memory.maybe_inject_oom("step")

    def invalid_sampling_requests(self, requests, vocab_size: int) -> set[str]:
        """After a failed step: the ids of the requests (core Requests) whose own sampling inputs cannot be
        built (each tried alone, on the host), to find the one to blame."""
        from kvserve.worker.sampling_metadata import sampling_inputs_valid

        return {r.request_id for r in requests if not sampling_inputs_valid(r, vocab_size)}

    def check_health(self) -> None:
        """Raises ExecutorDeadError when a worker is gone."""

    def shutdown(self) -> None:
        pass

    # ---- shared ----------------------------------------------------------------------------------
    # Whether the workers run in the engine's own process (their CUDA-graph capture then shares its GIL).
    in_engine_process = False

    def initialize(self, before_graph_capture=None) -> int:
        """Sizes and allocates the KV cache on every rank (which then capture their CUDA graphs); returns the
        number of blocks. `before_graph_capture()` runs once the sizes are known, before the allocation."""
        config = self.config
        sizes = self.collective_rpc("determine_kv_cache_bytes")
        per_rank = [kv_bytes // per_block for kv_bytes, per_block in sizes]
        limiting = min(range(len(sizes)), key=lambda r: per_rank[r])
        num_blocks = per_rank[limiting]
        kv_bytes, per_block = sizes[limiting]
        self.kv_bytes_per_block = per_block  # the limiting rank's: swap space is sized in its blocks
        if len(sizes) > 1:
            logger.info("KV blocks per rank: %s; using the minimum, %d (rank %d)", per_rank, num_blocks, limiting)
        memory.check_max_model_len_fits(config, num_blocks, per_block, kv_bytes)
        memory.log_kv_cache(config, num_blocks, kv_bytes)
        if before_graph_capture is not None:
            before_graph_capture()
        self.collective_rpc("initialize_kv_cache", num_blocks)
        self.log_layout()
        return num_blocks

    def log_layout(self) -> None:
        ranks = self.collective_rpc("describe")
        args = self.config.args
        logger.info("Layout: %d rank(s), tensor parallel %d x pipeline parallel %d, executor %s",
                    len(ranks), args.tensor_parallel_size, args.pipeline_parallel_size, args.executor_backend)
        for r in ranks:
            start, end = r["layers"]
            logger.info("  rank %d (tp %d, pp %d) on node %s pid %d device %s: layers %d-%d; weights %.3f GiB, "
                        "KV cache %.3f GiB", r["rank"], r["tp_rank"], r["pp_rank"], r["node"], r["pid"], r["device"],
                        start, end - 1, r["weights_bytes"] / GiB, r["kv_bytes"] / GiB)
        self.layout = ranks
