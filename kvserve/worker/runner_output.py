"""What one model-runner step hands back to the engine: each request's new tokens, and logprobs where asked.

Also computes prompt logprobs: the model's distribution at every prompt position of the requests that
asked, chunk by chunk as the prompt is prefilled.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from kvserve.worker.sampler import gather_logprobs

# Prompt positions per logits slice: bounds the [positions, vocab] float32 logits held at once.
_PROMPT_LOGITS_SLICE = 256


@dataclass
class PositionLogprobs:
    """Raw-distribution logprobs at consecutive positions: per position, the chosen (or actual) token
    first, then the top alternatives; `ranks[i]` is the chosen token's rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class RunnerOutput:
    req_ids: list[str] = field(default_factory=list)  # the requests that sampled, in batch order
    # Per request: its new tokens (one, or the drafts it accepted and one more).
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)  # one position per new token
    # request id -> (index in the prompt of the first token scored, logprobs of consecutive prompt tokens)
    prompt_logprobs: dict[str, tuple[int, PositionLogprobs]] = field(default_factory=dict)


class PendingOutput:
    """A launched step's results, still on the device. Their copies to pinned host memory are queued
    behind the step's kernels at once; `result()` waits for them only (not for later steps queued since)."""

    def __init__(self, rids: list[str], sampler_out, wants_logprobs: list[bool],
                 prompt_logprobs: dict | None = None, verified=None):
        """`verified`: instead of `sampler_out`, a step that verified drafts (spec_verify.VerifyOutput): per
        request its new tokens, padded with -1, and logprobs with one row per new token."""
        self.rids = rids
        self.wants_logprobs = wants_logprobs
        self.prompt_logprobs = prompt_logprobs or {}
        self.multi_token = verified is not None
        out = verified if verified is not None else sampler_out
        tensors = [] if out is None else [verified.token_ids if verified is not None else sampler_out.sampled]
        if out is not None and out.logprobs is not None:
            tensors += [out.logprob_token_ids, out.logprobs, out.sampled_ranks]
        self.event = None
        if tensors and tensors[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensors
        self._result: RunnerOutput | None = None

    @classmethod
    def empty(cls, prompt_logprobs: dict | None = None) -> PendingOutput:
        return cls([], None, [], prompt_logprobs)

    def result(self) -> RunnerOutput:
        if self._result is None:
            if self.event is not None:
                self.event.synchronize()
            out = RunnerOutput(req_ids=self.rids, prompt_logprobs=self.prompt_logprobs)
            if self.host and self.multi_token:
                out.sampled_token_ids = [[t for t in row if t >= 0] for row in self.host[0].tolist()]
            elif self.host:
                out.sampled_token_ids = [[t] for t in self.host[0].tolist()]
            if len(self.host) > 1:
                ids, lps, ranks = (t.tolist() for t in self.host[1:])
                row = 0  # logprobs rows: one per new token, request after request
                for j, rid in enumerate(self.rids):
                    n = len(out.sampled_token_ids[j])
                    if self.wants_logprobs[j]:
                        out.logprobs[rid] = PositionLogprobs(ids[row:row + n], lps[row:row + n], ranks[row:row + n])
                    row += n
            self._result = out
        return self._result


class DeferredOutput:
    """A launched step whose sampling waits for its grammar bitmask: under async scheduling a constrained
    request's mask needs the previous step's token, which the engine learns while this step's forward runs.
    `resolve` hands it the sampled step; `result()` waits for that (the mp worker's reply thread waits here;
    in the engine's own process the mask is always sent before the result is read)."""

    def __init__(self):
        self._pending: PendingOutput | None = None
        self._resolved = threading.Event()

    def resolve(self, pending: PendingOutput) -> None:
        self._pending = pending
        self._resolved.set()

    def result(self) -> RunnerOutput:
        self._resolved.wait()
        return self._pending.result()


def prompt_logprob_targets(scheduled, query_start_loc: list[int]) -> list[tuple]:
    """(scheduled request, top-k, first flat token index, first target position, count) for every scheduled
    chunk that holds prompt positions whose next token is still a prompt token."""
    targets = []
    for i, s in enumerate(scheduled):
        k = getattr(s.sampling_params, "prompt_logprobs", None)
        if k is None:
            continue
        # Token at position t predicts token t + 1; the last prompt position predicts the first output.
        end = min(s.start_pos + len(s.token_ids), len(s.prompt_token_ids) - 1)
        if end > s.start_pos:
            targets.append((s, k, query_start_loc[i], s.start_pos + 1, end - s.start_pos))
    return targets


def compute_prompt_logprobs(scheduled, query_start_loc: list[int], hidden: torch.Tensor, compute_logits,
                            vocab_size: int) -> dict[str, tuple[int, PositionLogprobs]]:
    result = {}
    for s, k, flat_start, first_target, count in prompt_logprob_targets(scheduled, query_start_loc):
        prompt = s.prompt_token_ids
        num = vocab_size if k == -1 else min(k, vocab_size)
        ids, lps, ranks = [], [], []
        for off in range(0, count, _PROMPT_LOGITS_SLICE):
            n = min(_PROMPT_LOGITS_SLICE, count - off)
            logits = compute_logits(hidden[flat_start + off:flat_start + off + n]).float()
            actual = torch.tensor(prompt[first_target + off:first_target + off + n], device=logits.device)
            t, lp, r = gather_logprobs(logits.log_softmax(-1), num, actual)
            ids += t.tolist()
            lps += lp.tolist()
            ranks += r.tolist()
        result[s.request_id] = (first_target, PositionLogprobs(ids, lps, ranks))
    return result
