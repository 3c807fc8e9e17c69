"""The EAGLE-3 head against a plain-torch reference of the same head written here from the checkpoint
layout, over kvserve's paged KV cache: one prefill over the target's positions, then chained drafts."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.eagle3 import Eagle3Config, Eagle3Head
from kvserve.model.model_config import ModelConfig
from kvserve.ops.attention_backend import get_attention_backend
from kvserve.ops.attention_metadata import AttentionMetadata
from tests import eagle3_reference

H, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 96
VOCAB, DRAFT_VOCAB, TARGET_H, TARGET_LAYERS = 50, 20, 48, 8
EPS, THETA, BLOCK = 1e-5, 10000.0, 4


def _head_config(**extra) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "intermediate_size": INTER, "num_hidden_layers": 1, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
            "target_hidden_size": TARGET_H, "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 64,
            **extra}


def _target_config() -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": TARGET_H,
                                     "num_hidden_layers": TARGET_LAYERS, "num_attention_heads": 4,
                                     "intermediate_size": 64, "vocab_size": VOCAB})


def _checkpoint(seed=0, with_embedding=True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    sd = {
        "fc.weight": r(H, 3 * TARGET_H),
        "midlayer.input_layernorm.weight": 1 + r(H), "midlayer.hidden_norm.weight": 1 + r(H),
        "midlayer.post_attention_layernorm.weight": 1 + r(H),
        "midlayer.self_attn.q_proj.weight": r(q, 2 * H), "midlayer.self_attn.k_proj.weight": r(kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(kv, 2 * H), "midlayer.self_attn.o_proj.weight": r(H, q),
        "midlayer.mlp.gate_proj.weight": r(INTER, H), "midlayer.mlp.up_proj.weight": r(INTER, H),
        "midlayer.mlp.down_proj.weight": r(H, INTER),
        "norm.weight": 1 + r(H), "lm_head.weight": r(DRAFT_VOCAB, H) * 5,
        # A reduced vocabulary: draft id i is target id sorted(random subset)[i], stored as an offset.
        "d2t": torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool),
    }
    if with_embedding:
        sd["embed_tokens.weight"] = r(VOCAB, H)
    return sd


# ---- the reference (tests/eagle3_reference.py) at this file's shapes -----------------------------------
def reference_head(sd, token_ids, hidden):
    return eagle3_reference.reference_head(sd, token_ids, hidden, HEADS, KV_HEADS, EPS, THETA)


def reference_chain(sd, tokens, aux, k):
    return eagle3_reference.reference_chain(sd, tokens, aux, k, HEADS, KV_HEADS, EPS, THETA)


# ---- ours, over a paged cache ------------------------------------------------------------------------
def _meta(start: int, num: int, table: torch.Tensor) -> AttentionMetadata:
    pos = torch.arange(start, start + num)
    slots = table[pos // BLOCK].long() * BLOCK + pos % BLOCK
    qsl = torch.tensor([0, num], dtype=torch.int32)
    seq = torch.tensor([start + num], dtype=torch.int32)
    return AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq, block_tables=table[None],
                             max_query_len=num, max_seq_len=start + num, num_actual_tokens=num, block_size=BLOCK,
                             query_start_loc_cpu=qsl, seq_lens_cpu=seq)


def _head(sd) -> Eagle3Head:
    cfg = Eagle3Config.from_hf_dict(_head_config(), _target_config())
    head = Eagle3Head(cfg, get_attention_backend("torch"), max_positions=64)
    head.load_weights(sd.items())
    return head


def test_one_forward_equals_the_reference():
    sd = _checkpoint()
    head = _head(sd)
    t = 11
    tokens = torch.randint(0, VOCAB, (t,), generator=torch.Generator().manual_seed(1))
    aux = [torch.randn(t, TARGET_H, generator=torch.Generator().manual_seed(2 + i)) for i in range(3)]
    table = torch.tensor([5, 2, 7, 1], dtype=torch.int32)  # shuffled blocks
    kv_cache = torch.randn(2, 8, BLOCK, KV_HEADS, HEAD_DIM)  # garbage: anything read before written shows
    normed, prenorm = head(tokens, torch.arange(t), head.combine(aux), kv_cache, _meta(0, t, table))
    ref_normed, ref_prenorm, ref_ids = reference_head(sd, tokens, torch.cat(aux, -1) @ sd["fc.weight"].T)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prenorm, ref_prenorm, rtol=1e-4, atol=1e-4)
    assert torch.equal(head.to_target_ids(head.compute_draft_logits(normed).argmax(-1)), ref_ids)
    probs = head.target_probs(head.compute_draft_logits(normed), VOCAB)
    assert torch.equal(probs.argmax(-1), ref_ids)
    torch.testing.assert_close(probs.sum(-1), torch.ones(t))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[sd["d2t"] + torch.arange(DRAFT_VOCAB)] = False
    assert probs[:, outside].abs().sum() == 0  # no mass outside the draft vocabulary


@pytest.mark.parametrize("with_embedding", [True, False], ids=["own-embedding", "target-embedding"])
def test_chained_drafts_over_the_paged_cache_equal_the_reference(with_embedding):
    sd = _checkpoint(seed=3, with_embedding=with_embedding)
    target_embedding = torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(9))
    if not with_embedding:
        sd_ref = {**sd, "embed_tokens.weight": target_embedding}
    else:
        sd_ref = sd
    head = _head(sd)
    if not with_embedding:
        from kvserve.model.layers import VocabParallelEmbedding

        emb = VocabParallelEmbedding(VOCAB, H)
        emb.weight.data.copy_(target_embedding)
        head.share_embedding(emb)
    t, k = 9, 5
    tokens = torch.randint(0, VOCAB, (t,), generator=torch.Generator().manual_seed(4)).tolist()
    aux = [torch.randn(t, TARGET_H, generator=torch.Generator().manual_seed(5 + i)) for i in range(3)]
    table = torch.tensor([3, 6, 1, 4, 2], dtype=torch.int32)
    kv_cache = torch.randn(2, 8, BLOCK, KV_HEADS, HEAD_DIM)
    normed, prenorm = head(torch.tensor(tokens), torch.arange(t), head.combine(aux), kv_cache, _meta(0, t, table))
    drafts = [int(head.to_target_ids(head.compute_draft_logits(normed[-1:]).argmax(-1)))]
    for step in range(1, k):  # one position per draft, reading the cache the earlier positions wrote
        pos = t + step - 1
        normed, prenorm = head(torch.tensor(drafts[-1:]), torch.tensor([pos]), prenorm[-1:], kv_cache,
                               _meta(pos, 1, table))
        drafts.append(int(head.to_target_ids(head.compute_draft_logits(normed).argmax(-1))))
    assert drafts == reference_chain(sd_ref, tokens, aux, k)


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 2}, "2 layers are not supported"),
    ({"vocab_size": 77}, "is not the target's"),
    ({"architectures": ["LlamaForCausalLM"], "draft_vocab_size": None}, "not an EAGLE-3 head"),
    ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 99]}, "must be three target layers"),
])
def test_heads_that_do_not_fit_are_refused(change, message):
    cfg = {k: v for k, v in {**_head_config(), **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        Eagle3Config.from_hf_dict(cfg, _target_config())


def test_default_and_configured_auxiliary_layers():
    assert Eagle3Config.from_hf_dict(_head_config(), _target_config()).aux_layer_ids == (2, 4, 5)
    cfg = _head_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]})
    assert Eagle3Config.from_hf_dict(cfg, _target_config()).aux_layer_ids == (1, 3, 6)


def test_target_returns_the_residual_stream_entering_the_head_layers():
    """The states fed to `fc` are HF's hidden_states[i] (the input of layer i) of the same target."""
    import transformers

    from kvserve.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=TARGET_H, intermediate_size=64,
                                      num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    target = LlamaForCausalLM(ModelConfig.from_hf_dict(hf_cfg.to_dict()), get_attention_backend("torch"), 64)
    target.load_weights(hf.state_dict().items())
    target.aux_layer_ids = Eagle3Config.from_hf_dict(_head_config(), _target_config()).aux_layer_ids
    t = 10
    ids = torch.randint(0, VOCAB, (t,), generator=torch.Generator().manual_seed(1))
    kv = [torch.zeros(2, 4, BLOCK, 2, TARGET_H // 4) for _ in range(TARGET_LAYERS)]
    with torch.no_grad():
        hidden, aux = target(ids, torch.arange(t), kv, _meta(0, t, torch.tensor([0, 1, 2], dtype=torch.int32)))
        ref = hf(ids[None], output_hidden_states=True)
    assert len(aux) == 3
    for layer_id, state in zip(target.aux_layer_ids, aux):
        torch.testing.assert_close(state, ref.hidden_states[layer_id][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(target.compute_logits(hidden), ref.logits[0], rtol=1e-4, atol=1e-4)
