"""The engine: add requests, then step() until done. One step = schedule, run, update.

With async scheduling (default on CUDA) a step launches step N+1 on the device before it reads back the
tokens of step N, so the host's scheduling, input building and output processing overlap the GPU's work
instead of leaving it idle between steps.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from kvserve.config import EngineArgs
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.engine.output_processor import OutputProcessor
from kvserve.inputs import parse_prompt
from kvserve.model.default_model import load_tokenizer
from kvserve.model.generation_config import describe as describe_generation_defaults
from kvserve.model.loader import DTYPES
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.worker import memory
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.runner_output import PendingOutput

logger = logging.getLogger(__name__)


@dataclass
class InFlightStep:
    sched_out: SchedulerOutput
    scheduled_time: float
    pending: PendingOutput


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.config = config = args.create_engine_config()
        torch.manual_seed(args.seed)
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(config.tokenizer_path)
        on_gpu = config.device == "cuda"
        if on_gpu:
            free_at_start, total = torch.cuda.mem_get_info()
            allocated_at_start, reserved_at_start = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            memory.check_weights_fit(config, free_at_start, total, torch.empty((), dtype=DTYPES[config.dtype]).element_size())
        t0 = time.perf_counter()
        self.runner = ModelRunner(config)
        logger.info("Loaded %s in %.1f s (%s, %s)", config.model_path, time.perf_counter() - t0, config.dtype, config.device)
        if config.default_sampling:
            logger.info(describe_generation_defaults(args.generation_config, config.default_sampling))

        bytes_per_block = self.runner.kv_bytes_per_block()
        if args.num_gpu_blocks_override is not None:
            kv_bytes = args.num_gpu_blocks_override * bytes_per_block
        elif args.kv_cache_memory_bytes is not None or not on_gpu:
            kv_bytes = memory.kv_cache_bytes_cpu(config, bytes_per_block)
        else:
            kv_bytes = memory.kv_cache_bytes_gpu(
                config, self.runner, free_at_start, total, allocated_at_start, reserved_at_start
            )
        num_blocks = memory.num_blocks_from_bytes(kv_bytes, bytes_per_block)
        memory.check_max_model_len_fits(config, num_blocks, bytes_per_block, kv_bytes)
        memory.log_kv_cache(config, num_blocks, kv_bytes)
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs(args.max_num_seqs)

        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                enable_chunked_prefill=args.enable_chunked_prefill,
            ),
            self.kv_cache_manager,
        )
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if self.eos_token_id is None and config.model_config.eos_token_ids:
            self.eos_token_id = config.model_config.eos_token_ids[0]
        self.output_processor = OutputProcessor(
            self.tokenizer, config.model_config.vocab_size,
            finish_stopped=lambda ids: self.scheduler.finish_requests(ids, RequestStatus.FINISHED_STOPPED),
        )
        self._ids = itertools.count()
        self.async_scheduling = config.async_scheduling
        self._in_flight: InFlightStep | None = None
        # Core ids of live requests whose sampling reads their output history (penalties, bad words):
        # while any exist, a step waits for the previous step's tokens before scheduling.
        self._needs_history: set[str] = set()

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None) -> str:
        arrival = time.time()
        params = (params or SamplingParams()).clone()  # resolved below; the caller's object stays as it was
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = parse_prompt(prompt, self.tokenizer)
        if not token_ids:
            raise ValueError("The prompt is empty: give at least one token.")
        vocab = self.config.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (size {vocab}).")
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(
                f"The prompt (length {len(token_ids)}) is longer than the maximum model length of {max_len} "
                f"(max_model_len). Shorten the prompt or raise --max-model-len."
            )
        self._resolve_params(params)
        samples = self._fan_out(request_id, params)
        first_id = samples[0][0]
        requests = [
            Request(sample_id, token_ids, sample_params, eos_token_id=self.eos_token_id,
                    prefix_source_id=None if sample_id == first_id else first_id)
            for sample_id, sample_params in samples
        ]
        added = []
        try:
            for req in requests:
                self.scheduler.add_request(req)
                added.append(req.request_id)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add(request_id, text, token_ids, params, requests, arrival)
        if params.needs_output_history:
            self._needs_history.update(added)
        return request_id

    def _resolve_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot know alone: the model's EOS ids, bad words as token ids, the vocabulary."""
        params.update_from_model(self.eos_token_id, self.config.model_config.eos_token_ids)
        if self.tokenizer is None and (params.stop or params.bad_words):
            raise ValueError("stop strings and bad_words need a tokenizer; skip_tokenizer_init is set.")
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
        params.verify_token_ids(self.config.model_config.vocab_size)

    @staticmethod
    def _fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """n > 1: one core request per sample (vLLM's ids f"{i}_{parent}"); sample i draws from seed + i,
        so samples differ yet are reproducible. Prompt logprobs are a property of the prompt: only the
        first sample computes them (the others share its prompt blocks)."""
        if params.n == 1:
            return [(request_id, params)]
        samples = []
        for i in range(params.n):
            p = params.clone()
            p.n = 1
            if p.seed is not None:
                p.seed += i
            if i > 0:
                p.prompt_logprobs = None
            samples.append((f"{i}_{request_id}", p))
        return samples

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.scheduler.finish_requests(self.output_processor.abort(list(request_ids)), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = []
        if self._in_flight is not None and self._needs_history:
            outputs += self._finish(self._in_flight)  # the next schedule must see every sampled token
            self._in_flight = None
        sched_out = self.scheduler.schedule()
        if self._needs_history and sched_out.finished_req_ids:
            self._needs_history.difference_update(sched_out.finished_req_ids)
        launched = InFlightStep(sched_out, time.time(), self.runner.execute_async(sched_out))
        if self._in_flight is not None:
            outputs += self._finish(self._in_flight)  # its tokens are ready by now or soon: step N+1 is queued
            self._in_flight = None
        if self.async_scheduling and not sched_out.is_empty:
            self._in_flight = launched
        else:
            outputs += self._finish(launched)
        return outputs

    def _finish(self, step: InFlightStep) -> list[RequestOutput]:
        result = step.pending.result()
        touched = self.scheduler.update(step.sched_out, result.sampled)
        return self.output_processor.process(step.sched_out, result, touched, step.scheduled_time)

    def get_stats(self) -> EngineStats:
        pc = self.kv_cache_manager.prefix_cache_stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache_manager.usage(),
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            num_preemptions=self.scheduler.num_preemptions,
        )
