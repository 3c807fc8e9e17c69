"""Triton kernels of quantization against their torch references, in both kernel tiers (see
tests/triton_interpreter.py: the interpreter on CPU tensors, and compiled on CUDA tensors with
`pytest -m gpu`): the int4/int8 kernels for AWQ and GPTQ layouts (the split-K skinny decode kernel, the
dequantize kernel of the prefill path, and the dispatch by M), the FP8 KV cache write/read in the Triton
attention backend, and the FP8 linear kernels (per-token activation quantization, the small-M W8A16 GEMM,
and on the GPU the torch._scaled_mm path).

The interpreter's bf16 tl.dot is wrong (it multiplies raw bits), so its GEMM kernels are checked in fp32
and fp16 there, and in bf16 too on the GPU."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import INTERPRETED, KERNEL_DEVICE, KERNEL_TIER, compiled_only, interpreter_only

pytest.importorskip("triton")

pytestmark = KERNEL_TIER
DEVICE = KERNEL_DEVICE


def _layer(method: str, k: int, n: int, **opt):
    """A layer in the served layout, made from random weights by the reference quantizers and loaded
    through the method's own create/load/process path."""
    from torch import nn

    from kvserve.model.quantization import AWQConfig, GPTQConfig
    from tests.quant_utils import quantize_tensors

    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    tensors, _ = quantize_tensors({"model.layers.0.mlp.down_proj.weight": w}, method, **opt)
    if method == "awq":
        cfg = AWQConfig(4, opt["group_size"], True, "gemm", [])
    else:
        cfg = GPTQConfig(opt["bits"], opt["group_size"], opt.get("desc_act", False), opt.get("sym", True), "gptq")
    layer = nn.Module()
    method_obj = cfg.get_quant_method("layers.0.mlp.down_proj")
    method_obj.create_weights(layer, k, [n], k, n, torch.float32)
    for name, t in tensors.items():
        getattr(layer, name.rsplit(".", 1)[1]).data.copy_(t)
    method_obj.process_weights_after_loading(layer)
    return layer


KERNEL_CASES = [
    ("awq", {"group_size": 32}),
    ("awq", {"group_size": 64}),
    ("awq", {"group_size": 128}),
    ("gptq", {"bits": 4, "group_size": 32, "desc_act": True, "sym": False}),
    ("gptq", {"bits": 4, "group_size": 128, "desc_act": False, "sym": True}),
    ("gptq", {"bits": 8, "group_size": 64, "desc_act": True, "sym": True}),
]


# Every int layout the new paths must handle: AWQ groups, GPTQ 4/8 bit, sym/asym, act-order or not.
INT_CASES = KERNEL_CASES + [
    ("gptq", {"bits": 4, "group_size": 64, "desc_act": True, "sym": True}),
    ("gptq", {"bits": 4, "group_size": 128, "desc_act": False, "sym": False}),
    ("gptq", {"bits": 8, "group_size": 128, "desc_act": False, "sym": False}),
    ("gptq", {"bits": 8, "group_size": 32, "desc_act": True, "sym": False}),
]
INT_IDS = [f"{m}-{'-'.join(f'{k}{v}' for k, v in o.items())}" for m, o in INT_CASES]
# The GPU tier compiles each kernel variant (~1-2 s each), so there the tests keep the cases that reach a code
# path or layout the others do not; the interpreter (CPU) tier, which compiles nothing, keeps them all.
# The int kernels are specialized on (bits, group size, act order); sym only changes the zeros' values. The
# layouts below cover 4 and 8 bits, with and without act order, and group sizes 32, 64 and 128.
GPU_INT_CASES = {0, 3, 5, 8}
INT_PARAMS = [pytest.param(m, o, id=i, marks=() if n in GPU_INT_CASES else interpreter_only)
              for n, ((m, o), i) in enumerate(zip(INT_CASES, INT_IDS))]


def _on_device(layer):
    for p in layer.parameters():
        p.data = p.data.to(DEVICE)
    return DEVICE


