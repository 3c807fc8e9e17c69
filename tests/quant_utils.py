"""Reference quantizers, written from the checkpoint format specifications (round-to-nearest), used to
make AWQ / GPTQ / FP8 checkpoints of test models, and the dequantized twin HF transformers runs as the
oracle. Independent of kvserve's own unpacking code on purpose.

Formats (W is [out, in] as in nn.Linear; K = in, N = out):
* AWQ GEMM (AutoAWQ): qweight int32 [K, N/8], field i (bits 4i..4i+3) of element j = column 8j + ORDER[i],
  ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros int32 [K/g, N/8] packed alike; scales fp16 [K/g, N];
  W^T[k, n] = (q - z) * s. Zero points are unsigned and stored as they are.
* GPTQ v1 (AutoGPTQ): qweight int32 [K/pack, N] packed along K (row k in bits (k % pack) * bits);
  qzeros int32 [G, N/pack] packed along N sequentially, storing zero - 1; scales fp16 [G, N]; g_idx int32 [K].
* FP8: weight float8_e4m3fn [N, K] + float32 weight_scale: a scalar (HF fp8 / AutoFP8, per tensor) or
  [N, 1] (compressed-tensors, per channel) / [1] (compressed-tensors, per tensor).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = torch.float8_e4m3fn


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.int64) & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_along_cols(vals: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[R, C] ints -> int32 [R, C * bits / 32]; field i of element j holds column j * pack + order[i]."""
    pack = 32 // bits
    order = order or list(range(pack))
    v = vals.to(torch.int64).reshape(vals.shape[0], -1, pack)
    out = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, col in enumerate(order):
        out |= (v[:, :, col] & ((1 << bits) - 1)) << (bits * i)
    return _as_int32(out)


def pack_along_rows(vals: torch.Tensor, bits: int) -> torch.Tensor:
    pack = 32 // bits
    v = vals.to(torch.int64).reshape(-1, pack, vals.shape[1])
    out = torch.zeros(v.shape[0], v.shape[2], dtype=torch.int64)
    for i in range(pack):
        out |= v[:, i] << (bits * i)
    return _as_int32(out)


