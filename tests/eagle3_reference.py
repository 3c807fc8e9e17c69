"""A plain-torch EAGLE-3 head, written from the checkpoint layout (midlayer.*, fc, norm, lm_head, d2t):
the reference kvserve's head (kvserve/model/eagle3.py) and its use in the engine are tested against.
Whole sequences at once, no cache."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [T, heads, D]; HF Llama's rotate-half convention
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_head(sd, token_ids, hidden, num_heads: int, num_kv_heads: int, eps: float = 1e-5,
                   theta: float = 10000.0):
    """token_ids [T] (the token after each position), hidden [T, H] (fc output, or the previous
    position's pre-norm output) -> (normed, pre-norm states, the target id each position proposes)."""
    t = len(token_ids)
    head_dim = sd["midlayer.self_attn.q_proj.weight"].shape[0] // num_heads
    pos = torch.arange(t)
    x = torch.cat([_rms(sd["embed_tokens.weight"][token_ids], sd["midlayer.input_layernorm.weight"], eps),
                   _rms(hidden, sd["midlayer.hidden_norm.weight"], eps)], -1)
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(t, num_heads, head_dim)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(t, num_kv_heads, head_dim)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(t, num_kv_heads, head_dim)
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    k, v = k.repeat_interleave(num_heads // num_kv_heads, 1), v.repeat_interleave(num_heads // num_kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
    h = attn @ sd["midlayer.self_attn.o_proj.weight"].T + hidden
    n = _rms(h, sd["midlayer.post_attention_layernorm.weight"], eps)
    prenorm = (F.silu(n @ sd["midlayer.mlp.gate_proj.weight"].T) * (n @ sd["midlayer.mlp.up_proj.weight"].T)
               ) @ sd["midlayer.mlp.down_proj.weight"].T + h
    normed = _rms(prenorm, sd["norm.weight"], eps)
    draft_ids = (normed @ sd["lm_head.weight"].T).argmax(-1)
    return normed, prenorm, draft_ids + sd["d2t"][draft_ids]


def reference_chain(sd, tokens, aux, k: int, num_heads: int, num_kv_heads: int, eps: float = 1e-5,
                    theta: float = 10000.0) -> list[int]:
    """Positions 0..T-1 (tokens[t]: the token at t + 1, with the target's states `aux` at t), then k
    chained drafts: the target ids proposed for positions T + 1 .. T + k."""
    hidden = torch.cat(aux, -1) @ sd["fc.weight"].T
    ids, drafts = list(tokens), []
    for _ in range(k):
        _, prenorm, next_ids = reference_head(sd, torch.tensor(ids), hidden, num_heads, num_kv_heads, eps, theta)
        drafts.append(int(next_ids[-1]))
        ids.append(drafts[-1])
        hidden = torch.cat([hidden, prenorm[-1:]])  # the new position reads the previous pre-norm state
    return drafts


def save_random_head(path, hidden: int, num_heads: int, num_kv_heads: int, intermediate: int, vocab: int,
                     draft_vocab: int, aux_layers: list[int], seed: int = 5) -> dict:
    """A random EAGLE-3 head for a target of width `hidden` in the public layout (config.json and
    model.safetensors, no embedding of its own: it reads the target's) at `path`; returns its tensors."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    q, kv = hidden, num_kv_heads * hidden // num_heads
    sd = {
        "fc.weight": r(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": 1 + r(hidden), "midlayer.hidden_norm.weight": 1 + r(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + r(hidden),
        "midlayer.self_attn.q_proj.weight": r(q, 2 * hidden), "midlayer.self_attn.k_proj.weight": r(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": r(kv, 2 * hidden), "midlayer.self_attn.o_proj.weight": r(hidden, q),
        "midlayer.mlp.gate_proj.weight": r(intermediate, hidden), "midlayer.mlp.up_proj.weight": r(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": r(hidden, intermediate),
        "norm.weight": 1 + r(hidden), "lm_head.weight": r(draft_vocab, hidden) * 5,
        # A reduced vocabulary: draft id i is target id sorted(random subset)[i], stored as an offset.
        "d2t": torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool),
    }
    save_file(sd, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "intermediate_size": intermediate,
        "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab, "target_hidden_size": hidden,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}}))
    return sd