@pytest.mark.parametrize("method,opt", INT_PARAMS)
def test_dequantize_kernel_equals_reference(method, opt):
    """The prefill path's dequantize kernel writes exactly IntWeights.dequantize's W (same fp32 ops)."""
    from kvserve.model.quantization.int_weights import IntWeights
    from kvserve.ops.triton_int_dequant import dequantize_int

    layer = _layer(method, 384, 96, **opt)  # 3 K tiles of 128; 96 columns: a masked N tile
    _on_device(layer)
    reference = IntWeights.dequantize(layer).float()
    args = (layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.quant_bits, layer.group_size)
    assert torch.equal(dequantize_int(*args, torch.float32), reference)
    # bf16: one rounding of the same fp32 value (the interpreter truncates where the GPU rounds to nearest).
    torch.testing.assert_close(dequantize_int(*args, torch.bfloat16).float(), reference, atol=0, rtol=2**-7)


@pytest.mark.parametrize("method,opt", INT_PARAMS)
@pytest.mark.parametrize("rows", [1, 5])  # the FMA (one row) and tl.dot variants
def test_skinny_split_k_equals_reference(method, opt, rows):
    """Every split count (1: direct store; several, with a ragged last split) gives the reference product,
    and the shared workspace and tile counters are left zero for the next call (CUDA-graph replays rely
    on it)."""
    from kvserve.model.quantization.int_weights import IntWeights
    from kvserve.ops.split_k_atomic import is_clean
    from kvserve.ops.triton_int_gemv import skinny_int_gemm

    k, n = (320 if opt["group_size"] <= 64 else 384), 96  # 320: a partial last K tile of 128
    layer = _layer(method, k, n, **opt)
    device = _on_device(layer)
    x = torch.randn(rows, k, device=device)
    reference = x @ IntWeights.dequantize(layer).float()
    pack = 32 // layer.quant_bits
    configs = [(64, 128, 4, 3), (32, 16 * pack, 2, 2)] if rows > 1 else [(128, 128, 4, 3), (32, 64, 2, 2)]
    if not INTERPRETED:  # compiled: the FMA variant on the wide K tile, the tl.dot one on the narrow
        configs = configs[:1] if rows == 1 else configs[1:]
    for config in configs:
        for split in (1, 2, 3, 8) if INTERPRETED else (1, 3):  # 3: a ragged last split
            got = skinny_int_gemm(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.quant_bits,
                                  layer.group_size, split, config)
            torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4, msg=f"{config} split {split}")
            assert is_clean(x.device), "workspace not left clean"


@pytest.mark.parametrize("method,opt", INT_PARAMS)
@pytest.mark.parametrize("rows", [17, 40])  # one M tile with a ragged edge, several
def test_mma_kernel_equals_dequantized_reference(method, opt, rows):
    """The tensor-core GEMM multiplies by exactly the reference's dequantized weight: fp32 (the products of
    the same W, summed in another order) and fp16 (W rounded once, as the reference rounds it), at every
    split count (ragged last split, partial last K tile) and tile shape; the workspace is left clean."""
    from kvserve.model.quantization.int_weights import IntWeights
    from kvserve.ops.split_k_atomic import is_clean
    from kvserve.ops.triton_int_mma import mma_int_gemm

    k, n = (320 if opt["group_size"] <= 64 else 384), 96  # 96 columns: a masked N tile
    layer = _layer(method, k, n, **opt)
    device = _on_device(layer)
    # Compiled: fp32 (ieee dot) and bf16 (served); fp16 is the same 16-bit tensor-core path as bf16.
    cases = [(torch.float32, 1e-5), (torch.float16, 2e-3)] if INTERPRETED else [(torch.float32, 1e-5),
                                                                                 (torch.bfloat16, 2e-2)]
    for dtype, tol in cases:
        # As served in dtype: its scales and zeros; the reference W is (q - z) * s in fp32, rounded to dtype once.
        layer.scales.data, layer.zeros.data = layer.scales.data.to(dtype), layer.zeros.data.to(dtype)
        x = torch.randn(rows, k, device=device).to(dtype)
        reference = x.float() @ IntWeights.dequantize(layer).float()
        configs = [(64, 32, 64, 4, 2), (32, 16, 128, 4, 2)]  # compiled: both in bf16, the first in fp32
        for config in configs if INTERPRETED or dtype == torch.bfloat16 else configs[:1]:
            for split in (1, 2, 3) if INTERPRETED else (1, 3) if dtype == torch.bfloat16 else (3,):
                got = mma_int_gemm(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.quant_bits,
                                   layer.group_size, config, split)
                assert got.dtype == dtype
                torch.testing.assert_close(got.float(), reference, atol=tol, rtol=tol, msg=f"{config} split {split}")
                assert is_clean(x.device), "workspace not left clean"


