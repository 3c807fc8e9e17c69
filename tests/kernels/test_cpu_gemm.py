"""oneDNN packed fp32 linears (the CPU GEMM path) against F.linear, and which layers get switched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.layers import MergedColumnLinear, RowParallelLinear
from kvserve.ops import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.onednn_linear_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 3, 32, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 40, generator=g)
    out = cpu_gemm.PackedLinearWeight(w).linear(x, b)
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_non_contiguous_and_3d_inputs():
    w = torch.randn(24, 16)
    packed = cpu_gemm.PackedLinearWeight(w)
    x = torch.randn(16, 10)[:, :8].t()  # [8, 16], not contiguous
    torch.testing.assert_close(packed.linear(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


class _AllReduceLike(RowParallelLinear):
    """A layer whose forward does more than the GEMM: only its method is swapped, its forward stays."""

    def forward(self, x):
        return super().forward(x) * 2


class _FakeQuantMethod:
    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias) + 1


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(MergedColumnLinear(16, [8, 8], bias=True), RowParallelLinear(16, 16),
                                _AllReduceLike(16, 16))
    for m in model:
        m.weight.data.normal_()
        if m.bias is not None:
            m.bias.data.normal_()
    return model


def test_pack_cpu_linears_switches_plain_layers_and_keeps_outputs(monkeypatch):
    monkeypatch.delenv("KVSERVE_CPU_ONEDNN", raising=False)
    model = _model()
    x = torch.randn(5, 16)
    before = model(x)
    # Every layer's unquantized method is swapped; a layer whose forward does more keeps that forward.
    assert cpu_gemm.pack_cpu_linears(model) == 3
    assert all(hasattr(m, "packed_weight") for m in model)
    torch.testing.assert_close(model(x), before, atol=1e-4, rtol=1e-5)


def test_layers_with_a_linear_method(monkeypatch):
    """The quant-method hook: an unquantized method is swapped for the packed one, any other method is left
    alone."""
    monkeypatch.delenv("KVSERVE_CPU_ONEDNN", raising=False)
    plain, quant = RowParallelLinear(16, 8, bias=True), RowParallelLinear(16, 8)
    quant.quant_method = _FakeQuantMethod()
    for m in (plain, quant):
        m.weight.data.normal_()
    plain.bias.data.normal_()
    x = torch.randn(4, 16)
    want_plain, want_quant = plain(x), quant(x)
    assert cpu_gemm.pack_cpu_linears(torch.nn.Sequential(plain, quant)) == 1
    assert isinstance(plain.quant_method, cpu_gemm.PackedUnquantizedMethod)
    assert isinstance(quant.quant_method, _FakeQuantMethod)
    torch.testing.assert_close(plain(x), want_plain, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(quant(x), want_quant)


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_ONEDNN", "0")
    model = _model()
    assert cpu_gemm.pack_cpu_linears(model) == 0
    assert not any(hasattr(m, "packed_weight") for m in model)


def test_non_fp32_layers_are_left_alone(monkeypatch):
    monkeypatch.delenv("KVSERVE_CPU_ONEDNN", raising=False)
    model = _model().to(torch.bfloat16)
    assert cpu_gemm.pack_cpu_linears(model) == 0


def test_lm_head_is_packed_and_a_tied_embedding_keeps_its_weight(monkeypatch):
    """The logits GEMM goes through the packed copy; the tied embedding still looks rows up in the weight."""
    from kvserve.model.layers import ParallelLMHead, VocabParallelEmbedding

    monkeypatch.delenv("KVSERVE_CPU_ONEDNN", raising=False)
    torch.manual_seed(0)
    embed, head = VocabParallelEmbedding(50, 16), ParallelLMHead(50, 16)
    embed.weight.data.normal_()
    head.weight = embed.weight  # tied, as LlamaForCausalLM does
    hidden, ids = torch.randn(7, 16), torch.tensor([3, 0, 49])
    want_logits, want_rows = head.compute_logits(hidden), embed(ids)
    assert cpu_gemm.pack_cpu_linears(torch.nn.ModuleDict({"embed": embed, "head": head})) == 1
    assert head.packed_weight is not None and not hasattr(embed, "packed_weight")
    assert head.weight is embed.weight
    torch.testing.assert_close(head.compute_logits(hidden), want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(embed(ids), want_rows, atol=0, rtol=0)
    assert head.compute_logits(hidden[:0]).shape == (0, 50)
