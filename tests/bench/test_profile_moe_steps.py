"""benchmarks/profile_moe_steps.py: each engine's kernel names land in the same kinds, the decode profile runs a
batch to the end (on CPU: no CUDA kernels, the flow only), and the table subtracts vLLM's milliseconds from ours."""

from __future__ import annotations

import json

import pytest

from benchmarks import profile_moe_steps
from benchmarks.gpu_w1 import greedy
from benchmarks.write_random_checkpoint import write
from kvserve import LLM
from tests.bench.test_write_random_checkpoint import TINY_QWEN3_MOE
from tests.conftest import random_prompts


@pytest.mark.parametrize("name,kind", [
    ("fused_moe_kernel", "moe gemm"), ("moe_grouped_gemm", "moe gemm"),
    ("void vllm::moe::moe_align_block_size_kernel<int>", "moe sort"), ("_align_one_program", "moe sort"),
    ("_place_pairs", "moe sort"), ("void vllm::moe::topkGatingSoftmax<8, 128>", "router"),
    ("void vllm::moe::moe_sum_kernel<8>", "moe sum"), ("_sum_pairs_kernel", "moe sum"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::Col", "attention"),
    ("void vllm::dynamic_per_token_scaled_fp8_quant_kernel<c10::BFloat16>", "activation quant"),
    ("_quantize_rows_kernel", "activation quant"), ("silu_and_mul_fp8_kernel", "activation"),
    ("triton_red_fused_add_mean_mul_pow_rsqrt_0", "norm"), ("FlashAttnFwdSm90", "attention"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32", "gemm"), ("void at::native::reduce_kernel<512, 1>", "other"),
])
def test_both_engines_kernels_fall_in_one_set_of_kinds(name, kind):
    assert profile_moe_steps.kind_of(name) == kind


def test_decode_profile_runs_the_batch_to_the_end(tmp_path):
    path = str(tmp_path / "ckpt")
    write(TINY_QWEN3_MOE, path, False, "cpu")
    llm = LLM(path, load_format="auto", skip_tokenizer_init=True, dtype="float32", max_model_len=256)
    prompts = random_prompts(3, 20, 40)
    result = profile_moe_steps.profile_decode(llm.llm_engine, prompts, greedy(profile_moe_steps.OUTPUT_TOKENS))
    assert not llm.llm_engine.has_unfinished_requests()
    assert result["requests"] == 3 and result["profiled_steps"] == profile_moe_steps.PROFILED_STEPS
    assert result["wall_ms_per_step"] > 0
    llm.llm_engine.shutdown()


def test_table_prints_each_kind_and_the_difference(tmp_path, capsys):
    for engine, kinds in (("kvserve", {"moe gemm": 10.0, "attention": 4.0}), ("vllm", {"moe gemm": 9.5})):
        run = {"gpu_ms_by_kind": kinds, "gpu_ms_per_step": sum(kinds.values()), "wall_ms_per_step": 18.0,
               "top_kernels": [{"name": "k", "ms_per_step": 1.0, "launches_per_step": 48.0}]}
        (tmp_path / f"moe_steps_{engine}.json").write_text(json.dumps(run))
    profile_moe_steps.print_table(str(tmp_path))
    out = capsys.readouterr().out
    assert "| moe gemm | 10.000 | 9.500 | +0.500 |" in out
    assert "| attention | 4.000 | 0.000 | +4.000 |" in out
    assert "| all kernels (GPU busy) | 14.000 | 9.500 | +4.500 |" in out
