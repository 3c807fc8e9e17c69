"""Turns each step's sampled tokens into RequestOutputs: text, stop strings, logprobs, metrics.

A user request ("parent") has n samples; each is its own core Request ("child", id f"{i}_{parent}" when
n > 1). Children are aggregated back into one RequestOutput per parent and step, as the parent's
output_kind asks:
  CUMULATIVE  every sample, with everything generated so far
  DELTA       the samples that advanced this step, with only what is new
  FINAL_ONLY  once, when every sample has finished

A step is processed in two calls: `process` takes in the new tokens (text, logprobs) and returns the
stop strings it found, as finish commands for the scheduler (the only writer of a request's status);
`make_outputs` then builds the step's RequestOutputs from the requests as the scheduler left them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvserve.core.request import Request, RequestStatus
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class StopStringFound:
    """A finish command: `request` ends with its first `num_output_tokens` tokens, stopped by `stop`."""

    request: Request
    num_output_tokens: int
    stop: str


class SampleState:
    """One sample's output so far, and how much of it has been sent."""

    def __init__(self, index: int, parent: "ParentState", request: Request, detokenizer):
        self.index = index
        self.parent = parent
        self.request = request
        self.detokenizer: IncrementalDetokenizer | None = detokenizer
        wants_logprobs = request.sampling_params.logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if wants_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None
        self.num_processed = 0  # output tokens seen
        self.num_sent = 0  # output tokens (and logprobs) already in a DELTA output


