"""How many draft tokens each request gets this step: the turn-down that keeps speculation from being slower.

A verify step with k drafts per request computes B(1 + k) tokens instead of B. While a step is bound by
reading the weights (small B(1 + k)) the extra tokens are almost free and every accepted draft is a saved
step; once B(1 + k) passes the point where the GEMMs become compute-bound, the step takes time in
proportion to its tokens, and drafts that are rejected are paid in full. So the budget picks

    k* = argmax over k in 0..K of  expected tokens per step (k) / relative step cost (B, k)

from the measured per-position acceptance, and speculation is off (k* = 0) unless it gains more than
`min_gain`. Expected tokens with per-position conditional acceptance a_1..a_k: 1 + sum_j prod_{i<=j} a_i.
Step cost: max(1, B(1 + k) / saturation_tokens) over max(1, B / saturation_tokens), plus k draft steps at
`draft_step_cost` each (0 for n-gram lookup; a draft model's forward relative to the target's).

While off because acceptance is low (not because of the batch), one step in `probe_interval` proposes a
single draft, so the estimate can recover when the workload changes. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetChoice:
    num_draft_tokens: int
    reason: str  # for the log and /metrics: "on", "probe", or what turned it down: "batch size", "draft cost",
    # "acceptance"


class DraftBudget:
    def __init__(self, num_speculative_tokens: int, saturation_tokens: int = 128, draft_step_cost: float = 0.0,
                 min_gain: float = 1.03, smoothing: float = 0.05, prior_acceptance: float = 0.7,
                 probe_interval: int = 32):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.max_k = num_speculative_tokens
        self.saturation_tokens = saturation_tokens
        self.draft_step_cost = draft_step_cost
        self.min_gain = min_gain
        self.smoothing = smoothing
        self.probe_interval = probe_interval
        # acceptance[j]: P(draft j + 1 accepted | drafts 1..j accepted), an exponential moving average.
        self.acceptance = [prior_acceptance] * num_speculative_tokens
        self._steps_off = 0

    # ---- measurements --------------------------------------------------------------------------------
    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verify result: of its drafts, the leading `num_accepted` were accepted."""
        if not 0 <= num_accepted <= num_draft_tokens <= self.max_k:
            raise ValueError(f"need 0 <= accepted ({num_accepted}) <= drafts ({num_draft_tokens}) <= {self.max_k}")
        tested = min(num_accepted + 1, num_draft_tokens)  # positions after the first rejection were not tried
        a = self.smoothing
        for j in range(tested):
            self.acceptance[j] += a * ((1.0 if j < num_accepted else 0.0) - self.acceptance[j])

    # ---- the choice ----------------------------------------------------------------------------------
    def expected_tokens(self, k: int) -> float:
        total, reach = 1.0, 1.0
        for j in range(k):
            reach *= self.acceptance[j]
            total += reach
        return total

    def relative_cost(self, batch_size: int, k: int) -> float:
        sat = self.saturation_tokens
        target = max(1.0, batch_size * (1 + k) / sat) / max(1.0, batch_size / sat)
        return target + k * self.draft_step_cost

    def _best(self, batch_size: int) -> tuple[int, float]:
        best_k, best_gain = 0, 1.0
        for k in range(1, self.max_k + 1):
            gain = self.expected_tokens(k) / self.relative_cost(batch_size, k)
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k, best_gain

    def would_draft(self, batch_size: int) -> bool:
        """Whether drafts could pay at this batch size at all (one draft, always right)."""
        return batch_size >= 1 and 2.0 / self.relative_cost(batch_size, 1) >= self.min_gain

    def choose(self, batch_size: int) -> BudgetChoice:
        """Drafts per request for a step of `batch_size` decoding requests."""
        if not self.would_draft(batch_size):
            # Whether the batch alone rules drafts out, or a draft forward costs more than it can save.
            sat = self.saturation_tokens
            target_only = max(1.0, 2 * batch_size / sat) / max(1.0, batch_size / sat)
            return BudgetChoice(0, "draft cost" if 2.0 / target_only >= self.min_gain else "batch size")
        k, gain = self._best(batch_size)
        if k > 0 and gain >= self.min_gain:
            self._steps_off = 0
            return BudgetChoice(k, "on")
        self._steps_off += 1
        if self._steps_off >= self.probe_interval:
            self._steps_off = 0
            return BudgetChoice(1, "probe")
        return BudgetChoice(0, "acceptance")

    def describe(self) -> str:
        return "per-position acceptance " + ", ".join(f"{a:.2f}" for a in self.acceptance)
