"""The engine's speculative-decoding owner: the configured proposer, sized each step by the draft budget,
and the acceptance it measured (for the budget, /metrics and the log line). Pure Python: it runs in the
step loop, after each update, on the host."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvserve.spec_decode.draft_budget import BudgetChoice, DraftBudget
from kvserve.spec_decode.ngram_proposer import NgramProposer
from kvserve.spec_decode.spec_config import SpeculativeConfig
from kvserve.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger("kvserve.spec_decode")

# Tokens per step past which a step's GEMMs stop being bound by reading the weights: on a GPU a decode
# step costs about the same up to ~128 tokens; on a CPU the arithmetic dominates after a few.
SATURATION_TOKENS = {"cuda": 128, "cpu": 8}


class Drafter:
    def __init__(self, spec: SpeculativeConfig, device_type: str):
        if spec.method != "ngram":
            raise ValueError(f"--speculative-config: method {spec.method} has no proposer yet")
        self.spec = spec
        self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.budget = DraftBudget(spec.num_speculative_tokens,
                                  saturation_tokens=SATURATION_TOKENS.get(device_type, SATURATION_TOKENS["cuda"]))
        self.totals = SpecDecodeStats()  # since start: /metrics counters and the log line take differences
        self.last_choice = BudgetChoice(spec.num_speculative_tokens, "on")

    def propose(self, requests: Sequence) -> dict[str, list[int]]:
        choice = self.budget.choose(len(requests))
        if choice.reason != self.last_choice.reason:
            logger.info("speculative decoding: %d draft tokens per request (%s; %d running; %s)",
                        choice.num_draft_tokens, choice.reason, len(requests), self.budget.describe())
        self.last_choice = choice
        if not choice.num_draft_tokens:
            return {}
        return self.proposer.propose(requests, choice.num_draft_tokens)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verify result."""
        self.budget.record(num_draft_tokens, num_accepted)
        self.totals.observe(num_draft_tokens, num_accepted)