def _uses_bf16_dot(path, rows: int) -> bool:
    return path.kernel == "mma" or (path.kernel == "skinny" and rows > 1)


@pytest.mark.parametrize("method,opt", [pytest.param(*INT_CASES[2], id=INT_IDS[2], marks=interpreter_only),
                                        pytest.param(*INT_CASES[3], id=INT_IDS[3]),
                                        pytest.param(*INT_CASES[5], id=INT_IDS[5], marks=interpreter_only)])
@pytest.mark.parametrize("rows", [1, 4, 16, 40, 256, 300])  # skinny M=1, skinny dot, mma, dequant + matmul
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=interpreter_only), torch.bfloat16],
                         ids=["fp32", "bf16"])  # compiled: as served (the kernel tests above cover fp32)
@pytest.mark.parametrize("table", ["engine", "mma"])  # the table as it is; with the mma kernel in its buckets
def test_int_matmul_dispatch(method, opt, rows, dtype, table, monkeypatch):
    """The engine's entry point at every path its table picks by M, against the reference
    dequantize-then-matmul in fp32; bf16 as served (scales, zeros and activations)."""
    from kvserve.model.quantization import int_matmul as rule
    from kvserve.model.quantization.int_matmul import int_matmul, int_path
    from kvserve.model.quantization.int_weights import IntWeights

    if table == "mma":
        monkeypatch.setattr(rule, "INT_PATHS", tuple(
            rule.IntPath(p.max_rows, "mma", rule.mma_config(p.max_rows)) if rule.SKINNY_MAX_M < p.max_rows <= 256
            else p for p in rule.INT_PATHS))

    if INTERPRETED and dtype == torch.bfloat16 and _uses_bf16_dot(int_path(rows), rows):
        pytest.skip("the interpreter's tl.dot gives garbage for bf16 operands")
    k, n = 256, 96
    layer = _layer(method, k, n, **opt)
    device = _on_device(layer)
    layer.scales.data = layer.scales.data.to(dtype)
    layer.zeros.data = layer.zeros.data.to(dtype)
    x = torch.randn(rows, k, device=device).to(dtype)
    reference = x.float() @ IntWeights.dequantize(layer).float()
    got = int_matmul(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.quant_bits, layer.group_size)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), reference, atol=tol, rtol=tol)


FP8_KV_CASES = [  # (context lengths, query lengths, forced split-KV): prefill with context, mixed, decode
    ([0, 21], [17, 5], None),
    ([40, 3, 0], [1, 1, 1], False),
    ([300, 90], [1, 1], True),
]


@pytest.mark.parametrize("ctx_lens,q_lens,split", FP8_KV_CASES)
def test_fp8_kv_cache_triton_equals_torch_reference(ctx_lens, q_lens, split):
    """Both backends store the same e4m3 bytes and attend over the same dequantized K/V."""
    from kvserve.ops.attention_metadata import AttentionMetadata
    from kvserve.ops.torch_attention import TorchAttentionBackend, quantize_kv
    from kvserve.ops.triton_attention import TritonAttentionBackend
    from tests.kernels.test_triton_attention import make_batch

    q, k, v, kv_cache, meta = make_batch(ctx_lens, q_lens, seed=len(ctx_lens))
    device = q.device
    k_scale = torch.tensor([0.011], device=device)
    v_scale = torch.tensor([0.013], device=device)
    # The cached context: the full-precision cache's values quantized with the same scales.
    cache = torch.stack([quantize_kv(kv_cache[0], k_scale), quantize_kv(kv_cache[1], v_scale)])
    scale = q.shape[-1] ** -0.5
    ref_cache, tri_cache = cache.clone(), cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, scale, k_scale=k_scale, v_scale=v_scale)
    backend = TritonAttentionBackend(split_kv=split, num_splits=3 if split else None)
    out = backend.forward(q, k, v, tri_cache, meta, scale, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(tri_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # And the fp8 cache is a real approximation of the full-precision one (e4m3: 3 mantissa bits).
    full = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), AttentionMetadata(**meta.__dict__), scale)
    n = meta.num_actual_tokens
    assert (out[:n] - full[:n]).abs().max() < 0.15


