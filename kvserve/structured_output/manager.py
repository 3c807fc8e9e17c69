"""StructuredOutputManager: the one owner of every constrained request's matcher (engine side).

The scheduler asks it whether a waiting request's grammar is compiled (a request waits for its grammar
without holding up others), feeds it every sampled token in its update (the matcher advances; its
termination ends the request) and tells it when a request ends. After each schedule the engine asks it
for the step's token bitmask: one int32 row of ceil(vocab / 32) words per constrained request that
samples, one per position for a request with draft tokens (speculative decoding), which the model runner
applies to the logits before sampling or verifying.

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
    recent: list[int] = field(default_factory=list)  # the last tokens, to spot the end of thinking


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, reasoning_start_ids: list[int] | None = None,
                 reasoning_end_ids: list[int] | None = None, pin_memory: bool = False):
        self.compiler = compiler
        self.pin_memory = pin_memory  # bitmasks in pinned memory: the runner copies them to the GPU asynchronously
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
            st.thinking = not self._ends_thinking(st.recent, token_id)
            return False
        if not st.matcher.accept_token(token_id):
            # Cannot happen while the mask is applied; if it does, stop rather than emit invalid output.
            logger.error("Request %s: token %d is not allowed by its grammar; stopping it.", request_id, token_id)
            return True
        return st.matcher.is_terminated()

    def _ends_thinking(self, recent: list[int], token_id: int) -> bool:
        """Appends `token_id` to `recent` (the last tokens of the thinking); whether they now end it."""
        recent.append(token_id)
        del recent[:-len(self.reasoning_end_ids)]
        return recent == self.reasoning_end_ids

    def is_constrained_now(self, request_id: str) -> bool:
        st = self._states.get(request_id)
        return st is not None and st.matcher is not None and not st.thinking

    # ---- the step's mask ------------------------------------------------------------------------------
    def any_constrained(self, scheduled) -> bool:
        """Whether a request that samples in this step has a constraint (in its thinking or not yet: the
        update before the step may end the thinking)."""
        return any(s.needs_sample and s.request_id in self._states for s in scheduled)

    def grammar_bitmask(self, scheduled) -> tuple[torch.Tensor | None, dict[str, int]]:
        """(int32 [rows, words] bitmask, request id -> its first row) for the scheduled requests that sample
        this step under a constraint; (None, {}) when there are none. A request with draft tokens has one row
        per position, 1 + len(drafts) consecutive rows: row j allows what may follow its first j drafts."""
        entries = []
        for s in scheduled:
            st = self._states.get(s.request_id)
            drafts = list(getattr(s, "spec_token_ids", ()) or ())
            # In its thinking, a request is unconstrained, unless its drafts may end the thinking.
            if s.needs_sample and st is not None and st.matcher is not None and (not st.thinking or drafts):
                entries.append((s.request_id, st, drafts))
        if not entries:
            return None, {}
        num_rows = sum(1 + len(d) for _, _, d in entries)
        if any(d for _, _, d in entries):
            # All ones by default: a position past a draft the grammar refuses (or its end) is never sampled.
            bitmask = torch.full((num_rows, self.num_words), -1, dtype=torch.int32, pin_memory=self.pin_memory)
        else:
            bitmask = torch.empty((num_rows, self.num_words), dtype=torch.int32, pin_memory=self.pin_memory)
        first_rows, row = {}, 0
        one_row: dict[type, tuple[list, list[int]]] = {}  # per matcher class: (matchers, rows), filled at once
        for rid, st, drafts in entries:
            first_rows[rid] = row
            if drafts:
                self._fill_rows(st, drafts, bitmask, row)
            else:
                matchers, rows = one_row.setdefault(type(st.matcher), ([], []))
                matchers.append(st.matcher)
                rows.append(row)
            row += 1 + len(drafts)
        for cls, (matchers, rows) in one_row.items():
            cls.fill_bitmasks(matchers, bitmask, rows)
        return bitmask, first_rows

    def _fill_rows(self, st: _State, drafts: list[int], bitmask: torch.Tensor, row: int) -> None:
        """Rows row .. row + len(drafts): the matcher advanced over the drafts one by one, filling the row
        before each, then rolled back (the update accepts the tokens the step really appends)."""
        thinking, recent = st.thinking, list(st.recent)
        advanced = 0
        try:
            for j in range(len(drafts) + 1):
                if not thinking:
                    if st.matcher.is_terminated():
                        break  # the grammar ended at the draft before: the request ends there
                    st.matcher.fill_bitmask(bitmask, row + j)
                if j == len(drafts):
                    break
                if thinking:
                    thinking = not self._ends_thinking(recent, drafts[j])
                elif st.matcher.accept_token(drafts[j]):
                    advanced += 1
                else:
                    break  # this row refuses the draft, so the verify rejects it and later rows go unused
        finally:
            if advanced:
                st.matcher.rollback(advanced)
