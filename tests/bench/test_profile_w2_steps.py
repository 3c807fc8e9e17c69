"""benchmarks/profile_w2_steps.py: the two windows are profiled in one run (on CPU: no CUDA kernels, the flow
only: the prefill window comes before any request has its first token, the decode window after every one has),
and the table prints each window's kinds side by side."""

from __future__ import annotations

import json

from benchmarks import profile_w2_steps
from benchmarks.gpu_w1 import greedy
from kvserve import LLM
from tests.conftest import random_prompts


def test_both_windows_profile_one_run(tiny_model_factory):
    # Prompts of 60-80 tokens in chunks of 8: the prefill window's steps are prefill chunks.
    path, _ = tiny_model_factory("gemma3")
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              max_num_batched_tokens=8, max_num_seqs=4)
    engine = llm.llm_engine
    outputs = 40
    requests = [(ids, outputs) for ids in random_prompts(3, 60, 80)]
    seen_first_tokens = []
    real_step = engine.step

    def counting_step():
        outs = real_step()
        seen_first_tokens.append(sum(1 for o in outs if o.outputs and o.outputs[0].token_ids))
        return outs

    engine.step = counting_step
    result = profile_w2_steps.profile_w2(engine, requests, greedy)
    engine.step = real_step
    assert result["requests"] == 3
    prefill_end = profile_w2_steps.PREFILL_SKIP + profile_w2_steps.PREFILL_STEPS
    assert not any(seen_first_tokens[:prefill_end])  # the prefill window: no request had a token yet
    for window, steps in (("prefill", profile_w2_steps.PREFILL_STEPS), ("decode", profile_w2_steps.DECODE_STEPS)):
        assert result[window]["profiled_steps"] == steps and result[window]["wall_ms_per_step"] > 0
    assert engine.has_unfinished_requests()  # the run stops after the decode window
    engine.shutdown()


def test_tables_print_each_window(tmp_path, capsys):
    for engine, ms in (("kvserve", 12.0), ("vllm", 11.0)):
        window = {"gpu_ms_by_kind": {"attention": ms}, "gpu_ms_per_step": ms, "wall_ms_per_step": ms + 1,
                  "top_kernels": [{"name": "k", "ms_per_step": ms, "launches_per_step": 48.0}]}
        (tmp_path / f"w2_steps_{engine}.json").write_text(json.dumps({"prefill": window, "decode": window}))
    profile_w2_steps.print_tables(str(tmp_path))
    out = capsys.readouterr().out
    assert "| GPU ms per W2 prefill step | kvserve | vllm | kvserve - vLLM |" in out
    assert "| GPU ms per W2 decode step | kvserve | vllm | kvserve - vLLM |" in out
    assert out.count("| attention | 12.000 | 11.000 | +1.000 |") == 2
