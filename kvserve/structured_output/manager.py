"""StructuredOutputManager: the one owner of every constrained request's matcher (engine side).

The scheduler asks it whether a waiting request's grammar is compiled (a request waits for its grammar
without holding up others), feeds it every sampled token in its update (the matcher advances; its
termination ends the request) and tells it when a request ends. After each schedule the engine asks it
for the step's token bitmask: one int32 row of ceil(vocab / 32) words per constrained request that
samples, which the model runner applies to the logits before sampling.

With a reasoning parser, a request's constraint starts after its thinking ends (the end-of-thinking
token sequence): until then its matcher sees no tokens and its row allows every token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvserve.structured_output.backend import Matcher
from kvserve.structured_output.compiler import GrammarCompiler
from kvserve.structured_output.reasoning import thinking_ended_in

logger = logging.getLogger(__name__)

WAITING, READY, FAILED = "waiting", "ready", "failed"


@dataclass
class _State:
    future: object  # Future of the CompiledGrammar
    matcher: Matcher | None = None
    thinking: bool = False  # still inside the reasoning section: the constraint does not apply yet
    error: str | None = None
    num_accepted: int = 0
    recent: list[int] = field(default_factory=list)  # the last tokens, to spot the end of thinking


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, reasoning_start_ids: list[int] | None = None,
                 reasoning_end_ids: list[int] | None = None):
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self.reasoning_start_ids = list(reasoning_start_ids or [])
        self.reasoning_end_ids = list(reasoning_end_ids or [])
        self._states: dict[str, _State] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    # ---- lifecycle (the engine adds, the scheduler frees) -------------------------------------------
    def add_request(self, request_id: str, params, prompt_token_ids: list[int]) -> None:
        thinking = bool(self.reasoning_end_ids) and not thinking_ended_in(
            prompt_token_ids, self.reasoning_start_ids, self.reasoning_end_ids)
        self._states[request_id] = _State(self.compiler.submit(params), thinking=thinking)

    def free(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def status(self, request_id: str) -> str:
        """READY once its grammar is compiled (its matcher is made then), FAILED if it cannot be."""
        st = self._states[request_id]
        if st.matcher is not None:
            return READY
        if st.error is not None:
            return FAILED
        if not st.future.done():
            return WAITING
        try:
            st.matcher = st.future.result().new_matcher()
        except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
            st.error = str(e)
            logger.error("Request %s: its structured output could not be compiled: %s", request_id, e)
            return FAILED
        return READY

    def error(self, request_id: str) -> str | None:
        st = self._states.get(request_id)
        return st.error if st is not None else None

    # ---- tokens (the scheduler's update) --------------------------------------------------------------
    def accept_token(self, request_id: str, token_id: int) -> bool:
        """Advances the request's matcher; returns whether its grammar has ended (the request is done)."""
        st = self._states[request_id]
        if st.thinking:
            st.recent.append(token_id)
            n = len(self.reasoning_end_ids)
            del st.recent[:-n]
            if st.recent == self.reasoning_end_ids:
                st.thinking = False
            return False
        if not st.matcher.accept_token(token_id):
            # Cannot happen while the mask is applied; if it does, stop rather than emit invalid output.
            logger.error("Request %s: token %d is not allowed by its grammar; stopping it.", request_id, token_id)
            return True
        st.num_accepted += 1
        return st.matcher.is_terminated()

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (rejected draft tokens)."""
        st = self._states[request_id]
        num_tokens = min(num_tokens, st.num_accepted)
        if num_tokens:
            st.matcher.rollback(num_tokens)
            st.num_accepted -= num_tokens

    def is_constrained_now(self, request_id: str) -> bool:
        st = self._states.get(request_id)
        return st is not None and st.matcher is not None and not st.thinking

    # ---- the step's mask ------------------------------------------------------------------------------
    def any_constrained(self, scheduled) -> bool:
        """Whether a request that samples in this step has a constraint (in its thinking or not yet: the
        update before the step may end the thinking)."""
        return any(s.needs_sample and s.request_id in self._states for s in scheduled)

    def grammar_bitmask(self, scheduled) -> tuple[torch.Tensor | None, dict[str, int]]:
        """(int32 [rows, words] bitmask, request id -> row) for the scheduled requests that sample this step
        under a constraint; (None, {}) when there are none."""
        rows = [s.request_id for s in scheduled if s.needs_sample and self.is_constrained_now(s.request_id)]
        if not rows:
            return None, {}
        bitmask = torch.empty((len(rows), self.num_words), dtype=torch.int32)
        for i, rid in enumerate(rows):
            self._states[rid].matcher.fill_bitmask(bitmask, i)
        return bitmask, {rid: i for i, rid in enumerate(rows)}
