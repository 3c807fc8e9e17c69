"""The library refuses bad input with a ValueError that says what is wrong and where: SamplingParams refuses
what the server refuses (one check, shared), the engine applies the operator's limits to LLM.generate too,
and a step that fails because of one request aborts that request only. A malformed config.json, a corrupt
or incomplete checkpoint, a prompt that is not text or token ids, a looping chat template, GPTQ parts that
cannot be fused and an impossible parallel layout each fail early, naming the field, file or layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.engine.engine_core import STOP, EngineCore
from kvserve.sampling_params import RequestOutputKind


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=True), "n"),
    (dict(n=2.0), "n"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e30), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(repetition_penalty=1e30), "repetition_penalty"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(top_k=2**63), "top_k"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(logit_bias={5: 1000.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(stop=["\ud800"]), "stop"),
    (dict(bad_words=["ok\udfff"]), "bad_words"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
])
def test_sampling_params_refuse_wrong_types_and_ranges(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_limits_against_the_model():
    SamplingParams(n=128, logprobs=20, prompt_logprobs=20, top_k=1000).verify_for_model(1000)
    for params, field in [(SamplingParams(n=129), "n"), (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
                          (SamplingParams(logprobs=21), "logprobs"), (SamplingParams(top_k=1001), "top_k")]:
        with pytest.raises(ValueError, match=rf"^{field} "):
            params.verify_for_model(1000)
    # The operator may lift the caps: --max-logprobs -1 allows -1 (the whole vocabulary), --max-n more samples.
    SamplingParams(n=500, prompt_logprobs=-1, logprobs=-1).verify_for_model(1000, max_logprobs=-1, max_n=500)


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def test_llm_generate_applies_the_engine_limits(llama):
    llm = LLM(llama[0], max_model_len=256, kv_cache_memory_bytes=8 << 20, max_logprobs=5, max_n=4)
    for params, field in [(SamplingParams(n=10**12, max_tokens=1), "n"),
                          (SamplingParams(prompt_logprobs=-1, max_tokens=1), "prompt_logprobs"),
                          (SamplingParams(logprobs=6, max_tokens=1), "logprobs")]:
        with pytest.raises(ValueError, match=rf"^{field} "):
            llm.generate(["Hello", "World"], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate("Hello", SamplingParams(n=4, logprobs=5, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs) == 4


def _run_core(engine, requests, after_add=None):
    """Runs EngineCore until every request has finished or failed; returns ({id: tokens}, failed ids)."""
    pending = [("add", rid, prompt, params, None) for rid, prompt, params in requests]
    tokens: dict[str, list[int]] = {}
    done: set[str] = set()
    failed: set[str] = set()
    core = EngineCore(engine)

    def take_commands(block: bool):
        if pending:
            out = list(pending)
            pending.clear()
            return out
        return [STOP] if len(done | failed) == len(requests) else []

    def publish(batch):
        assert all(error is None for _, error in batch.accepted)
        if batch.accepted and after_add is not None:
            after_add()
        failed.update(batch.failed)
        for out in batch.outputs:
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                done.add(out.request_id)

    core.run(take_commands, publish)
    return tokens, failed


def test_a_failing_request_fails_alone(llama):
    llm = LLM(llama[0], max_model_len=256, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=True)
    engine = llm.llm_engine

    def params(seed):
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True,
                              output_kind=RequestOutputKind.DELTA)

    good = [(f"good-{i}", {"prompt_token_ids": [5 + i, 17, 99, 3, 250 + i]}, params(i)) for i in range(4)]
    expected, failed = _run_core(engine, good)
    assert not failed and all(len(t) == 12 for t in expected.values())

    # A value no admission check lets through, planted once the request runs: the next step raises.
    def poison():
        engine.scheduler.requests["bad"].sampling_params.top_k = 2**64

    bad = ("bad", {"prompt_token_ids": [9, 9, 9]}, params(7))
    tokens, failed = _run_core(engine, [*good[:2], bad, *good[2:]], after_add=poison)
    assert failed == {"bad"}
    assert {rid: t for rid, t in tokens.items() if rid != "bad"} == expected
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage() == 0


def test_async_engine_admits_a_prompt_list_as_one_batch_and_aborts_it_together(llama):
    """Finding 7: the server admitted a list of prompts one engine round trip at a time, without watching
    the client. add_requests hands them to the engine in one message, and cancelling it (the client left)
    aborts every one of them: nothing runs and no KV block is held afterwards."""
    import asyncio

    from kvserve.config import EngineArgs
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.metrics import EngineMetrics

    def gauge(metrics, name):
        for line in metrics.render().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def main():
        metrics = EngineMetrics("tiny")
        engine = AsyncEngine(EngineArgs(model=llama[0], max_model_len=256, kv_cache_memory_bytes=8 << 20),
                             metrics, use_process=False)
        engine.start()
        await engine.ready()
        sizes = []
        on_batch = engine._on_batch

        def record(batch):
            if batch.accepted:
                sizes.append(len(batch.accepted))
            on_batch(batch)

        engine._on_batch = record
        params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        streams = await engine.add_requests([(f"p{i}", {"prompt_token_ids": [5, i + 7]}, params) for i in range(40)])
        assert sizes == [40]  # one engine iteration accepted the whole list
        for s in streams:
            engine.abort(s.request_id)

        task = asyncio.ensure_future(engine.add_requests([(f"q{i}", {"prompt_token_ids": [9, i + 3]}, params)
                                                          for i in range(40)]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.num_active == 0
        names = ("kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc")
        for _ in range(400):  # the aborts reach the engine between steps, its stats come back after
            left = tuple(gauge(metrics, n) for n in names)
            if left == (0, 0, 0):
                break
            await asyncio.sleep(0.05)
        await engine.shutdown()
        return left

    assert asyncio.run(main()) == (0, 0, 0)


# ---- a checked model config: the field, the value and the file, before any torch work ----------------
DELETE = object()


def _variant(src: str, dst: Path, **changes) -> Path:
    """A copy of a checkpoint directory (files linked) whose config.json has `changes` (DELETE removes a key)."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((Path(src) / "config.json").read_text())
    for key, value in changes.items():
        if value is DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=DELETE), "has no 'hidden_size'; it must be an integer >= 1"),
    (dict(num_attention_heads="4"), "num_attention_heads is '4' (str); it must be an integer >= 1"),
    (dict(num_attention_heads=0), "num_attention_heads is 0 (int)"),
    (dict(num_hidden_layers=-2), "num_hidden_layers is -2"),
    (dict(intermediate_size=128.5), "intermediate_size is 128.5"),
    (dict(vocab_size=True), "vocab_size is True (bool)"),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps is '1e-6'"),
    (dict(rope_theta=-1.0), "rope_theta is -1.0"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings is 'false'"),
    (dict(eos_token_id=[2, -1]), "eos_token_id is [2, -1]"),
    (dict(architectures="LlamaForCausalLM"), "architectures is 'LlamaForCausalLM' (str); it must be a list"),
    (dict(num_attention_heads=5, num_key_value_heads=5, head_dim=DELETE),
     "hidden_size must be divisible by num_attention_heads"),
    (dict(num_key_value_heads=3), "num_attention_heads must be a multiple of num_key_value_heads"),
])
def test_a_malformed_config_names_the_field_the_value_and_the_file(llama, tmp_path, changes, message):
    path = _variant(llama[0], tmp_path / "model", **changes)
    with pytest.raises(ValueError) as info:
        LLM(str(path), max_model_len=256, kv_cache_memory_bytes=8 << 20)
    assert message in str(info.value)
    assert str(path / "config.json") in str(info.value)