def _all_e4m3_values() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return v[~v.isnan()]


def _encode_kernel():
    """A kernel that stores e4m3_bits of its input (the jit function resolves names in this module)."""
    global e4m3_bits
    import triton
    import triton.language as tl

    from kvserve.ops.fp8_quant import e4m3_bits

    @triton.jit
    def encode(x_ptr, y_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y_ptr + o, e4m3_bits(tl.load(x_ptr + o)))

    return encode


def test_e4m3_encoding_equals_torch_cast():
    """Every e4m3 value, the midpoints between neighbours (ties: round half to even), values just off them,
    subnormals, zeros of both signs, overflow (clamped to +-448) and NaN: the same bytes as torch's cast."""
    import triton

    encode = _encode_kernel()
    vals = _all_e4m3_values().sort().values
    mids = (vals[:-1] + vals[1:]) / 2
    torch.manual_seed(0)
    x = torch.cat([vals, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), torch.randn(2000) * 100,
                   torch.randn(2000) * 0.003, torch.tensor([0.0, -0.0, 500.0, -1e30, 1e-42, float("nan")])])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    got = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    encode[(1,)](x.to(DEVICE), got, N=n)
    got = got.cpu()
    want = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got, want), (x[got != want][:8], got[got != want][:8], want[got != want][:8])


def _e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 values apart a and b are (sign and magnitude bits; adjacent values differ by one)."""
    a, b = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    return torch.where((a ^ b) & 0x80 == 0, ((a & 0x7F) - (b & 0x7F)).abs(), 256)


def assert_per_token_quant_matches_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """The per-token quantization (q, scale) of x [M, K] against the torch reference quantize_per_token.
    On the CPU they are equal bit for bit. On CUDA torch divides a tensor by a Python scalar as a multiply by its
    reciprocal (amax / 448), so a reference scale may be 1 ulp off the kernel's IEEE division: there the scales
    agree to 1 ulp, q is exactly x / scale (IEEE, clamped, cast) of the kernel's own scale, and equals the
    reference's bytes on rows whose scales are equal and is within one e4m3 step of them on the others."""
    from kvserve.ops.fp8_e4m3 import quantize_per_token as reference

    rq, rscale = reference(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == rscale.shape
    if DEVICE == "cpu":
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(scale, rscale)
        return
    torch.testing.assert_close(scale, rscale, rtol=2**-23, atol=0)
    exact = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # a tensor divisor: IEEE division
    assert torch.equal(q.view(torch.uint8), exact.view(torch.uint8))
    steps = _e4m3_steps(q, rq)
    same_scale = (scale == rscale).expand_as(steps)
    assert bool((steps[same_scale] == 0).all()), "bytes differ from the reference at an equal scale"
    assert bool((steps <= 1).all()), "more than one e4m3 step from the reference"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, pytest.param(torch.float32, marks=interpreter_only)])
@pytest.mark.parametrize("rows,cols", [(5, 4096), (2, 14336), (3, 100)])
def test_per_token_quant_kernel_equals_torch_bit_for_bit(dtype, rows, cols):
    """Same e4m3 bytes and same fp32 scales as the torch reference (division rounding included: div_rn),
    dynamic scales (an all-zero row takes the minimum scale) and the static per-tensor input scale."""
    from kvserve.ops.fp8_quant import quantize_per_token

    torch.manual_seed(rows)
    x = (torch.randn(rows, cols) * torch.logspace(-3, 2, rows)[:, None]).to(dtype)
    x[0] = 0
    x = x.to(DEVICE)
    q, scale = quantize_per_token(x)
    assert scale.shape == (rows, 1)
    assert_per_token_quant_matches_reference(x, q, scale)
    # A strided view (every other column) reads the same as its contiguous copy.
    wide = torch.cat([x, x], dim=1)[:, ::2]
    assert torch.equal(quantize_per_token(wide)[0].view(torch.uint8),
                       quantize_per_token(wide.contiguous())[0].view(torch.uint8))
    if not INTERPRETED and dtype != torch.bfloat16:
        return  # compiled: the static-scale variant in bf16 only
    static = torch.tensor([0.37], device=DEVICE)
    q, scale = quantize_per_token(x, static)
    want = (x.float() / static).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(scale, static.expand(rows, 1))


