"""What crosses to worker processes each step: a small diff of the SchedulerOutput, not the requests.

A request's prompt and sampling parameters travel once, in the first step that schedules it
(NewRequestData); every later step carries only its id, where its chunk starts, how many tokens it
computes, its new block ids and the output tokens sampled since the workers last heard of it (one per
decode step, none while the step that samples it is still in flight) — vLLM's CachedRequestData.
Workers rebuild the same ScheduledRequest objects the in-process runner gets, so one runner serves both.

Every other SchedulerOutput field (finished and preempted ids, and whatever per-step lists are added to
it later, e.g. swap-in/out blocks) is forwarded as it is, generically.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvserve.core.scheduler import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput


@dataclass
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: object


@dataclass
class StepMessage:
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Per scheduled request: (id, start_pos, num_tokens, new_block_ids, is_new, needs_sample, output_len,
    # output ids sampled since the last message). A tuple, not an object: it pickles in a few bytes.
    scheduled: list[tuple] = field(default_factory=list)
    other_fields: dict = field(default_factory=dict)  # the SchedulerOutput's other fields, as they are


_OTHER_FIELDS = [f.name for f in dataclasses.fields(SchedulerOutput) if f.name != "scheduled"]


class StepMessageBuilder:
    """Driver side: remembers how many output tokens the workers know per request."""

    def __init__(self):
        self.known_outputs: dict[str, int] = {}

    def build(self, out: SchedulerOutput) -> StepMessage:
        known = self.known_outputs
        for rid in out.finished_req_ids:  # before new ones: a finished id may be reused in this very step
            known.pop(rid, None)
        msg = StepMessage(other_fields={name: getattr(out, name) for name in _OTHER_FIELDS})
        for s in out.scheduled:
            rid = s.request_id
            sent = known.get(rid)
            if sent is None:
                msg.new_requests.append(NewRequestData(rid, s.prompt_token_ids, s.sampling_params))
                sent = 0
            outputs = s.output_token_ids
            n = len(outputs)
            msg.scheduled.append((rid, s.start_pos, len(s.token_ids), s.new_block_ids, s.is_new, s.needs_sample,
                                  s.output_len, outputs[sent:n] if n > sent else ()))
            known[rid] = n
        return msg


@dataclass
class _WorkerRequest:
    prompt_token_ids: list[int]
    sampling_params: object
    output_token_ids: list[int] = field(default_factory=list)


class WorkerRequestStates:
    """Worker side: each live request's prompt, parameters and outputs, rebuilt from the messages."""

    def __init__(self):
        self.requests: dict[str, _WorkerRequest] = {}

    def apply(self, msg: StepMessage) -> SchedulerOutput:
        reqs = self.requests
        for rid in msg.other_fields.get("finished_req_ids", ()):
            reqs.pop(rid, None)
        for new in msg.new_requests:
            reqs[new.request_id] = _WorkerRequest(new.prompt_token_ids, new.sampling_params)
        scheduled = []
        for rid, start, num, block_ids, is_new, needs_sample, output_len, new_outputs in msg.scheduled:
            req = reqs[rid]
            if new_outputs:
                req.output_token_ids.extend(new_outputs)
            scheduled.append(ScheduledRequest(
                request_id=rid, token_ids=_tokens(req, start, start + num), start_pos=start,
                new_block_ids=block_ids, is_new=is_new, needs_sample=needs_sample,
                sampling_params=req.sampling_params, output_len=output_len,
                prompt_token_ids=req.prompt_token_ids, output_token_ids=req.output_token_ids,
            ))
        return SchedulerOutput(scheduled=scheduled, **msg.other_fields)


def _tokens(req: _WorkerRequest, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + outputs; positions past the known ones are the in-flight step's
    sampled tokens (placeholders, filled on the device), exactly as the scheduler wrote them."""
    prompt, outputs = req.prompt_token_ids, req.output_token_ids
    p = len(prompt)
    known = p + len(outputs)
    stop = min(end, known)
    if stop <= p:
        tokens = prompt[start:stop]
    elif start >= p:
        tokens = outputs[start - p:stop - p]
    else:
        tokens = prompt[start:] + outputs[:stop - p]
    if end > known:
        tokens += [PLACEHOLDER_TOKEN_ID] * (end - known)
    return tokens