_BASE_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 128, "vocab_size": 1000, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "max_position_embeddings": 512, "tie_word_embeddings": False, "eos_token_id": 2}
_JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats() | st.text(max_size=4),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                         max_size=3), max_leaves=5)


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(sorted(_BASE_CONFIG) + ["rope_scaling", "rope_parameters",
                                                                       "sliding_window", "bos_token_id",
                                                                       "attention_bias", "use_sliding_window",
                                                                       "layer_types", "num_experts",
                                                                       "num_experts_per_tok", "mlp_only_layers",
                                                                       "partial_rotary_factor"]),
                               _JSON_VALUES | st.just(DELETE), max_size=3)
       | st.fixed_dictionaries({"rope_parameters": st.fixed_dictionaries(
           {"rope_theta": _JSON_VALUES, "rope_type": _JSON_VALUES})}))
def test_any_config_values_give_a_model_config_or_a_value_error(changes):
    """Whatever JSON values config.json holds, parsing it ends in a ModelConfig or a ValueError naming the file:
    never a KeyError, TypeError or ZeroDivisionError."""
    from kvserve.model.model_config import ModelConfig

    cfg = {k: v for k, v in {**_BASE_CONFIG, **changes}.items() if v is not DELETE}
    try:
        ModelConfig.from_hf_dict(cfg)  # the file is named "config.json" when no path is given
    except ValueError as e:
        assert "config.json" in str(e) or "not supported" in str(e)


