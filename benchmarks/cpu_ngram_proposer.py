"""Host time of prompt-lookup proposals per engine step, against a non-incremental numpy search.

    python benchmarks/cpu_ngram_proposer.py

Each request's prompt holds a passage twice (the second copy edited), and each step appends 1-4 tokens
(an accepted run) taken from the passage, so lookups hit as in a rewrite workload. The baseline searches the
whole context with numpy sliding windows every step, as a proposer without an index must.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np

from kvserve.spec_decode.ngram_proposer import NgramProposer

K, MIN_N, MAX_N, STEPS = 5, 2, 5, 64


def _window_search(tokens: np.ndarray, k: int) -> list[int]:
    length = len(tokens)
    for n in range(min(MAX_N, length - 1), MIN_N - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)  # ends n .. length - 1
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            end = int(hits[-1]) + n
            return tokens[end:end + k].tolist()
    return []


def _requests(batch: int, prompt_len: int, rng: random.Random):
    reqs = []
    for i in range(batch):
        passage = [rng.randint(100, 30000) for _ in range(prompt_len // 2)]
        edited = [t if rng.random() > 0.05 else rng.randint(100, 30000) for t in passage]
        reqs.append(SimpleNamespace(request_id=str(i), prompt_token_ids=passage + edited, output_token_ids=[],
                                    source=passage))
    return reqs


def _run(batch: int, prompt_len: int) -> tuple[float, float, float, float]:
    rng = random.Random(0)
    reqs = _requests(batch, prompt_len, rng)
    proposer = NgramProposer(K, MIN_N, MAX_N)
    t0 = time.process_time()
    proposer.propose(reqs)
    first = time.process_time() - t0
    ours = base = 0.0
    hits = 0
    for step in range(STEPS):
        for r in reqs:
            pos = len(r.output_token_ids)
            r.output_token_ids.extend(r.source[pos:pos + rng.randint(1, 4)])
        t0 = time.process_time()
        drafts = proposer.propose(reqs)
        ours += time.process_time() - t0
        hits += len(drafts)
        t0 = time.process_time()
        for r in reqs:
            _window_search(np.asarray(r.prompt_token_ids + r.output_token_ids), K)
        base += time.process_time() - t0
    return first, ours / STEPS, base / STEPS, hits / (STEPS * batch)


def main():
    rows = []
    for batch in (1, 16, 64, 256):
        for prompt_len in (1024, 4096):
            first, ours, base, hit = _run(batch, prompt_len)
            rows.append((batch, prompt_len, first * 1e3, ours * 1e3, base * 1e3, base / ours, hit))
    print("| batch | prompt | first step (index prompts), ms | per step, ms | numpy search per step, ms "
          "| speedup | steps with a draft |")
    print("|---|---|---|---|---|---|---|")
    for b, p, first, ours, base, ratio, hit in rows:
        print(f"| {b} | {p} | {first:.2f} | {ours:.3f} | {base:.2f} | {ratio:.0f}x | {hit:.0%} |")


if __name__ == "__main__":
    main()
