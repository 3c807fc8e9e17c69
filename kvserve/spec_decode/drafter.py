"""The engine's speculative-decoding owner: the configured proposer, sized each step by the draft budget,
and the acceptance it measured (for the budget, /metrics and the log line). Pure Python: it runs in the
step loop on the host, deciding before each step whether it drafts."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvserve.spec_decode.draft_budget import BudgetChoice, DraftBudget
from kvserve.spec_decode.draft_slots import DraftSlots
from kvserve.spec_decode.ngram_proposer import NgramProposer
from kvserve.speculative_config import SpeculativeConfig
from kvserve.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger("kvserve.spec_decode")

# Tokens per step past which a step's GEMMs stop being bound by reading the weights: on a GPU a decode
# step costs about the same up to ~128 tokens; on a CPU the arithmetic dominates after a few.
SATURATION_TOKENS = {"cuda": 128, "cpu": 8}
# A verify step's time over a plain decode step's of as many requests, before saturation: on CUDA it runs
# synchronously (no host work overlaps the GPU), in a mixed-step graph, through the rejection sampler, with
# the proposer's host time; an H200 with the Llama-3.1-8B shape measures 1.30-1.33x at batch 1, k = 1..8
# (BENCHMARKS.md, speculative decoding). CPU steps are synchronous with or without drafts.
VERIFY_OVERHEAD = {"cuda": 1.3, "cpu": 1.0}
# What each request beyond the first adds to that overhead: a synchronous step exposes the host's work for
# the batch, which an asynchronous decode step hides behind the GPU; from the same H200's verify step at batch
# 64 (BENCHMARKS.md, speculative decoding: gpu_spec.py part b). CPU steps hide nothing either way.
VERIFY_OVERHEAD_PER_REQUEST = {"cuda": 0.015, "cpu": 0.0}
# Gain a step with drafts must promise beyond its modelled cost (the model is an estimate).
MIN_GAIN = {"cuda": 1.05, "cpu": 1.03}
# Requests a probe (one draft, while speculation is off for acceptance) asks the proposer about: enough to
# measure, few enough that catching their indexes up and verifying them costs little whatever the batch.
PROBE_REQUESTS = 8


def _weights_read_per_step(cfg) -> int:
    """Parameters a decode step reads: all but an untied input embedding (only its looked-up rows)."""
    return cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


class Drafter:
    def __init__(self, spec: SpeculativeConfig, device_type: str, draft_step_cost: float = 0.0):
        """`draft_step_cost`: one draft forward's cost relative to the target's (0 for n-gram lookup)."""
        self.spec = spec
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                          spec.prompt_lookup_max)
        elif spec.method in ("draft_model", "eagle3"):
            self.proposer = DraftSlots(spec.num_speculative_tokens)
        else:
            raise ValueError(f"--speculative-config: method {spec.method} has no proposer yet")
        self.budget = DraftBudget(spec.num_speculative_tokens,
                                  saturation_tokens=SATURATION_TOKENS.get(device_type, SATURATION_TOKENS["cuda"]),
                                  draft_step_cost=draft_step_cost,
                                  verify_overhead=VERIFY_OVERHEAD.get(device_type, VERIFY_OVERHEAD["cuda"]),
                                  verify_overhead_per_request=VERIFY_OVERHEAD_PER_REQUEST.get(
                                      device_type, VERIFY_OVERHEAD_PER_REQUEST["cuda"]),
                                  min_gain=MIN_GAIN.get(device_type, MIN_GAIN["cuda"]))
        self.totals = SpecDecodeStats()  # since start: /metrics counters and the log line take differences
        self.last_choice = BudgetChoice(spec.num_speculative_tokens, "on")

    @classmethod
    def from_config(cls, config) -> "Drafter":
        """The engine's drafter for an EngineConfig with a speculative config. A draft model's step is
        bound by reading its weights, as the target's: its cost is the ratio of their parameters."""
        cost = 0.0
        if config.draft_model_config is not None:
            cost = _weights_read_per_step(config.draft_model_config) / _weights_read_per_step(config.model_config)
        return cls(config.args.speculative_config, config.device, draft_step_cost=cost)

    def decide(self, batch_size: int) -> BudgetChoice:
        """Once per step: the draft tokens per request for the coming steps of `batch_size` requests. An
        idle engine keeps its last choice (nothing to decide, nothing to log)."""
        if batch_size == 0:
            return self.last_choice
        choice = self.budget.choose(batch_size)
        if choice.reason != self.last_choice.reason:
            logger.info("speculative decoding: %d draft tokens per request (%s; %d running; %s)",
                        choice.num_draft_tokens, choice.reason, batch_size, self.budget.describe())
        self.last_choice = choice
        return choice

    def propose(self, requests: Sequence) -> dict[str, list[int]]:
        """Drafts for the decoding requests among `requests` (for the first PROBE_REQUESTS of them in a
        probe): one still in its prompt's prefill has no use for them until its last chunk, and would count
        as a request without a draft."""
        k = self.last_choice.num_draft_tokens
        if not k:
            return {}
        decoding = [r for r in requests if r.output_token_ids]
        if self.last_choice.reason == "probe":
            decoding = decoding[:PROBE_REQUESTS]
        if not decoding:
            return {}
        drafts = self.proposer.propose(decoding, k)
        self.budget.record_proposals(len(decoding), len(drafts))
        return drafts

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verify result."""
        self.budget.record(num_draft_tokens, num_accepted)
        self.totals.observe(num_draft_tokens, num_accepted)