def test_a_config_that_is_not_json_names_the_file(llama, tmp_path):
    path = _variant(llama[0], tmp_path / "model")
    (path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ValueError, match="is not valid JSON"):
        LLM(str(path))
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object, not list"):
        LLM(str(path))


def test_head_dim_makes_heads_that_do_not_divide_hidden_valid(llama, tmp_path):
    from kvserve.model.model_config import ModelConfig

    cfg = ModelConfig.from_path(_variant(llama[0], tmp_path / "m", num_attention_heads=6, num_key_value_heads=3,
                                         head_dim=16))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (6, 3, 16)


# ---- loader errors name the file (and the tensor) ---------------------------------------------------
def test_a_corrupt_safetensors_file_is_a_value_error_naming_it(llama, tmp_path):
    path = _variant(llama[0], tmp_path / "model")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    weights.write_bytes(data[: len(data) // 2])  # a download cut off half-way
    with pytest.raises(ValueError, match="truncated or corrupt") as info:
        LLM(str(path), max_model_len=256, kv_cache_memory_bytes=8 << 20)
    assert str(weights) in str(info.value)


@pytest.mark.parametrize("dropped", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                     "model.norm.weight"])
def test_a_missing_tensor_is_named_with_the_checkpoint(llama, tmp_path, dropped):
    """A part of a fused projection (q/k/v, gate/up) missing would leave rows of the GEMM uninitialized."""
    from safetensors.torch import load_file, save_file

    path = _variant(llama[0], tmp_path / "model")
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors[dropped]
    weights.unlink()
    save_file(tensors, str(weights))
    with pytest.raises(ValueError) as info:
        LLM(str(path), max_model_len=256, kv_cache_memory_bytes=8 << 20)
    assert str(path) in str(info.value)
    assert dropped.removeprefix("model.") in str(info.value)


def test_an_unreadable_gguf_is_a_value_error_naming_it(tmp_path):
    from kvserve.model.default_model import find_default_gguf
    from kvserve.model.model_config import ModelConfig

    try:
        source = find_default_gguf()
    except FileNotFoundError as exc:
        pytest.skip(f"SmolLM2 GGUF not installed: {exc}")
    with open(source, "rb") as f:
        head = f.read(1 << 20)
    for name, data in [("cut.gguf", head), ("junk.gguf", b"not a gguf file at all" * 100)]:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ValueError, match="cannot be read as a GGUF file") as info:
            ModelConfig.from_path(path)
        assert str(path) in str(info.value)


# ---- prompts in the library -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(llama):
    return LLM(llama[0], max_model_len=256, kv_cache_memory_bytes=8 << 20)


