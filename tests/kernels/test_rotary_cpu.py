"""The torch rotary path (CPU) against HF transformers' apply_rotary_pos_emb: bit-identical in every dtype."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.layers import RotaryEmbedding

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_matches_hf_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 37
    rotary = RotaryEmbedding(head_dim, 512, 10000.0)
    # q and k as the model passes them: strided views of one fused qkv output.
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    got_q, got_k = rotary(positions, q, k)
    freqs = torch.cat((rotary.cos_cached, rotary.cos_cached), -1)[positions], \
        torch.cat((rotary.sin_cached, rotary.sin_cached), -1)[positions]
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, freqs[0].to(dtype), freqs[1].to(dtype),
                                                         unsqueeze_dim=1)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
