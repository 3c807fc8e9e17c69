"""GGUF checkpoints of the dense families beyond Llama/Qwen, written here the way llama.cpp's converter
lays them out (F32, llama.cpp's tensor names) from a tiny random HF model: kvserve loads them with HF's
greedy tokens, and `kvserve plan` reads them."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.cli import main as cli_main
from kvserve.model.gguf_loader import iter_gguf_weights, read_gguf_config
from kvserve.model.model_config import ModelConfig
from tests.conftest import WINDOW, _tiny_config, hf_greedy, random_prompts

gguf = pytest.importorskip("gguf")

MAX_TOKENS = 8


def _as_float32(value):
    """GGUF stores float metadata as float32: compare config floats at that precision."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {k: _as_float32(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_float32(v) for v in value]
    return value


# Each family as llama.cpp's convert_hf_to_gguf.py writes it: fixture arch -> (GGUF arch, HF config changes).
# Gemma's query_pre_attn_scalar is head_dim here because llama.cpp derives it (GGUF has no key for it), and
# Gemma 3 has six layers because llama.cpp makes every sixth layer full.
FAMILIES = {
    "olmo2": ("olmo2", {}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 16, "num_hidden_layers": 6,
                          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    "phi3": ("phi3", {}),
    "phi3-longrope": ("phi3", {}),
    "granite": ("granite", {}),
    "cohere": ("command-r", {}),
    "cohere2": ("cohere2", {}),
    # llama.cpp's gpt-oss graph clamps the SwiGLU at 7 (GGUF has no key for it).
    "gpt-oss": ("gpt-oss", {"swiglu_limit": 7.0}),
    # llama.cpp cancels YaRN's cos/sin factor, as HF does where mscale == mscale_all_dim (DeepSeek-V3's own).
    "deepseek_v3": ("deepseek2", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8, "rope_theta": 10000.0}}),
}