# ---- AWQ -------------------------------------------------------------------------------------------
def quantize_awq(w: torch.Tensor, group_size: int):
    """w [N, K] -> (tensors, dequantized w [N, K] fp32)."""
    wt = w.t().float()  # [K, N]
    k, n = wt.shape
    assert k % group_size == 0, f"input size {k} is not a multiple of group size {group_size}"
    grouped = wt.reshape(k // group_size, group_size, n)
    wmax, wmin = grouped.amax(1), grouped.amin(1)
    scales = ((wmax - wmin).clamp(min=1e-5) / 15).half().float()  # stored fp16: quantize with that value
    zeros = torch.clamp(torch.round(-wmin / scales), 0, 15)
    q = torch.clamp(torch.round(grouped / scales[:, None]) + zeros[:, None], 0, 15)
    deq = ((q - zeros[:, None]) * scales[:, None]).reshape(k, n)
    tensors = {
        "qweight": pack_along_cols(q.reshape(k, n), 4, AWQ_ORDER),
        "qzeros": pack_along_cols(zeros, 4, AWQ_ORDER),
        "scales": scales.half(),
    }
    return tensors, deq.t().contiguous()


# ---- GPTQ ------------------------------------------------------------------------------------------
def act_order_perm(k: int, seed: int) -> torch.Tensor:
    """Stand-in for GPTQ's descending-Hessian-diagonal order: a fixed permutation of the input rows
    (layers reading the same input share it, as they share the Hessian)."""
    return torch.randperm(k, generator=torch.Generator().manual_seed(seed))


def quantize_gptq(w: torch.Tensor, bits: int, group_size: int, sym: bool, perm: torch.Tensor | None = None):
    """w [N, K] -> (tensors, dequantized w [N, K] fp32). perm: act-order (desc_act) row order."""
    wt = w.t().float()  # [K, N]
    k, n = wt.shape
    maxq = 2**bits - 1
    g = group_size if group_size > 0 else k
    assert k % g == 0, f"input size {k} is not a multiple of group size {g}"
    order = perm if perm is not None else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    groups = k // g
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n)
    for gi in range(groups):
        rows = wt[g_idx == gi]
        xmax, xmin = rows.amax(0).clamp(min=0), rows.amin(0).clamp(max=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        s = ((xmax - xmin).clamp(min=1e-5) / maxq).half().float()
        z = torch.full_like(s, (maxq + 1) // 2) if sym else torch.round(-xmin / s)
        # v1 stores zero - 1 in `bits` bits: a zero of 0 would wrap, so RTN keeps zeros in [1, maxq].
        scales[gi], zeros[gi] = s, z.clamp(1, maxq)
    s_rows, z_rows = scales[g_idx.long()], zeros[g_idx.long()]
    q = torch.clamp(torch.round(wt / s_rows) + z_rows, 0, maxq)
    deq = (q - z_rows) * s_rows
    tensors = {
        "qweight": pack_along_rows(q, bits),
        "qzeros": pack_along_cols(zeros - 1, bits),
        "scales": scales.half(),
        "g_idx": g_idx,
    }
    return tensors, deq.t().contiguous()


# ---- FP8 -------------------------------------------------------------------------------------------
def quantize_fp8(w: torch.Tensor, per_channel: bool):
    """w [N, K] -> (weight e4m3, weight_scale fp32 ([N, 1] per channel, [] per tensor), dequantized fp32)."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax / 448.0).clamp(min=1e-12)
    q = (w / scale).clamp(-448, 448).to(FP8)
    return q, scale.float(), q.float() * scale


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]):
    """w [N, K] -> (e4m3, scale_inv [ceil(N/bn), ceil(K/bk)], dequantized fp32), one scale per block's amax."""
    bn, bk = block
    n, k = w.shape
    scale = torch.empty(-(-n // bn), -(-k // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax().clamp(min=1e-12) / 448
    wide = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / wide).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale, q.float() * wide


# ---- whole checkpoints -----------------------------------------------------------------------------
def write_block_fp8_pair(src_dir: Path, out_root: Path, block: tuple[int, int], scales_apart: bool = False
                         ) -> tuple[Path, Path]:
    """From an HF safetensors checkpoint of one file: (a block-wise FP8 checkpoint of every projection, dense or
    expert, the dequantized fp32 checkpoint for the oracle). scales_apart: the scales in a shard of their own,
    before their weights'."""
    import re

    from safetensors.torch import load_file, save_file

    stored, scales, dequantized = {}, {}, {}
    for name, w in load_file(str(Path(src_dir) / "model.safetensors")).items():
        stored[name] = dequantized[name] = w
        if re.search(r"(_proj|\.w[123])\.weight$", name):  # not the routers, norms, embedding or head
            stored[name], scales[name + "_scale_inv"], dequantized[name] = quantize_fp8_blocks(w.float(), block)
    qdir, ddir = Path(out_root) / "block-fp8", Path(out_root) / "dequantized"
    for out in (qdir, ddir):
        shutil.copytree(src_dir, out)
        (out / "model.safetensors").unlink()
    shards = [scales, stored] if scales_apart else [{**stored, **scales}]
    for i, tensors in enumerate(shards):
        save_file(tensors, str(qdir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(ddir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (qdir / "config.json").write_text(json.dumps(config))
    return qdir, ddir


def quant_config_for(method: str, **opt) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": opt["group_size"], "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": opt["bits"], "group_size": opt["group_size"],
                "desc_act": opt.get("desc_act", False), "sym": opt.get("sym", True), "lm_head": False,
                "checkpoint_format": "gptq"}
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if method == "compressed-tensors":
        strategy = "channel" if opt.get("per_channel", True) else "tensor"
        return {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True},
            }},
            "ignore": ["lm_head"],
        }
    raise ValueError(method)


def quantize_tensors(weights: dict[str, torch.Tensor], method: str, **opt):
    """HF-named float tensors -> (quantized checkpoint tensors, dequantized float tensors)."""
    quant, deq = {}, {}
    for name, t in weights.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in LINEAR_NAMES or parts[-1] != "weight":
            quant[name] = deq[name] = t
            continue
        base = name[: -len(".weight")]
        if method == "awq":
            tensors, d = quantize_awq(t, opt["group_size"])
        elif method == "gptq":
            perm = None
            if opt.get("desc_act"):
                layer = int(parts[parts.index("layers") + 1])
                perm = act_order_perm(t.shape[1], seed=layer * 100003 + t.shape[1])
            tensors, d = quantize_gptq(t, opt["bits"], opt["group_size"], opt.get("sym", True), perm)
        else:
            per_channel = method == "compressed-tensors" and opt.get("per_channel", True)
            q, s, d = quantize_fp8(t, per_channel)
            if method == "compressed-tensors" and not per_channel:
                s = s.reshape(1)
            tensors = {"weight": q, "weight_scale": s}
        for suffix, v in tensors.items():
            quant[f"{base}.{suffix}"] = v
        deq[name] = d.to(t.dtype)
    return quant, deq


def write_checkpoint(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor], tokenizer_from: Path | None = None,
                     tokenizer=None) -> Path:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer_from is not None:
        for f in Path(tokenizer_from).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
                shutil.copy(f, out_dir / f.name)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def make_quantized_pair(src_dir: Path, out_root: Path, method: str, **opt) -> tuple[Path, Path]:
    """From an HF safetensors checkpoint: (quantized checkpoint, dequantized fp checkpoint for the oracle)."""
    from safetensors.torch import load_file

    src_dir = Path(src_dir)
    weights = {}
    for f in sorted(src_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    config = json.loads((src_dir / "config.json").read_text())
    quant, deq = quantize_tensors(weights, method, **opt)
    tag = "-".join([method] + [f"{k}{v}" for k, v in sorted(opt.items())])
    qdir = write_checkpoint(Path(out_root) / f"q-{tag}", {**config, "quantization_config": quant_config_for(method, **opt)},
                            quant, tokenizer_from=src_dir)
    ddir = write_checkpoint(Path(out_root) / f"dq-{tag}", config, deq, tokenizer_from=src_dir)
    return qdir, ddir


def smollm2_weights() -> tuple[dict, dict[str, torch.Tensor]]:
    """SmolLM2-135M-Instruct's HF config and fp32 weights, read from the embedded GGUF by kvserve's reader."""
    from kvserve.model.default_model import find_default_gguf
    from kvserve.model.gguf_loader import iter_gguf_weights, read_gguf_config

    gguf = find_default_gguf()
    config = read_gguf_config(gguf)
    config["torch_dtype"] = "float32"
    weights = {name: t.float().contiguous() for name, t in iter_gguf_weights(gguf)}
    return config, weights


def make_smollm2_checkpoint(out_dir: Path, method: str | None, source=None, **opt) -> Path:
    """SmolLM2-135M-Instruct as an HF safetensors checkpoint: fp32 (method None) or quantized by the
    reference quantizers, with the GGUF's tokenizer and chat template. source: smollm2_weights(), if
    already read."""
    from kvserve.model.default_model import find_default_gguf, load_tokenizer

    config, weights = source or smollm2_weights()
    tokenizer = load_tokenizer(find_default_gguf())
    if method is None:
        return write_checkpoint(out_dir, config, weights, tokenizer=tokenizer)
    quant, _ = quantize_tensors(weights, method, **opt)
    return write_checkpoint(out_dir, {**config, "quantization_config": quant_config_for(method, **opt)}, quant,
                            tokenizer=tokenizer)