@pytest.mark.parametrize("prompt, message", [
    ("caf\ud800", "no lone surrogates"),
    ({"prompt": "ok \udfff"}, "no lone surrogates"),
    ({"prompt": "x", "prompt_token_ids": [5, 6], }, None),
    ([True, 1], r"The prompt\[0\] is True \(bool\)"),
    ({"prompt_token_ids": [5, False]}, r"\[1\] is False \(bool\)"),
    ({"prompt_token_ids": [5, 6.0]}, r"\[1\] is 6.0 \(float\)"),
    ({"prompt_token_ids": "5 6"}, "must be a list of integer token ids"),
    ({"prompt": 17}, "must be a string, got int"),
])
def test_prompts_that_are_not_text_or_token_ids_are_refused(tiny_llm, prompt, message):
    params = SamplingParams(max_tokens=1)
    if message is None:  # the valid control: text with its token ids
        assert len(tiny_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids) == 1
        return
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate(prompt, params, use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


# ---- LLM.chat renders under the server's limits -------------------------------------------------------
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# 10M sandboxed assignments (~15 us each on a 2-core CI machine): far past a 2 s limit on any machine, yet
# finite, so a build without the limit fails this test (no ValueError) after minutes instead of hanging it.
# (An empty loop body would not do: jinja compiles it to a bare Python loop, 16M iterations in ~2 s.)
SLOW_TEMPLATE = ("{% set ns = namespace(n=0) %}{% for a in range(2000) %}{% for b in range(5000) %}"
                 "{% set ns.n = ns.n + b %}{% endfor %}{% endfor %}{{ ns.n }}")


def _chat_llm(llama, **limits):
    try:
        return LLM(llama[0], max_model_len=256, kv_cache_memory_bytes=8 << 20, **limits)
    except (TypeError, ValueError) as e:  # a build without the limit: the check below must fail, not error
        pytest.fail(f"LLM does not take the chat template limit: {e}")


def test_llm_chat_stops_a_looping_template_and_says_how_to_fix_it(llama):
    llm = _chat_llm(llama, chat_template_timeout=2.0)
    with pytest.raises(ValueError, match=r"longer than 2 s.*chat_template_timeout"):
        llm.chat(QUESTION, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=SLOW_TEMPLATE)
    assert not llm.llm_engine.has_unfinished_requests()
    # The worker was replaced: the next conversation renders as before.
    (out,) = llm.chat(QUESTION, SamplingParams(max_tokens=1), use_tqdm=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in out.prompt


def test_llm_chat_refuses_a_template_that_builds_a_huge_prompt(tiny_llm):
    with pytest.raises(ValueError, match="more than the limit"):
        tiny_llm.chat(QUESTION, SamplingParams(max_tokens=1), use_tqdm=False,
                      chat_template="{{ 'x' * 5000000 }}")


# ---- GPTQ act-order parts that cannot share one GEMM ----------------------------------------------------
@pytest.mark.parametrize("odd_one", ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.up_proj"])
def test_gptq_parts_with_different_act_order_are_refused(llama, tmp_path, odd_one):
    from safetensors.torch import load_file

    from tests.quant_utils import act_order_perm, quant_config_for, quantize_gptq, quantize_tensors, write_checkpoint

    src = Path(llama[0])
    weights = load_file(str(src / "model.safetensors"))
    opt = {"bits": 4, "group_size": 32, "sym": True, "desc_act": True}
    quant, _ = quantize_tensors(weights, "gptq", **opt)
    # The same weight quantized in another input-row order: its own g_idx, valid alone, not fusable.
    w = weights[f"{odd_one}.weight"]
    tensors, _ = quantize_gptq(w, 4, 32, True, act_order_perm(w.shape[1], seed=424242))
    assert not torch.equal(tensors["g_idx"], quant[f"{odd_one}.g_idx"])
    quant.update({f"{odd_one}.{k}": v for k, v in tensors.items()})
    config = {**json.loads((src / "config.json").read_text()), "quantization_config": quant_config_for("gptq", **opt)}
    path = write_checkpoint(tmp_path / "gptq", config, quant, tokenizer_from=src)
    fused = odd_one.removeprefix("model.").replace("k_proj", "qkv_proj").replace("up_proj", "gate_up_proj")
    with pytest.raises(ValueError, match="different g_idx") as info:
        LLM(str(path), max_model_len=256, kv_cache_memory_bytes=8 << 20)
    assert f"{fused}.g_idx" in str(info.value)


# ---- parallel layouts and devices ------------------------------------------------------------------------
def test_tensor_parallel_advice_names_sizes_that_pass_every_check(llama, tmp_path):
    """9 heads, 3 KV heads, 49152 tokens: 9 divides the heads but not the vocabulary; 1 and 3 fit."""
    import re

    from kvserve.config import EngineArgs

    path = _variant(llama[0], tmp_path / "nine", num_attention_heads=9, num_key_value_heads=3, hidden_size=72)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2") as info:
        EngineArgs(model=str(path), tensor_parallel_size=2, device="cpu").create_engine_config()
    advised = [int(n) for n in re.search(r"Sizes that fit every rule[^:]*: ([\d, ]+)", str(info.value))[1].split(",")]
    assert advised == [1, 3]
    for tp in advised + [9]:
        args = EngineArgs(model=str(path), tensor_parallel_size=tp, device="cpu")
        if tp == 9:
            with pytest.raises(ValueError, match="vocabulary"):
                args.create_engine_config()
        else:
            assert args.create_engine_config().args.tensor_parallel_size == tp


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_device_cuda_on_a_cpu_only_torch_says_so(llama):
    from kvserve.config import EngineArgs

    with pytest.raises(ValueError, match="built without CUDA"):
        EngineArgs(model=llama[0], device="cuda").create_engine_config()