def _fp8_weight(n: int, k: int):
    from kvserve.ops.fp8_e4m3 import quantize_per_channel

    torch.manual_seed(n + k)
    w = (torch.randn(n, k) * 0.05 * torch.rand(n, 1)).to(DEVICE)  # per-channel scales that differ
    q, scale = quantize_per_channel(w)
    return q, scale, q.float() * scale[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=compiled_only)],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m,k,n", [pytest.param(1, 1024, 48, marks=interpreter_only), (1, 640, 96), (5, 640, 96),
                                   (16, 2048, 64)])
def test_fp8_gemv_equals_dequantized_reference(dtype, m, k, n):
    """The one-launch decode kernel: the FMA variant (one row) and the tl.dot one (2-16 rows), ragged K,
    N not a multiple of BLOCK_N, split counts including a ragged last split; the workspace is left clean."""
    from kvserve.ops.split_k_atomic import is_clean
    from kvserve.ops.triton_fp8_gemv import fp8_gemv

    if not INTERPRETED and dtype == torch.float16 and m != 16:
        pytest.skip("compiled: fp16 at one shape (its 16-bit path is bf16's, which runs at every shape)")
    q, scale, ref_w = _fp8_weight(n, k)
    x = torch.randn(m, k).to(dtype).to(DEVICE)
    ref = x.float() @ ref_w.T
    tol = {torch.float32: 5e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]  # 16-bit: the output rounding
    configs = [(16, 256, 4, 2), (64, 128, 4, 2)]  # compiled: both in bf16 (served), the first otherwise
    for config in configs if INTERPRETED or dtype == torch.bfloat16 else configs[:1]:
        for split_k in (None, 1, 3) if INTERPRETED else (1, 3) if dtype == torch.bfloat16 else (3,):
            got = fp8_gemv(x, q, scale, config, split_k)
            assert got.dtype == dtype and got.shape == (m, n)
            torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol, msg=f"{config} split {split_k}")
            assert is_clean(x.device), "workspace not left clean"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=compiled_only)],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m,k,n", [pytest.param(1, 1024, 48, marks=interpreter_only), (5, 640, 96), (16, 2048, 64),
                                   (33, 512, 32)])
