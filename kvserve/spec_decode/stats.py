"""Acceptance counts of verify steps, in the terms of vLLM's spec_decode metrics and log line.

One `SpecDecodeStats` per interval: the engine adds each request's verify result, the metrics exporter
turns the counts into `kvserve:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`
and `..._num_accepted_tokens_per_pos`, and the periodic log line shows the mean acceptance length.
Pure Python: it travels with the engine's stats from the engine-core process.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verify results of requests that had at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_accepted:
            self.accepted_per_pos.extend([0] * (num_accepted - len(self.accepted_per_pos)))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def merge(self, other: "SpecDecodeStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for j, n in enumerate(other.accepted_per_pos):
            if j < len(self.accepted_per_pos):
                self.accepted_per_pos[j] += n
            else:
                self.accepted_per_pos.append(n)

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))

    def since(self, earlier: "SpecDecodeStats") -> "SpecDecodeStats":
        """The counts added after `earlier` (an older copy of the same running totals)."""
        per_pos = [n - (earlier.accepted_per_pos[j] if j < len(earlier.accepted_per_pos) else 0)
                   for j, n in enumerate(self.accepted_per_pos)]
        return SpecDecodeStats(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                               self.num_accepted_tokens - earlier.num_accepted_tokens, per_pos)

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify step of a request with drafts: the accepted drafts plus the one sampled after."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def log_text(self) -> str:
        if not self.num_drafts:
            return "no drafts"
        rate = self.num_accepted_tokens / self.num_draft_tokens
        per_pos = ", ".join(f"{n / self.num_drafts:.2f}" for n in self.accepted_per_pos)
        return (f"mean acceptance length {self.mean_acceptance_length:.2f}, draft acceptance rate {rate:.1%}, "
                f"accepted {self.num_accepted_tokens} of {self.num_draft_tokens} draft tokens"
                + (f", per position {per_pos}" if per_pos else ""))