def _family_model(arch: str, tiny_model_factory):
    gguf_arch, changes = FAMILIES[arch]
    if not changes:
        return tiny_model_factory(arch)[1]
    import transformers

    from tests.model import test_models_deepseek, test_models_gpt_oss

    if arch == "deepseek_v3":
        cfg = test_models_deepseek._hf_config(**changes)
    else:
        cfg = test_models_gpt_oss._hf_config() if arch == "gpt-oss" else _tiny_config(arch)
        for key, value in changes.items():
            setattr(cfg, key, value)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if arch == "deepseek_v3":
        with torch.no_grad():  # HF starts the correction bias at zero: make it steer the choice
            for layer in model.model.layers[cfg.first_k_dense_replace:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    if arch == "gpt-oss":
        with torch.no_grad():  # HF initialises the expert biases to zero and the sinks small: make them count
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.2)
                layer.mlp.experts.down_proj_bias.normal_(0, 0.2)
                layer.self_attn.sinks.normal_(0, 1.5)
    return model


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    # convert_hf_to_gguf's LlamaModel.permute: rotate-half rope rows become llama.cpp's interleaved pairs.
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_metadata(writer, cfg, gguf_arch: str) -> None:
    def u32(key, value):
        writer.add_uint32(f"{gguf_arch}.{key}", int(value))

    def f32(key, value):
        writer.add_float32(f"{gguf_arch}.{key}", float(value))

    for key, value in (("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("block_count", cfg.num_hidden_layers), ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads),
                       ("context_length", cfg.max_position_embeddings), ("vocab_size", cfg.vocab_size)):
        u32(key, value)
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope)
    f32("rope.freq_base", rope["rope_theta"])
    if gguf_arch in ("command-r", "cohere2"):  # LayerNorm families
        f32("attention.layer_norm_epsilon", cfg.layer_norm_eps)
        f32("logit_scale", cfg.logit_scale)
        u32("rope.dimension_count", cfg.hidden_size // cfg.num_attention_heads)
    else:
        f32("attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if gguf_arch in ("gemma2", "gemma3"):
        u32("attention.key_length", cfg.head_dim)
        u32("attention.value_length", cfg.head_dim)
        u32("attention.sliding_window", cfg.sliding_window)
        if cfg.final_logit_softcapping:
            f32("final_logit_softcapping", cfg.final_logit_softcapping)
    if gguf_arch == "gemma2":
        f32("attn_logit_softcapping", cfg.attn_logit_softcapping)
    if gguf_arch == "gemma3" and rope.get("rope_type") == "linear":
        writer.add_string(f"{gguf_arch}.rope.scaling.type", "linear")
        f32("rope.scaling.factor", rope["factor"])
    if gguf_arch == "phi3":
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        u32("rope.dimension_count", int(head_dim * cfg.partial_rotary_factor))
        u32("attention.sliding_window", cfg.sliding_window or 0)
        original = cfg.rope_parameters.get("original_max_position_embeddings")
        if original:
            u32("rope.scaling.original_context_length", original)
    if gguf_arch == "granite":
        f32("attention.scale", cfg.attention_multiplier)
        f32("embedding_scale", cfg.embedding_multiplier)
        f32("residual_scale", cfg.residual_multiplier)
        f32("logit_scale", cfg.logits_scaling)
    if gguf_arch == "cohere2":
        u32("attention.sliding_window", cfg.sliding_window)
    if gguf_arch == "gpt-oss":
        u32("attention.key_length", cfg.head_dim)
        u32("attention.value_length", cfg.head_dim)
        u32("attention.sliding_window", cfg.sliding_window)
        u32("expert_count", cfg.num_local_experts)
        u32("expert_used_count", cfg.num_experts_per_tok)
        u32("expert_feed_forward_length", cfg.intermediate_size)
        writer.add_string(f"{gguf_arch}.rope.scaling.type", "yarn")
        f32("rope.scaling.factor", rope["factor"])
        u32("rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    if gguf_arch == "deepseek2":  # convert_hf_to_gguf's DeepseekV2Model, MLA sizes as its newer versions write them
        u32("attention.head_count_kv", 1)
        u32("attention.q_lora_rank", cfg.q_lora_rank)
        u32("attention.kv_lora_rank", cfg.kv_lora_rank)
        u32("attention.key_length", cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        u32("attention.value_length", cfg.kv_lora_rank)
        u32("attention.key_length_mla", cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        u32("attention.value_length_mla", cfg.v_head_dim)
        u32("rope.dimension_count", cfg.qk_rope_head_dim)
        u32("leading_dense_block_count", cfg.first_k_dense_replace)
        u32("expert_feed_forward_length", cfg.moe_intermediate_size)
        u32("expert_count", cfg.n_routed_experts)
        u32("expert_used_count", cfg.num_experts_per_tok)
        u32("expert_shared_count", cfg.n_shared_experts)
        f32("expert_weights_scale", cfg.routed_scaling_factor)
        writer.add_bool(f"{gguf_arch}.expert_weights_norm", cfg.norm_topk_prob)
        softmax = getattr(cfg, "scoring_func", "sigmoid") == "softmax"  # DeepSeek-V2's routing
        u32("expert_gating_func", gguf.ExpertGatingFuncType.SOFTMAX if softmax else gguf.ExpertGatingFuncType.SIGMOID)
        u32("expert_group_count", cfg.n_group)
        u32("expert_group_used_count", cfg.topk_group)
        writer.add_string(f"{gguf_arch}.rope.scaling.type", "yarn")
        f32("rope.scaling.factor", rope["factor"])
        u32("rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        f32("rope.scaling.yarn_log_multiplier", 0.1 * rope["mscale_all_dim"])


def _gpt_oss_split(hf_param: str, w: np.ndarray):
    """convert_hf_to_gguf's GptOssModel: the sinks as a weight; the stacked [E, in, out] experts transposed to
    [E, out, in], gate_up's interleaved features split into gate (even) and up (odd)."""
    if hf_param == "sinks":
        yield "attn_sinks.weight", w
    elif hf_param == "down_proj":
        yield "ffn_down_exps.weight", w.swapaxes(1, 2)
    elif hf_param == "down_proj_bias":
        yield "ffn_down_exps.bias", w
    else:
        bias = hf_param == "gate_up_proj_bias"
        rows = w if bias else w.swapaxes(1, 2)
        yield f"ffn_gate_exps.{'bias' if bias else 'weight'}", rows[:, 0::2]
        yield f"ffn_up_exps.{'bias' if bias else 'weight'}", rows[:, 1::2]


def _deepseek_split(cfg, layer: str, module: str, suffix: str, w: np.ndarray, expert_stacks: dict):
    """convert_hf_to_gguf's DeepseekV2Model: kv_b_proj split per head into attn_k_b (transposed) and attn_v_b,
    the correction bias as exp_probs_b, the routed experts stacked [E, out, in] once a layer's are all seen."""
    if module == "mlp.gate" and suffix == "e_score_correction_bias":
        yield "exp_probs_b.bias", w
    elif module == "mlp.gate":
        yield "ffn_gate_inp.weight", w
    elif module == "self_attn.kv_b_proj":
        kv_b = w.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, w.shape[-1])
        yield "attn_k_b.weight", kv_b[:, :cfg.qk_nope_head_dim].swapaxes(1, 2)
        yield "attn_v_b.weight", kv_b[:, cfg.qk_nope_head_dim:]
    else:  # mlp.experts.E.{gate,up,down}_proj
        _, _, expert, proj = module.split(".")
        stack = expert_stacks.setdefault((layer, proj), {})
        stack[int(expert)] = w
        if len(stack) == cfg.n_routed_experts:
            del expert_stacks[(layer, proj)]
            yield f"ffn_{proj.split('_')[0]}_exps.weight", np.stack([stack[e] for e in range(len(stack))])


def _write_gguf(hf_model, gguf_arch: str, path, expert_type=None) -> dict:
    """Returns the HF checkpoint's tensors (as save_pretrained writes them) that the file was made from."""
    from safetensors.torch import load_file

    from kvserve.model import gguf_loader

    cfg = hf_model.config
    spec = gguf_loader._ARCHS[gguf_arch]
    to_gguf = {hf: g for g, hf in gguf_loader.layer_tensor_names(spec).items()}
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    _write_metadata(writer, cfg, gguf_arch)
    writer.add_bos_token_id(cfg.bos_token_id)  # the converter's SpecialVocab writes these from the tokenizer
    writer.add_eos_token_id(cfg.eos_token_id)
    if cfg.rope_parameters.get("rope_type") == "longrope":  # Phi-3: the factors are tensors in GGUF
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.asarray(cfg.rope_parameters[f"{kind}_factor"], dtype=np.float32))
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        state = load_file(f"{tmp}/model.safetensors")
    expert_stacks: dict = {}
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if gguf_arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp multiplies by the stored norm weight; HF by (1 + weight)
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            writer.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
                               "output_norm.weight", "lm_head.weight": "output.weight"}[name], np.ascontiguousarray(w))
            continue
        _, _, layer, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        if gguf_arch == "gpt-oss" and module in ("self_attn", "mlp.experts"):
            for gguf_name, value in _gpt_oss_split(suffix, w):
                if expert_type is not None and gguf_name.endswith("_exps.weight"):  # as llama.cpp ships gpt-oss
                    writer.add_tensor(f"blk.{layer}.{gguf_name}", gguf.quants.quantize(value, expert_type),
                                      raw_dtype=expert_type)
                else:
                    writer.add_tensor(f"blk.{layer}.{gguf_name}", np.ascontiguousarray(value))
            continue
        if gguf_arch == "deepseek2" and (module == "mlp.gate" or ".experts." in name or "kv_b_proj" in name):
            for gguf_name, value in _deepseek_split(cfg, layer, module, suffix, w, expert_stacks):
                writer.add_tensor(f"blk.{layer}.{gguf_name}", np.ascontiguousarray(value))
            continue
        if gguf_arch == "granite" and module == "self_attn.q_proj":
            w = _llama_permute(w, cfg.num_attention_heads)
        elif gguf_arch == "granite" and module == "self_attn.k_proj":
            w = _llama_permute(w, cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{to_gguf[module]}.{suffix}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_gguf_family_matches_hf_and_plans(tiny_model_factory, tmp_path, capsys, arch):
    gguf_arch = FAMILIES[arch][0]
    hf_model = _family_model(arch, tiny_model_factory)
    path = tmp_path / f"{arch}.gguf"
    expected = _write_gguf(hf_model, gguf_arch, path)
    # What llama.cpp keeps out of the tensors' shapes (caps, multipliers, rope, windows) becomes the same
    # kvserve config as the HF checkpoint's; greedy tokens alone miss some (a logit scale keeps the argmax).
    assert _as_float32(asdict(ModelConfig.from_hf_dict(read_gguf_config(path)))) == \
        _as_float32(asdict(ModelConfig.from_hf_dict(hf_model.config.to_dict())))
    loaded = dict(iter_gguf_weights(path))
    assert set(expected) - set(loaded) <= {"lm_head.weight"} and set(loaded) <= set(expected)
    for name, tensor in loaded.items():  # Gemma's norms come back from 1 + w: equal up to fp32 rounding
        torch.testing.assert_close(tensor, expected[name].float(), rtol=0, atol=1e-6, msg=name)
    prompts = random_prompts(3, WINDOW, 3 * WINDOW, seed=17)
    llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=16 << 20, skip_tokenizer_init=True,
              max_num_batched_tokens=32, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_model, prompts, MAX_TOKENS)
    assert llm.llm_engine.config.model_config.architecture == hf_model.config.architectures[0]
    assert cli_main(["plan", str(path), "--gpu", "H100", "--max-model-len", "256", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # The plan counts the linear layers and embeddings exactly, norms roughly (per-family norms are small).
    assert plan["num_params"] == pytest.approx(sum(p.numel() for p in hf_model.parameters()), rel=1e-3)
    assert plan["num_blocks"] > 0


def test_gpt_oss_gguf_with_mxfp4_experts_matches_hf_on_its_dequantized_weights(tmp_path):
    """llama.cpp's gpt-oss GGUFs hold the experts in MXFP4: kvserve dequantizes them; the oracle is HF with
    the experts replaced by gguf-py's dequantization of the same blocks."""
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    hf_model = _family_model("gpt-oss", None)
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    _write_gguf(hf_model, "gpt-oss", path, expert_type=mxfp4)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            experts = layer.mlp.experts
            for param in (experts.gate_up_proj, experts.down_proj):  # [E, in, out]: MXFP4 blocks run along `in`
                rows = param.numpy().swapaxes(1, 2)
                dequantized = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(rows), mxfp4), mxfp4)
                assert not np.array_equal(dequantized, rows)  # the quantization is lossy: the check means something
                param.copy_(torch.from_numpy(dequantized.swapaxes(1, 2).copy()))
    prompts = random_prompts(3, WINDOW, 3 * WINDOW, seed=17)
    llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=16 << 20, skip_tokenizer_init=True,
              max_num_batched_tokens=32, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_model, prompts, MAX_TOKENS)


def _metadata_only_gguf(path, gguf_arch: str, hf_config, extra) -> None:
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    _write_metadata(writer, hf_config, gguf_arch)
    extra(writer)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _no_extra(writer) -> None:
    pass


@pytest.mark.parametrize("arch,changes,extra,match", [
    ("gemma3", {}, lambda w: w.add_string("gemma3.rope.scaling.type", "yarn"), r"gemma3\.rope\.scaling\.type 'yarn'"),
    # the factors without the original length the converter writes beside them; then one factor alone
    ("phi3-longrope", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     lambda w: [w.add_tensor(f"rope_factors_{k}.weight", np.ones(4, dtype=np.float32)) for k in ("long", "short")],
     r"rope\.scaling\.original_context_length"),
    ("phi3-longrope", {}, lambda w: w.add_tensor("rope_factors_long.weight", np.ones(4, dtype=np.float32)),
     r"rope_factors_short\.weight"),
    ("deepseek_v3", {"scoring_func": "softmax"}, _no_extra, r"deepseek2\.expert_gating_func 1 \(softmax\)"),
])
def test_family_setting_kvserve_cannot_read_is_named(tmp_path, arch, changes, extra, match):
    gguf_arch = FAMILIES[arch][0]
    cfg = _family_model(arch, None).config if arch == "deepseek_v3" else _tiny_config(arch)
    for key, value in changes.items():
        setattr(cfg, key, value)
    path = tmp_path / f"{arch}.gguf"
    _metadata_only_gguf(path, gguf_arch, cfg, extra)
    with pytest.raises(ValueError, match=match):
        read_gguf_config(path)
