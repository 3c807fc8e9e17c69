"""The synchronous engine: add requests, then step() until done. One step = schedule, run, update."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from kvserve.config import EngineArgs
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.model.default_model import load_tokenizer
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.worker import memory
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


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
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        t0 = time.perf_counter()
        self.runner = ModelRunner(config)
        logger.info("Loaded %s in %.1f s (%s, %s)", config.model_path, time.perf_counter() - t0, config.dtype, config.device)

        bytes_per_block = self.runner.kv_bytes_per_block()
        if args.num_gpu_blocks_override is not None:
            num_blocks = args.num_gpu_blocks_override
            kv_bytes = num_blocks * bytes_per_block
        else:
            kv_bytes = memory.kv_cache_bytes_cpu(config, bytes_per_block)
            num_blocks = memory.num_blocks_from_bytes(kv_bytes, bytes_per_block)
        memory.check_max_model_len_fits(config, num_blocks, bytes_per_block, kv_bytes)
        memory.log_kv_cache(config, num_blocks, kv_bytes)
        self.runner.initialize_kv_cache(num_blocks)

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
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None and config.model_config.eos_token_ids:
            self.eos_token_id = config.model_config.eos_token_ids[0]
        self._prompts: dict[str, tuple[str | None, list[int], RequestMetrics]] = {}
        self._ids = itertools.count()

    # ---- requests --------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt is a string, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of ids."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            "A prompt must be a string, {'prompt': str}, {'prompt_token_ids': [int, ...]} or a list of token ids; "
            f"got {type(prompt).__name__}."
        )

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None) -> str:
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        text, token_ids = self.tokenize_prompt(prompt)
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
        request = Request(request_id, token_ids, params, eos_token_id=self.eos_token_id)
        self.scheduler.add_request(request)
        self._prompts[request_id] = (text, token_ids, RequestMetrics(arrival_time=time.time()))
        return request_id

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self._prompts.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        sampled = self.runner.execute(sched_out)
        touched = self.scheduler.update(sched_out, sampled)
        now = time.time()
        outputs = []
        for req in touched:
            text, prompt_ids, metrics = self._prompts[req.request_id]
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if req.is_finished:
                metrics.finished_time = now
                del self._prompts[req.request_id]
            outputs.append(self._make_output(req, text, prompt_ids, metrics))
        return outputs

    def _make_output(self, req: Request, text, prompt_ids, metrics) -> RequestOutput:
        params = req.sampling_params
        finished = req.is_finished
        out_text = ""
        if finished and params.detokenize:
            out_text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=params.skip_special_tokens)
        completion = CompletionOutput(
            index=0,
            text=out_text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.status.finish_reason if finished else None,
            stop_reason=req.stop_reason,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=text,
            prompt_token_ids=prompt_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=metrics,
        )

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
