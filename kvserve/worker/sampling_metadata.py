"""Builds one step's SamplingMetadata from the scheduled requests' SamplingParams.

Per-row features (penalties, masks, biases) are gathered only for the rows that use them, so a plain
batch costs a few list comprehensions and the all-greedy batch almost nothing.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import torch

from kvserve.worker.sampler import Penalties, SamplingMetadata

_SAMPLING_EPS = 1e-5  # below this temperature a request is greedy (as SamplingParams.is_greedy)


def _on_device(data, dev, dtype=None) -> torch.Tensor:
    """A host list or array on the device without a host sync: a plain `torch.tensor(..., device=cuda)`
    copies from pageable memory and waits for the stream, i.e. for the step still running on the GPU,
    which would undo async scheduling. Pinned memory + a non-blocking copy queue behind it instead."""
    t = torch.as_tensor(data, dtype=dtype)
    if torch.device(dev).type != "cuda":
        return t
    return t.pin_memory().to(dev, non_blocking=True)


def _banned_tokens(params, output_ids: list[int], output_len: int) -> list[int]:
    """Tokens this row may not sample now: stop tokens before min_tokens, and bad-word completions."""
    banned: list[int] = []
    if output_len < params.min_tokens:
        banned.extend(params.all_stop_token_ids)
    for word in params.bad_words_token_ids:
        prefix_len = len(word) - 1
        if prefix_len > output_len:
            continue
        # The word's last token is banned once its other tokens end the output so far.
        if prefix_len == 0 or output_ids[output_len - prefix_len:output_len] == word[:-1]:
            banned.append(word[-1])
    return banned


def _row_token_pairs(token_lists: list[list[int]], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) for every token of every row, built with numpy: these lists can be long."""
    lens = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    rows = np.repeat(np.arange(len(token_lists)), lens)
    toks = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(lens.sum()))
    pairs = _on_device(np.stack([rows, toks]), dev)
    return pairs[0], pairs[1]


def _penalties(rows: list[int], params: list, scheduled: list, vocab: int, dev) -> Penalties:
    n = len(rows)
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
    out_rows, out_toks = _row_token_pairs([s.output_token_ids[:s.output_len] for s in scheduled], dev)
    counts.index_put_((out_rows, out_toks), torch.ones((), device=dev).expand(len(out_toks)), accumulate=True)
    prompt_mask = None
    if any(p.repetition_penalty != 1 for p in params):
        prompt_mask = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
        prompt_mask[_row_token_pairs([s.prompt_token_ids for s in scheduled], dev)] = True
    vals = _on_device([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params], dev,
                      torch.float32)
    return Penalties(
        rows=_on_device(rows, dev, torch.int64), presence=vals[:, 0], frequency=vals[:, 1],
        repetition=vals[:, 2], output_counts=counts, prompt_mask=prompt_mask,
    )


def _logit_edits(scheduled: list, params: list, vocab_size: int, dev) -> dict:
    edits = {}
    allowed_rows = [j for j, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed_rows:
        mask = torch.ones(len(allowed_rows), vocab_size, dtype=torch.bool, device=dev)
        r = [i for i, j in enumerate(allowed_rows) for _ in params[j].allowed_token_ids]
        t = [tok for j in allowed_rows for tok in params[j].allowed_token_ids]
        mask[_on_device(r, dev, torch.int64), _on_device(t, dev, torch.int64)] = False
        edits["disallowed"] = (_on_device(allowed_rows, dev, torch.int64), mask)
    ban_rows, ban_toks = [], []
    for j, (p, s) in enumerate(zip(params, scheduled)):
        if (p.min_tokens and s.output_len < p.min_tokens) or p.bad_words:
            toks = _banned_tokens(p, s.output_token_ids, s.output_len)
            ban_rows.extend([j] * len(toks))
            ban_toks.extend(toks)
    if ban_toks:
        idx = _on_device([ban_rows, ban_toks], dev, torch.int64)
        edits["banned"] = (idx[0], idx[1])
    bias_rows = [j for j, p in enumerate(params) if p.logit_bias]
    if bias_rows:
        items = [(j, tok, b) for j in bias_rows for tok, b in params[j].logit_bias.items()]
        edits["logit_bias"] = (
            _on_device([i[0] for i in items], dev, torch.int64),
            _on_device([i[1] for i in items], dev, torch.int64),
            _on_device([i[2] for i in items], dev, torch.float32),
        )
    pen_rows = [j for j, p in enumerate(params) if p.uses_penalties]
    if pen_rows:
        edits["penalties"] = _penalties(
            pen_rows, [params[j] for j in pen_rows], [scheduled[j] for j in pen_rows], vocab_size, dev)
    return edits


def build_sampling_metadata(
    scheduled: list, generators: dict[str, torch.Generator], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """`scheduled`: the ScheduledRequests that sample this step, in batch-row order."""
    params = [s.sampling_params for s in scheduled]
    dev = device
    # One cheap pass over plain attributes decides which of the costlier builders run at all.
    all_greedy, asked, any_edits = True, [], False
    for p in params:
        if p.temperature >= _SAMPLING_EPS:
            all_greedy = False
        if p.logprobs is not None:
            asked.append(p.logprobs)
        if (p.min_tokens or p.bad_words or p.logit_bias or p.allowed_token_ids is not None
                or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1):
            any_edits = True
    max_num_logprobs = None
    if asked:
        max_num_logprobs = vocab_size if -1 in asked else max(asked)
    meta = SamplingMetadata(
        temperature=None, top_k=None, top_p=None, min_p=None, generators={}, all_greedy=all_greedy,
        max_num_logprobs=max_num_logprobs,
        **(_logit_edits(scheduled, params, vocab_size, dev) if any_edits else {}),
    )
    if all_greedy:
        return meta
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    meta.temperature = _on_device([p.temperature for p in params], dev, torch.float32)
    meta.top_k = _on_device(top_k, dev, torch.int64) if any(top_k) else None
    meta.top_p = _on_device(top_p, dev, torch.float32) if any(p < 1 for p in top_p) else None
    meta.min_p = _on_device(min_p, dev, torch.float32) if any(min_p) else None
    meta.generators = {j: generators[s.request_id] for j, s in enumerate(scheduled) if s.request_id in generators}
    return meta


def sampling_inputs_valid(request, vocab_size: int) -> bool:
    """Whether one request's own sampling inputs (its seed's generator, its parameters as tensors) can be
    built: after a failed step the engine asks this of each request (a core Request), to find the one to blame."""
    try:
        seed = getattr(request.sampling_params, "seed", None)
        if seed is not None:
            torch.Generator().manual_seed(seed)
        row = SimpleNamespace(request_id=request.request_id, sampling_params=request.sampling_params,
                              prompt_token_ids=request.prompt_token_ids, output_token_ids=request.output_token_ids,
                              output_len=len(request.output_token_ids))
        build_sampling_metadata([row], {}, vocab_size, torch.device("cpu"))
    except Exception:  # noqa: BLE001 - any failure here is this request's
        return False
    return True