class ParentState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.samples: list[SampleState] = []
        self.prompt_logprobs = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(prompt_token_ids)
        self.prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        for s in self.samples:  # a plain loop: read for every advanced request in every step
            if s.request.status < RequestStatus.FINISHED_STOPPED:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.parents: dict[str, ParentState] = {}
        self.samples: dict[str, SampleState] = {}
        self._advanced: dict[str, list[SampleState]] = {}  # process() -> make_outputs(): samples with new tokens
        self._token_text: dict[int, str] = {}  # logprob alternatives repeat a lot: decode each id once

    # ---- requests --------------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            requests: list[Request], arrival_time: float | None = None) -> None:
        parent = ParentState(request_id, prompt, prompt_token_ids, params, arrival_time or time.time())
        for i, req in enumerate(requests):
            p = req.sampling_params
            detok = None
            if p.detokenize and self.tokenizer is not None:
                stream = params.output_kind != RequestOutputKind.FINAL_ONLY
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p, stream=stream)
            state = SampleState(i, parent, req, detok)
            parent.samples.append(state)
            self.samples[req.request_id] = state
        self.parents[request_id] = parent

    def sample_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [s.request.request_id for s in parent.samples] if parent else [request_id]

    def abort(self, request_ids: list[str]) -> list[str]:
        """Forgets these parents; returns the core request ids to abort."""
        ids = []
        for rid in request_ids:
            ids.extend(self.sample_ids(rid))
            self._drop(rid)
        return ids

    def _drop(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        for s in parent.samples if parent else ():
            self.samples.pop(s.request.request_id, None)

    # ---- one step --------------------------------------------------------------------------------
    def process(self, sched_out, runner_out, touched: list[Request], scheduled_time: float) -> list[StopStringFound]:
        """Takes in one step's new tokens; returns the stop strings found, for the scheduler to apply before
        make_outputs. `scheduled_time`: when sched_out was scheduled (before the forward pass)."""
        for s in sched_out.scheduled:
            if s.is_new:
                state = self.samples.get(s.request_id)
                if state is not None and state.parent.metrics.first_scheduled_time is None:
                    state.parent.metrics.first_scheduled_time = scheduled_time
        for rid, (first, lists) in runner_out.prompt_logprobs.items():
            state = self.samples.get(rid)
            if state is not None and state.parent.prompt_logprobs is not None:
                params = state.parent.params
                num = self._num_alternatives(params.prompt_logprobs)
                for j, rank in enumerate(lists.ranks):
                    state.parent.prompt_logprobs[first + j] = self._logprob_dict(
                        lists.token_ids[j], lists.logprobs[j], rank, num, params.detokenize)

        stops = []
        advanced = self._advanced = {}  # parent id -> samples with new tokens, in order
        samples = self.samples
        for req in touched:
            state = samples.get(req.request_id)
            if state is None:
                continue
            first = state.num_processed
            new_ids = req.output_token_ids[first:]
            state.num_processed = len(req.output_token_ids)
            lp = runner_out.logprobs.get(req.request_id)
            if lp is not None and state.logprobs is not None:
                num = self._num_alternatives(req.sampling_params.logprobs)
                # A stop inside an accepted run keeps only the tokens up to it: their logprobs too.
                for j, rank in enumerate(lp.ranks[:len(new_ids)]):
                    state.logprobs.append(self._logprob_dict(
                        lp.token_ids[j], lp.logprobs[j], rank, num, req.sampling_params.detokenize))
                    state.cumulative_logprob += lp.logprobs[j][0]
            if state.detokenizer is not None:
                found = self._detokenize(state.detokenizer, req, new_ids)
                if found is not None:  # the same token may also end the request otherwise: the stop string wins (vLLM)
                    num_kept, stop = found
                    stops.append(StopStringFound(req, first + num_kept, stop))
                    state.num_processed = first + num_kept
                    if state.logprobs is not None:
                        del state.logprobs[first + num_kept:]
            parent_id = state.parent.request_id
            if parent_id in advanced:
                advanced[parent_id].append(state)
            else:
                advanced[parent_id] = [state]
        return stops

    @staticmethod
    def _detokenize(detokenizer: IncrementalDetokenizer, req: Request, new_ids: list[int]) -> tuple[int, str] | None:
        """Adds the new tokens to the text; (tokens kept, stop string) when a stop string ends the output.
        Several new tokens (accepted drafts) go in one by one: a stop string inside them drops the rest."""
        stop_terminated = req.status == RequestStatus.FINISHED_STOPPED
        if len(new_ids) == 1:
            stop = detokenizer.update(new_ids, stop_terminated=stop_terminated, finished=req.is_finished)
            return None if stop is None else (1, stop)
        last = len(new_ids) - 1
        for j, tok in enumerate(new_ids):
            stop = detokenizer.update([tok], stop_terminated=stop_terminated and j == last,
                                      finished=req.is_finished and j == last)
            if stop is not None:
                return j + 1, stop
        return None

    def make_outputs(self) -> list[RequestOutput]:
        """The step's RequestOutputs, once the scheduler has applied what process() returned."""
        now = time.time()
        advanced, self._advanced = self._advanced, {}
        outputs = []
        for parent_id, states in advanced.items():
            parent = self.parents[parent_id]
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
                self._drop(parent_id)
            out = self._make_output(parent, states, finished)
            if out is not None:
                outputs.append(out)
        return outputs

    # ---- outputs ---------------------------------------------------------------------------------
    def _make_output(self, parent: ParentState, advanced: list[SampleState], finished: bool) -> RequestOutput | None:
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        metrics = parent.metrics
        metrics.num_draft_tokens = sum(s.request.num_draft_tokens for s in parent.samples)
        metrics.num_accepted_tokens = sum(s.request.num_accepted_tokens for s in parent.samples)
        metrics.num_prompt_tokens = len(parent.prompt_token_ids)
        metrics.sample_generation_tokens = [len(s.request.output_token_ids) for s in parent.samples]
        if finished:
            metrics.finish_reason = parent.samples[0].request.status.finish_reason
        delta = kind == RequestOutputKind.DELTA
        samples = sorted(advanced, key=lambda s: s.index) if delta else parent.samples
        prompt_logprobs = parent.prompt_logprobs
        if delta:
            prompt_logprobs = None if parent.prompt_logprobs_sent else prompt_logprobs
            parent.prompt_logprobs_sent = True
        leader = parent.samples[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[self._completion(s, delta) for s in samples],
            finished=finished,
            num_cached_tokens=max(leader.num_cached_tokens, 0),
            metrics=parent.metrics,
            prompt_logprobs=prompt_logprobs,
            num_preemptions=sum(s.request.num_preemptions for s in parent.samples),
        )

    def _completion(self, state: SampleState, delta: bool) -> CompletionOutput:
        req = state.request
        done = req.is_finished
        text = state.detokenizer.get_next_output_text(done, delta) if state.detokenizer is not None else ""
        start = state.num_sent if delta else 0
        end = len(req.output_token_ids)
        state.num_sent = end
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=req.output_token_ids[start:end],
            cumulative_logprob=state.cumulative_logprob,
            logprobs=None if state.logprobs is None else state.logprobs[start:end],
            finish_reason=req.status.finish_reason if done else None,
            stop_reason=req.stop_reason if done else None,
        )

    # ---- logprobs --------------------------------------------------------------------------------
    def _num_alternatives(self, k: int) -> int:
        return self.vocab_size if k == -1 else k

    def _decoded(self, token_id: int, decode: bool) -> str | None:
        if self.tokenizer is None or not decode:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprob_dict(self, token_ids: list[int], logprobs: list[float], rank: int, num: int,
                      decode: bool) -> dict[int, Logprob]:
        """The chosen token first (its own rank), then the top `num` alternatives ranked 1..num; a chosen
        token among them keeps the alternative's entry, as in vLLM."""
        out = {token_ids[0]: Logprob(logprobs[0], rank, self._decoded(token_ids[0], decode))}
        for r in range(1, min(num, len(token_ids) - 1) + 1):
            out[token_ids[r]] = Logprob(logprobs[r], r, self._decoded(token_ids[r], decode))
        return out
