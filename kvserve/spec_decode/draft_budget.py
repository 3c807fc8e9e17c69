"""How many draft tokens each request gets this step: the turn-down that keeps speculation from being slower.

A verify step with k drafts for each of the h*B requests that have one computes B(1 + hk) tokens instead of
B. While a step is bound by reading the weights (small B(1 + hk)) the extra tokens cost little; once
B(1 + hk) passes the point where the GEMMs become compute-bound, the step takes time in proportion to its
tokens, and drafts that are rejected are paid in full. A drafting step also costs more than its GEMMs: it
runs synchronously (the proposer needs the step's tokens, so no host work overlaps the device), samples
through the rejection sampler, and runs the proposer on the host: `verify_overhead`, the time of a verify
step over a plain decode step of as many requests before saturation. So the budget picks

    k* = argmax over k in 0..K of  expected tokens per request and step (k) / relative step cost (B, k)

from the measured per-position acceptance and the measured share h of requests the proposer finds a draft
for, and speculation is off (k* = 0) unless it gains at least `min_gain`. Expected tokens with per-position
conditional acceptance a_1..a_k: 1 + h * sum_j prod_{i<=j} a_i. Step cost:
(verify_overhead + verify_overhead_per_request * (B - 1)) * max(1, B(1 + hk) / saturation_tokens) /
max(1, B / saturation_tokens), plus k draft steps at `draft_step_cost` each (0 for n-gram lookup; a draft
model's forward relative to the target's). The per-request term is the host's work for the batch, which a
synchronous drafting step leaves exposed and an asynchronous plain step hides.

While off because drafts are rarely right or rarely found (not because of the batch), one step proposes a
single draft after `probe_interval` steps off, so the estimate can recover when the workload changes; each
probe that leaves speculation off doubles the wait, up to `max_probe_interval`. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetChoice:
    num_draft_tokens: int
    reason: str  # for the log and /metrics: "on", "probe", or what turned it down: "batch size", "draft cost",
    # "acceptance" (drafts rarely right, or rarely found)


class DraftBudget:
    def __init__(self, num_speculative_tokens: int, saturation_tokens: int = 128, draft_step_cost: float = 0.0,
                 verify_overhead: float = 1.0, verify_overhead_per_request: float = 0.0,
                 min_gain: float = 1.03, smoothing: float = 0.05,
                 prior_acceptance: float = 0.7, probe_interval: int = 32, max_probe_interval: int = 256):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if verify_overhead < 1.0:
            raise ValueError(f"verify_overhead must be >= 1, got {verify_overhead}")
        self.max_k = num_speculative_tokens
        self.saturation_tokens = saturation_tokens
        self.draft_step_cost = draft_step_cost
        if verify_overhead_per_request < 0.0:
            raise ValueError(f"verify_overhead_per_request must be >= 0, got {verify_overhead_per_request}")
        self.verify_overhead = verify_overhead
        self.verify_overhead_per_request = verify_overhead_per_request
        self.min_gain = min_gain
        self.smoothing = smoothing
        self.probe_interval = probe_interval
        self.max_probe_interval = max(probe_interval, max_probe_interval)
        # acceptance[j]: P(draft j + 1 accepted | drafts 1..j accepted), an exponential moving average.
        self.acceptance = [prior_acceptance] * num_speculative_tokens
        # Share of the requests offered to the proposer that got a draft (same smoothing, per request).
        self.hit_rate = 1.0
        self._steps_off = 0
        self._wait = probe_interval  # steps off before the next probe

    # ---- measurements --------------------------------------------------------------------------------
    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verify result: of its drafts, the leading `num_accepted` were accepted."""
        if not 0 <= num_accepted <= num_draft_tokens <= self.max_k:
            raise ValueError(f"need 0 <= accepted ({num_accepted}) <= drafts ({num_draft_tokens}) <= {self.max_k}")
        tested = min(num_accepted + 1, num_draft_tokens)  # positions after the first rejection were not tried
        a = self.smoothing
        for j in range(tested):
            self.acceptance[j] += a * ((1.0 if j < num_accepted else 0.0) - self.acceptance[j])

    def record_proposals(self, num_offered: int, num_with_drafts: int) -> None:
        """One proposer call: of `num_offered` requests, `num_with_drafts` got a draft. Weighted as that many
        single-request updates of the moving average."""
        if not 0 <= num_with_drafts <= num_offered:
            raise ValueError(f"need 0 <= requests with drafts ({num_with_drafts}) <= offered ({num_offered})")
        if num_offered:
            kept = (1.0 - self.smoothing) ** num_offered
            share = num_with_drafts / num_offered
            self.hit_rate = min(1.0, max(0.0, self.hit_rate + (1.0 - kept) * (share - self.hit_rate)))

    # ---- the model -----------------------------------------------------------------------------------
    def expected_tokens(self, k: int, hit_rate: float | None = None) -> float:
        """Tokens a request gains per step with k drafts (1 without)."""
        h = self.hit_rate if hit_rate is None else hit_rate
        total, reach = 0.0, 1.0
        for j in range(k):
            reach *= self.acceptance[j]
            total += reach
        return 1.0 + h * total

    def relative_cost(self, batch_size: int, k: int, hit_rate: float | None = None,
                      draft_step_cost: float | None = None) -> float:
        """A step of `batch_size` requests with k drafts for the share `hit_rate` of them, over a plain one."""
        if k == 0:
            return 1.0
        h = self.hit_rate if hit_rate is None else hit_rate
        draft = self.draft_step_cost if draft_step_cost is None else draft_step_cost
        sat = self.saturation_tokens
        target = max(1.0, batch_size * (1 + h * k) / sat) / max(1.0, batch_size / sat)
        overhead = self.verify_overhead + self.verify_overhead_per_request * max(0, batch_size - 1)
        return overhead * target + k * draft

    def _best(self, batch_size: int) -> tuple[int, float]:
        best_k, best_gain = 0, 1.0
        for k in range(1, self.max_k + 1):
            gain = self.expected_tokens(k) / self.relative_cost(batch_size, k)
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k, best_gain

    def _best_case_gain(self, batch_size: int, draft_step_cost: float) -> float:
        """The gain if every request had drafts and every draft were right."""
        return max((1 + k) / self.relative_cost(batch_size, k, 1.0, draft_step_cost) for k in range(1, self.max_k + 1))

    def would_draft(self, batch_size: int) -> bool:
        """Whether drafts could pay at this batch size at all (every request drafting, every draft right)."""
        return batch_size >= 1 and self._best_case_gain(batch_size, self.draft_step_cost) >= self.min_gain

    # ---- the choice ----------------------------------------------------------------------------------
    def choose(self, batch_size: int) -> BudgetChoice:
        """Drafts per request for a step of `batch_size` decoding requests."""
        if not self.would_draft(batch_size):
            # Whether the batch alone rules drafts out, or a draft forward costs more than it can save.
            free = self._best_case_gain(batch_size, 0.0) >= self.min_gain if batch_size >= 1 else False
            return BudgetChoice(0, "draft cost" if free else "batch size")
        k, gain = self._best(batch_size)
        if k > 0 and gain >= self.min_gain:
            self._steps_off = 0
            self._wait = self.probe_interval
            return BudgetChoice(k, "on")
        self._steps_off += 1
        if self._steps_off >= self._wait:
            self._steps_off = 0
            self._wait = min(2 * self._wait, self.max_probe_interval)
            return BudgetChoice(1, "probe")
        return BudgetChoice(0, "acceptance")

    def describe(self) -> str:
        return (f"drafts found for {self.hit_rate:.0%} of requests, per-position acceptance "
                + ", ".join(f"{a:.2f}" for a in self.acceptance))