def test_w8a16_gemm_equals_dequantized_reference(dtype, m, k, n):
    """x @ (e4m3 weight * per-channel scale)^T: ragged K (640 is not a multiple of BLOCK_K), N not a multiple
    of BLOCK_N, M past one BLOCK_M tile; split-K (forced) agrees with a single split."""
    from kvserve.ops.triton_fp8_gemm import w8a16_gemm

    if not INTERPRETED and dtype == torch.float16 and m != 16:
        pytest.skip("compiled: fp16 at one shape (its 16-bit path is bf16's, which runs at every shape)")
    q, scale, ref_w = _fp8_weight(n, k)
    x = torch.randn(m, k).to(dtype).to(DEVICE)
    ref = x.float() @ ref_w.T
    tol = {torch.float32: 5e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]  # 16-bit: the output rounding
    for split_k in (None, 1, 3):
        got = w8a16_gemm(x, q, scale, split_k=split_k)
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=compiled_only)],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m,k,n,group_k", [(1, 640, 96, 128), (5, 200, 72, 24), (16, 1024, 64, 128)])
def test_block_fp8_kernels_equal_dequantized_reference(dtype, m, k, n, group_k):
    """Block-wise FP8 (quantization/fp8_block.py's layout): e4m3 [N, K], scales [R, ceil(K / group_k)] read
    through a row map (rows of several parts, sharing and skipping scale rows). The dequantize kernel gives
    the torch reference's values bit for bit; the W8A16 kernel with group scales (split-K forced too) the
    product of that dequantized weight. Ragged K (640, 200 past the last whole group)."""
    from kvserve.ops.fp8_group_dequant import dequantize_groups, dequantize_groups_triton
    from kvserve.ops.triton_fp8_gemm import w8a16_gemm

    torch.manual_seed(n + k + group_k)
    groups = -(-k // group_k)
    q = (torch.randn(n, k) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).to(DEVICE)
    scale = (torch.rand(n // 4 + 3, groups) * 1e-3 + 1e-4).to(DEVICE)
    scale_row = torch.randint(0, scale.shape[0], (n,), dtype=torch.int32).sort().values.to(DEVICE)
    ref_w = dequantize_groups(q, scale, scale_row, group_k, torch.float32)
    assert torch.equal(ref_w.cpu(), q.float().cpu() * scale.cpu()[scale_row.long().cpu()].repeat_interleave(
        group_k, dim=1)[:, :k])
    for out_dtype in (torch.float32, dtype):
        got = dequantize_groups_triton(q, scale, scale_row, group_k, out_dtype)
        assert torch.equal(got, dequantize_groups(q, scale, scale_row, group_k, out_dtype))
    x = torch.randn(m, k).to(dtype).to(DEVICE)
    ref = x.float() @ ref_w.to(dtype).float().T
    tol = {torch.float32: 5e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for split_k in (None, 3):
        got = w8a16_gemm(x, q, scale, split_k=split_k, group_k=group_k, scale_row=scale_row)
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol, msg=f"split {split_k}")


def test_w8a16_launch_config_fits_shared_memory():
    """Every activation dtype gets a launch config within an H100/H200's shared memory per block (fp32 at
    BLOCK_M 64 needs 253,952 bytes with the 16-bit config); the 16-bit configs are left as measured."""
    from kvserve.ops import triton_fp8_gemm as gemm

    limit = gemm.DEFAULT_SHARED_MEMORY
    for block_m in (16, 32, 64):
        for x_bytes in (2, 4):
            block_n, block_k, _, stages = config = gemm.fit_shared_memory(block_m, gemm.CONFIG, x_bytes, limit)
            assert gemm.shared_memory_bytes(block_m, block_n, block_k, stages, x_bytes) <= limit
            assert config == gemm.CONFIG or x_bytes == 4
    assert gemm.fit_shared_memory(64, gemm.CONFIG, 4, limit) != gemm.CONFIG


@pytest.mark.parametrize("rows", [1, 16, 17, 40])
@pytest.mark.parametrize("decode_kernel", ["w8a16", "gemv"])
def test_fp8_linear_apply_chooses_by_rows_and_matches_reference(rows, decode_kernel, monkeypatch):
    """Fp8LinearMethod.apply's GPU path on the CPU: torch._scaled_mm (no CPU FP8 GEMM) is replaced by its
    definition. Where fp8_matmul's table says, a W8A16 kernel runs (activations unquantized: close to the
    dequantized reference); above, the Triton per-token quantization feeds _scaled_mm with the reference
    quantize_per_token's bytes and scales (bit for bit on the CPU; see assert_per_token_quant_matches_reference)."""
    from torch import nn

    from kvserve.model.quantization import fp8, fp8_matmul
    from kvserve.model.quantization.fp8_matmul import fp8_path

    monkeypatch.setattr(fp8_matmul, "FP8_PATHS", tuple(
        fp8_matmul.Fp8Path(p.max_rows, decode_kernel, fp8_matmul.GEMV_CONFIGS[p.max_rows] if decode_kernel == "gemv"
                           else None) if p.kernel != "scaled_mm" else p for p in fp8_matmul.FP8_PATHS))
    k, n = 256, 96
    q, scale, ref_w = _fp8_weight(n, k)
    calls = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        calls.append((a.clone(), scale_a.clone()))
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    for static in (False, True):
        calls.clear()
        method = fp8.Fp8LinearMethod(checkpoint_is_fp8=True, weight_strategy="channel", static_input=static)
        layer = nn.Module()
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer.input_scale = nn.Parameter(torch.tensor([0.02], device=DEVICE), requires_grad=False)
        layer.fp8_gemm = True
        x = torch.randn(2, rows, k, dtype=torch.float16)[:, : (rows + 1) // 2].contiguous().to(DEVICE)  # [2, ~rows/2, k]
        bias = torch.randn(n, dtype=torch.float16).to(DEVICE)
        out = method.apply(layer, x, bias)
        assert out.shape == (*x.shape[:-1], n) and out.dtype == x.dtype
        m = x.shape[0] * x.shape[1]
        if fp8_path(m).kernel != "scaled_mm":
            assert not calls
            torch.testing.assert_close(out.float(), x.float() @ ref_w.T + bias.float(), atol=3e-3, rtol=3e-3)
            continue
        (xq, x_scale), = calls
        x2 = x.reshape(m, k)
        if static:  # divided by the input_scale tensor (IEEE, as the kernel; a Python 0.02 is a reciprocal on CUDA)
            want_q = (x2.float() / layer.input_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(x_scale, layer.input_scale.expand(m, 1))
        else:
            assert_per_token_quant_matches_reference(x2, xq, x_scale)
        # W8A8: the activation quantization error (e4m3: ~1/16 relative per element) stays small.
        assert (out.float() - (x.float() @ ref_w.T + bias.float())).abs().max() < 0.1


def test_fp8_kv_write_kernel_quantizes_like_torch():
    """The KV write kernel's in-kernel e4m3 quantization (k / k_scale, clamped) against torch's
    write_kv_cache, with values that clamp, subnormals, exact ties, strided K/V views and padded slots."""
    from kvserve.ops.torch_attention import write_kv_cache
    from kvserve.ops.triton_attention import reshape_and_cache

    torch.manual_seed(0)
    num_blocks, block_size, hkv, d, t = 6, 8, 2, 32, 11
    ties = (_all_e4m3_values().sort().values[:64] + _all_e4m3_values().sort().values[1:65]) / 2
    qkv = torch.randn(t, 3, hkv, d)  # K/V as strided views of a fused projection output
    qkv[1, 1].view(-1)[:] = ties * 0.5  # k_scale 0.5: k / k_scale hits the ties exactly
    qkv[0, 1, 0, :4] = torch.tensor([1e4, -1e4, 1e-5, -3e-4])
    k, v = qkv[:, 1], qkv[:, 2]
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([0.013])
    slots = torch.randperm(num_blocks * block_size)[:t]
    slots[3] = -1  # CUDA-graph padding: skipped
    qkv, slots, k_scale, v_scale = (x.to(DEVICE) for x in (qkv, slots, k_scale, v_scale))
    k, v = qkv[:, 1], qkv[:, 2]
    ref = torch.zeros(2, num_blocks, block_size, hkv, d, dtype=torch.float8_e4m3fn, device=DEVICE)
    got = ref.clone()
    keep = slots >= 0
    write_kv_cache(k[keep], v[keep], ref, slots[keep], k_scale, v_scale)
    reshape_and_cache(k, v, got, slots, t, k_scale, v_scale)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.skipif(INTERPRETED, reason="torch._scaled_mm needs CUDA")
@pytest.mark.parametrize("rows", [17, 40, 300])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_fp8_linear_scaled_mm_path_on_gpu(rows, static, monkeypatch):
    """The W8A8 path as served: bf16 activations, the Triton per-token quantization, the real
    torch._scaled_mm on the FP8 tensor cores, against the same GEMM over the dequantized operands."""
    from torch import nn

    from kvserve.model.quantization import fp8

    if not fp8.cuda_has_fp8(torch.device(DEVICE)):
        pytest.skip("no FP8 tensor cores (compute capability < 8.9)")
    k, n = 512, 96
    q, scale, ref_w = _fp8_weight(n, k)
    method = fp8.Fp8LinearMethod(checkpoint_is_fp8=True, weight_strategy="channel", static_input=static)
    layer = nn.Module()
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    layer.input_scale = nn.Parameter(torch.tensor([0.02], device=DEVICE), requires_grad=False)
    layer.fp8_gemm = True
    x = torch.randn(rows, k, device=DEVICE).to(torch.bfloat16)
    calls = []
    real_scaled_mm = torch._scaled_mm

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):  # the real GEMM; records the operands it was given
        calls.append((a.clone(), scale_a.clone()))
        return real_scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    out = method.apply(layer, x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    (xq, x_scale), = calls
    want = (xq.float() * x_scale) @ ref_w.T  # the product of exactly the operands the GEMM was given, in fp32
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)  # bf16 output: 2**-8 relative
    # And those operands are the per-token quantization of x (or x / the static input scale).
    if static:
        want_q = (x.float() / layer.input_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(x_scale, layer.input_scale.expand(rows, 1))
    else:
        assert_per_token_quant_matches_reference(x, xq, x_scale)
