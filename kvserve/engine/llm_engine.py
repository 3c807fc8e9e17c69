"""The engine: add requests, then step() until done. One step = schedule, run, update.

With async scheduling (default on CUDA) a step launches step N+1 on the device before it reads back the
tokens of step N, so the host's scheduling, input building and output processing overlap the GPU's work
instead of leaving it idle between steps.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from kvserve.background import in_background
from kvserve.config import EngineArgs, EngineConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.preemption_log import PreemptionLog
from kvserve.engine.step_errors import StepOutOfMemoryError
from kvserve.executor.abstract import Executor
from kvserve.gc_tuning import raise_young_generation_threshold
from kvserve.inputs import parse_prompt
from kvserve.request_limits import RequestLimits, ValidatedPrompt, validate_request
from kvserve.model.default_model import load_tokenizer
from kvserve.model.generation_config import describe as describe_generation_defaults
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.drafter import Drafter
from kvserve.spec_decode.proposer import Proposer
from kvserve.spec_decode.stats import SpecDecodeStats
from kvserve.units import GiB
from kvserve.structured_output.engine_setup import make_structured_output_manager

logger = logging.getLogger(__name__)


@dataclass
class InFlightStep:
    sched_out: SchedulerOutput
    scheduled_time: float
    pending: object  # the executor's launched step: result() -> RunnerOutput


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_preemptions_by_mode: dict = field(default_factory=dict)  # "recompute" | "swap" -> count
    # Speculative decoding (None when off): acceptance totals since start, drafts per request now, and why
    # (the draft budget's reason: "on", "probe", or what turned it down: "batch size", "acceptance").
    spec_decode: SpecDecodeStats | None = None
    num_speculative_tokens: int | None = None
    speculation_reason: str | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class LLMEngine:
    def __init__(self, args: EngineArgs | EngineConfig):
        """From EngineArgs (resolved here) or an EngineConfig its caller already resolved."""
        config = args if isinstance(args, EngineConfig) else args.create_engine_config()
        self.config, args = config, config.args
        self.request_limits = RequestLimits.from_config(config)
        torch.manual_seed(args.seed)
        # The tokenizer loads on a thread while the model loads (a large tokenizer.json takes seconds).
        tokenizer_future = None if args.skip_tokenizer_init else in_background(load_tokenizer, config.tokenizer_path)
        t0 = time.perf_counter()
        self.executor = Executor.create(config)
        # Graphs captured in this process would share the GIL with a tokenizer still loading on its thread
        # (on the H200: capture 7.7 s instead of 2.1 s in `serve`), so the load finishes first; it has had the
        # weight load and the memory profile to overlap with.
        wait_for_tokenizer = None
        if tokenizer_future is not None and self.executor.in_engine_process and config.device == "cuda":
            wait_for_tokenizer = tokenizer_future.result
        num_blocks = self.executor.initialize(before_graph_capture=wait_for_tokenizer)
        logger.info("Engine ready in %.1f s (%s, %s)", time.perf_counter() - t0, config.dtype, config.device)
        self.num_kv_blocks = num_blocks
        swap = self._init_swap_space()
        if config.default_sampling:
            logger.info(describe_generation_defaults(args.generation_config, config.default_sampling))

        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching,
                                               num_cpu_blocks=swap.pop("num_cpu_blocks"),
                                               group_windows=config.model_config.kv_cache_group_windows)
        self.tokenizer = None if tokenizer_future is None else tokenizer_future.result()
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if self.eos_token_id is None and config.model_config.eos_token_ids:
            self.eos_token_id = config.model_config.eos_token_ids[0]
        # The constrained requests' matchers (None without a tokenizer: grammars are over its tokens).
        # Its bitmasks are pinned where they cross to the device from this process (one asynchronous copy).
        self.structured_output = make_structured_output_manager(
            args, self.tokenizer, config.model_config.vocab_size,
            [t for t in [self.eos_token_id, *config.model_config.eos_token_ids] if t is not None],
            pin_memory=self.executor.in_engine_process and config.device == "cuda")
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                enable_chunked_prefill=args.enable_chunked_prefill,
                exclusive_batches=args.pipeline_parallel_size > 1,
                grammar_bitmask_after_update=self._bitmask_after_update(),
                **swap,
            ),
            self.kv_cache_manager,
            structured_output=self.structured_output,
        )
        self.preemption_log = PreemptionLog(args.max_num_seqs, args.gpu_memory_utilization, swap["preemption_mode"])
        self.output_processor = OutputProcessor(self.tokenizer, config.model_config.vocab_size)
        # Speculative decoding: offers draft tokens before each drafting step (spec_decode/proposer.py); None: off.
        self.proposer: Proposer | None = None
        self.drafter: Drafter | None = None  # --speculative-config: the proposer with its budget and stats
        if config.args.speculative_config is not None:
            self.drafter = Drafter.from_config(config)
            self.proposer = self.drafter
        self._ids = itertools.count()
        raise_young_generation_threshold()  # this process runs the step loop
        self.async_scheduling = config.async_scheduling
        self._in_flight: InFlightStep | None = None
        # Pipeline parallelism: up to pp batches in flight (one per stage), oldest first.
        self.max_batches_in_flight = args.pipeline_parallel_size
        self._pipeline: collections.deque[InFlightStep] = collections.deque()
        # Core ids of live requests whose sampling reads their output history (penalties, bad words):
        # while any exist, a step waits for the previous step's tokens before scheduling.
        self._needs_history: set[str] = set()
        self._carried_outputs: list[RequestOutput] = []
        # What the current step() scheduled, and the step that was in flight when it did (None: none), or
        # None before it schedules: after a failure, OOM triage and recover_from_failed_step read it.
        self._scheduled_now: tuple[SchedulerOutput, SchedulerOutput | None] | None = None

    def _bitmask_after_update(self) -> bool:
        """Async scheduling with one batch in flight: a constrained request runs every step, its mask for
        step N+1 filled once step N's tokens are in (while N+1's forward runs) and sent before N+1 samples."""
        return (self.config.async_scheduling and self.config.args.pipeline_parallel_size == 1
                and self.executor.defers_grammar_bitmask)

    def _init_swap_space(self) -> dict:
        """--swap-space and --preemption-mode: the CPU blocks, and for auto the two costs it compares."""
        args = self.config.args
        bytes_per_block = self.executor.kv_bytes_per_block
        mode = getattr(args, "preemption_mode", "recompute")
        num_cpu_blocks = int(args.swap_space * GiB) // bytes_per_block if mode != "recompute" else 0
        if mode != "recompute" and num_cpu_blocks == 0:
            logger.warning("--swap-space %s GiB holds no %d-byte block: preemption recomputes", args.swap_space,
                           bytes_per_block)
            mode = "recompute"
        swap = {"num_cpu_blocks": num_cpu_blocks, "preemption_mode": mode}
        if mode == "recompute":
            return swap
        self.executor.collective_rpc("initialize_swap_space", num_cpu_blocks)
        if mode == "auto":
            # Every rank does the same work in lockstep: the driver's measurement stands for all.
            recompute, copy = self.executor.collective_rpc(
                "measure_preemption_costs", min(512, self.config.max_num_batched_tokens, self.config.max_model_len))[0]
            swap.update(recompute_seconds_per_token=recompute, swap_seconds_per_block=copy)
            logger.info("Preemption costs: recompute %.4f ms per token, swap out and in %.4f ms per block of %d "
                        "tokens", recompute * 1e3, copy * 1e3, args.block_size)
        logger.info("Swap space: %.2f GiB = %d blocks (%d tokens); preemption mode %s", args.swap_space,
                    num_cpu_blocks, num_cpu_blocks * args.block_size, mode)
        return swap

    @property
    def runner(self):
        """The in-process model runner (the uni executor's); None when workers run elsewhere."""
        return getattr(self.executor, "runner", None)

    def shutdown(self) -> None:
        """Stops the worker processes, if any (also done at interpreter exit)."""
        self.executor.shutdown()

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    group: str | None = None) -> str:
        """`group`: the API request this prompt came from (several prompts share one); admission takes turns
        across groups. Default: the request's own."""
        arrival = time.time()
        params = (params or SamplingParams()).clone()  # resolved below; the caller's object stays as it was
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(prompt, ValidatedPrompt):  # the server validated its requests already
            text, token_ids = parse_prompt(prompt, self.tokenizer)
            prompt = validate_request(text, token_ids, params, self.request_limits)
        text, token_ids = prompt.text, prompt.token_ids
        self.scheduler.check_fits(len(token_ids))  # what this engine's budget and KV cache can ever run
        self._resolve_params(params)
        if params.structured_outputs is not None and self.structured_output is None:
            raise ValueError("structured_outputs need a tokenizer; skip_tokenizer_init is set.")
        samples = self._fan_out(request_id, params)
        first_id = samples[0][0]
        requests = [
            Request(sample_id, token_ids, sample_params, eos_token_id=self.eos_token_id,
                    prefix_source_id=None if sample_id == first_id else first_id, group_id=group or request_id)
            for sample_id, sample_params in samples
        ]
        added = []
        try:
            for req in requests:
                self.scheduler.add_request(req)
                added.append(req.request_id)
                if params.structured_outputs is not None:  # its grammar compiles off the step loop meanwhile
                    self.structured_output.add_request(req.request_id, req.sampling_params.structured_outputs,
                                                       token_ids)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add(request_id, text, token_ids, params, requests, arrival)
        if params.needs_output_history:
            self._needs_history.update(added)
        return request_id

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compiles the request's constraint now (cached for the engine), so that an invalid or too costly
        one is a ValueError for the caller instead of an aborted request later."""
        if params.structured_outputs is None:
            return
        if self.structured_output is None:
            raise ValueError("structured_outputs need a tokenizer; skip_tokenizer_init is set.")
        self.structured_output.compiler.compile(params.structured_outputs)

    def _resolve_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot know alone: the model's EOS ids, bad words as token ids, the vocabulary."""
        params.update_from_model(self.eos_token_id, self.config.model_config.eos_token_ids)
        if self.tokenizer is None and (params.stop or params.bad_words):
            raise ValueError("stop strings and bad_words need a tokenizer; skip_tokenizer_init is set.")
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)

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
        return (self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._pipeline)
                or bool(self._carried_outputs))

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        # Outputs of a step that completed before an out-of-memory error in the same call.
        outputs, self._carried_outputs = self._carried_outputs, []
        self._scheduled_now = None
        try:
            if self.max_batches_in_flight > 1:
                return outputs + self._pipelined_step()
            return self._step(outputs)
        except torch.OutOfMemoryError as e:
            raise self._fail_step_out_of_memory(e, outputs) from e

    def _step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        drafting = self._drafting()
        if self._in_flight is not None and (self._needs_history or drafting):
            outputs += self._finish(self._in_flight)  # the next schedule must see every sampled token
            self._in_flight = None
        if drafting:
            self._propose()
        sched_out = self._schedule(mask_after_update=self._in_flight is not None)
        self._scheduled_now = (sched_out, self._in_flight.sched_out if self._in_flight is not None else None)
        if sched_out.preemptions:
            self.preemption_log.report(sched_out.preemptions)
        if self._needs_history and sched_out.finished_req_ids:
            self._needs_history.difference_update(sched_out.finished_req_ids)
        if not sched_out.is_empty:
            self.executor.maybe_inject_step_oom()
        launched = InFlightStep(sched_out, time.time(), self.executor.execute_async(sched_out))
        if self._in_flight is not None:  # its tokens are ready by now or soon: step N+1 is queued
            updated = self._update(self._in_flight)
            if sched_out.message.grammar_bitmask_deferred:
                # The matchers have seen step N's tokens: N+1's mask goes out before N's outputs are made,
                # the shortest path from N's tokens to N+1's sampling.
                self.executor.send_grammar_bitmask(*self.structured_output.grammar_bitmask(sched_out.scheduled))
            outputs += self._make_outputs(self._in_flight, *updated)
            self._in_flight = None
        if self.async_scheduling and not sched_out.is_empty:
            self._in_flight = launched
        else:
            outputs += self._finish(launched)
        return outputs

    def _schedule(self, mask_after_update: bool = False) -> SchedulerOutput:
        """`mask_after_update`: a step is in flight, to be updated before this one samples; a constrained
        request of this step may have its last token there, so its mask waits for that update."""
        sched_out = self.scheduler.schedule()
        so = self.structured_output
        if so is not None and sched_out.scheduled:
            msg = sched_out.message  # the workers' copy: its grammar slots
            if (mask_after_update and self.scheduler.config.grammar_bitmask_after_update
                    and so.any_constrained(sched_out.scheduled)):
                msg.grammar_bitmask_deferred = True
            else:
                msg.grammar_bitmask, msg.structured_output_request_ids = so.grammar_bitmask(sched_out.scheduled)
        return sched_out

    def recover_from_failed_step(self) -> list[str]:
        """After step() raised: finds the requests whose own parameters fail a step (each tried alone in the
        per-request parts of sampling), aborts them and returns their ids; every other request is rolled
        back to recompute (its K/V and tokens in flight are dropped) and goes on. When no request is to
        blame, every request of the failed step is aborted: the engine itself keeps serving."""
        # This step's requests and those of the step that was in flight when it was scheduled.
        scheduled = [s for step in self._scheduled_now or () if step is not None for s in step.scheduled]
        if self.max_batches_in_flight > 1 or not scheduled:
            raise RuntimeError("a failed pipelined step cannot be attributed to its requests")
        vocab = self.config.model_config.vocab_size
        culprits = self.executor.invalid_sampling_requests([s.request for s in scheduled], vocab)
        if not culprits:
            culprits = {s.request_id for s in scheduled}
        parents = {self.output_processor.samples[c].parent.request_id for c in culprits
                   if c in self.output_processor.samples}
        self.abort_request(sorted(parents))
        self._in_flight = None
        self._scheduled_now = None
        self.scheduler.roll_back_running()
        self.kv_cache_manager.reset_prefix_cache()  # a failed forward may have left blocks half written
        return sorted(parents)

    def _pipelined_step(self) -> list[RequestOutput]:
        """Launch a batch while earlier ones are still in later stages; collect the oldest once pp batches
        are in flight (or nothing new could be scheduled: its requests are all in flight)."""
        if self._drafting():
            self._propose()
        sched_out = self._schedule()
        self._scheduled_now = (sched_out, None)
        if sched_out.preemptions:
            self.preemption_log.report(sched_out.preemptions)
        if not sched_out.is_empty:
            self._pipeline.append(InFlightStep(sched_out, time.time(), self.executor.execute_async(sched_out)))
        outputs = []
        if sched_out.is_empty:
            outputs += self._finish(InFlightStep(sched_out, time.time(), self.executor.execute_async(sched_out)))
        if self._pipeline and (sched_out.is_empty or len(self._pipeline) >= self.max_batches_in_flight):
            outputs += self._finish(self._pipeline.popleft())
        return outputs

    def _fail_step_out_of_memory(self, error: Exception, outputs: list[RequestOutput]) -> StepOutOfMemoryError:
        """A step ran out of device memory: its requests (and those of a step in flight) fail, everything
        else keeps running, and the log says which setting to lower. Requests are not retried: a smaller
        batch is what the next steps get anyway once these are gone."""
        # This step's batch, if it got that far, and the one still in flight now (not yet finished).
        now = self._scheduled_now[0] if self._scheduled_now is not None else None
        steps = [s for s in (now, self._in_flight.sched_out if self._in_flight else None) if s]
        self._in_flight = None
        core_ids = {s.request_id for step in steps for s in step.scheduled}
        parents = sorted({self.output_processor.samples[c].parent.request_id
                          for c in core_ids if c in self.output_processor.samples})
        num_tokens = max((step.total_num_scheduled_tokens for step in steps), default=0)
        num_reqs = max((len(step.scheduled) for step in steps), default=0)
        self.abort_request(parents)
        # What completed earlier in this call is still delivered (next call); a failed request's partial output is not.
        self._carried_outputs = [o for o in outputs if o.finished or o.request_id not in set(parents)]
        if self.config.device == "cuda":
            torch.cuda.empty_cache()
        args = self.config.args
        if num_tokens > 2 * num_reqs:  # a prefill-heavy step: its token budget is what to cut
            flag, value = "--max-num-batched-tokens", max(args.max_num_seqs, num_tokens // 2)
        else:
            flag, value = "--max-num-seqs", max(1, num_reqs // 2)
        advice = (f"lower {flag} to {value} (or --gpu-memory-utilization to "
                  f"{max(0.05, round(args.gpu_memory_utilization - 0.05, 2))} to leave more room for activations)")
        logger.error("Out of memory in a step of %d requests and %d tokens (%s); failed those %d requests, the "
                     "engine goes on. To avoid it, %s.", num_reqs, num_tokens, error, len(parents), advice)
        return StepOutOfMemoryError(
            f"The engine ran out of memory while running this request's step ({num_reqs} requests, {num_tokens} "
            f"tokens); the request failed and was not retried. The server operator should {advice}.", parents)

    def _finish(self, step: InFlightStep) -> list[RequestOutput]:
        return self._make_outputs(step, *self._update(step))

    def _update(self, step: InFlightStep) -> tuple:
        """A launched step's tokens, read back and given to the scheduler: (result, new tokens, touched)."""
        result = step.pending.result()
        new_tokens = dict(zip(result.req_ids, result.sampled_token_ids))
        touched = self.scheduler.update(step.sched_out, new_tokens)
        if self.drafter is not None and step.sched_out.message.scheduled_spec_decode_tokens:  # a step that drafted
            for sched in step.sched_out.scheduled:
                tokens = new_tokens.get(sched.request_id)
                if sched.spec_token_ids and tokens:
                    self.drafter.observe(len(sched.spec_token_ids), len(tokens) - 1)
        return result, new_tokens, touched

    def _make_outputs(self, step: InFlightStep, result, new_tokens, touched) -> list[RequestOutput]:
        """The updated step's RequestOutputs; stop strings found in its text finish their requests."""
        stops = self.output_processor.process(step.sched_out, result, touched, step.scheduled_time)
        if stops:
            self.scheduler.finish_by_stop_strings((s.request, s.num_output_tokens, s.stop) for s in stops)
        return self.output_processor.make_outputs()

    def _drafting(self) -> bool:
        """Decided once per step, before it is scheduled: whether it verifies drafts. Such a step runs after
        the one in flight is updated (its drafts start at the last sampled token) and the proposer runs for
        it alone; while the draft budget has speculation off, the proposer is not called and steps stay
        asynchronous."""
        if self.proposer is None:
            return False
        # The batch this step will run: the running requests and those it may admit.
        batch = min(len(self.scheduler.running) + len(self.scheduler.waiting), self.config.args.max_num_seqs)
        return self.drafter is None or self.drafter.decide(batch).num_draft_tokens > 0

    def set_proposer(self, proposer: Proposer | None) -> None:
        """Speculative decoding with `proposer`'s drafts (None: off). Steps then run one at a time: a
        proposer needs each step's tokens before the next step is scheduled."""
        self.proposer = proposer

    def _propose(self) -> None:
        """Drafts for the step about to be scheduled. Requests with a step in flight (pipeline batches) are
        left out: their drafts would start at the wrong position."""
        running = [r for r in self.scheduler.running if not r.num_pending_outputs]
        if running:
            drafts = self.proposer.propose(running)
            if drafts:
                self.scheduler.update_draft_token_ids(drafts)

    def get_stats(self) -> EngineStats:
        pc = self.kv_cache_manager.prefix_cache_stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache_manager.usage(),
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_preemptions_by_mode=dict(self.scheduler.num_preemptions_by_mode),
            spec_decode=self.drafter.totals.copy() if self.drafter is not None else None,
            num_speculative_tokens=self.drafter.last_choice.num_draft_tokens if self.drafter is not None else None,
            speculation_reason=self.drafter.last_choice.reason if self.drafter is not None else None,
        )

