"""A random-weight HF checkpoint of a Llama or Qwen3-MoE shape, for comparisons in which both engines (vLLM 0.26.0
and kvserve) read the same weights, so that their mixture-of-experts layers route the same way.

Each engine's `load_format="dummy"` fills weights its own way, and the routing follows the values: vLLM 0.26.0's fp8
dummy Qwen3-30B-A3B sends every token to the same 8 experts (benchmarks/moe_routing_spread.py), where real weights,
and kvserve's dummy ones, spread a step over ~125 of 128. A checkpoint on disk takes the fill out of the comparison:

    # GPU machine (64 GiB of disk: the fp8 Qwen3-30B-A3B shape is ~31 GB, bf16 would be ~61 GB)
    PYTHONPATH=. python3 benchmarks/write_random_checkpoint.py --shape qwen3-30b-a3b --fp8 --out /tmp/qwen3-moe-fp8

Weights are normal with std fan_in^-0.5 (each layer keeps its input's scale; the routers' logits spread over the
experts), norms 1. With --fp8 every decoder projection (attention, dense MLPs, experts) is e4m3 with one float32
scale per tensor, as HF fp8 / AutoFP8 checkpoints store them (`quant_method` fp8, dynamic activations); routers,
embedding, head and norms stay bf16, the routers listed in `ignored_layers` (vLLM would otherwise make them fp8).
Tensors are drawn on the GPU where there is one (the generator seeded once: the same checkpoint every run) and
written in shards of about 4 GB, with model.safetensors.index.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

SHARD_BYTES = 4 << 30


def shapes() -> dict:
    from benchmarks.gpu_moe import QWEN3_30B_A3B

    return {"qwen3-30b-a3b": QWEN3_30B_A3B}


def tensor_specs(cfg: dict):
    """(name, shape, quantizable) of every tensor of an HF Llama / Qwen3-MoE checkpoint, in file order."""
    h, heads, kv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    moe = cfg["model_type"] == "qwen3_moe"
    yield "model.embed_tokens.weight", (cfg["vocab_size"], h), False
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), False
        yield f"{p}.post_attention_layernorm.weight", (h,), False
        for name, shape in (("q_proj", (heads * d, h)), ("k_proj", (kv * d, h)), ("v_proj", (kv * d, h)),
                            ("o_proj", (h, heads * d))):
            yield f"{p}.self_attn.{name}.weight", shape, True
        if moe:
            yield f"{p}.self_attn.q_norm.weight", (d,), False
            yield f"{p}.self_attn.k_norm.weight", (d,), False
        sparse = moe and i not in cfg.get("mlp_only_layers", []) and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
        if sparse:
            inter = cfg["moe_intermediate_size"]
            yield f"{p}.mlp.gate.weight", (cfg["num_experts"], h), False
            for e in range(cfg["num_experts"]):
                yield f"{p}.mlp.experts.{e}.gate_proj.weight", (inter, h), True
                yield f"{p}.mlp.experts.{e}.up_proj.weight", (inter, h), True
                yield f"{p}.mlp.experts.{e}.down_proj.weight", (h, inter), True
        else:
            inter = cfg["intermediate_size"]
            yield f"{p}.mlp.gate_proj.weight", (inter, h), True
            yield f"{p}.mlp.up_proj.weight", (inter, h), True
            yield f"{p}.mlp.down_proj.weight", (h, inter), True
    yield "model.norm.weight", (h,), False
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", (cfg["vocab_size"], h), False


def draw(name: str, shape: tuple, quantize: bool, gen: torch.Generator, device: str) -> dict:
    """{checkpoint name: tensor} of one weight: bf16, or e4m3 and its per-tensor float32 weight_scale."""
    from kvserve.ops.fp8_e4m3 import quantize_per_token

    if name.endswith("norm.weight"):
        return {name: torch.ones(shape, dtype=torch.bfloat16)}
    w = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
    if not quantize:
        return {name: w.to(torch.bfloat16).cpu()}
    q, scale = quantize_per_token(w.reshape(1, -1))  # the whole tensor as one row: one scale
    return {name: q.reshape(shape).cpu(), name[: -len("weight")] + "weight_scale": scale.reshape(()).cpu()}


def write(cfg: dict, out: str, fp8: bool, device: str, seed: int = 0) -> str:
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    shard, shard_bytes, files, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            file = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, os.path.join(out, file), metadata={"format": "pt"})
            files.append(file)
            weight_map.update({k: file for k in shard})
            shard, shard_bytes = {}, 0

    ignored = []
    for name, shape, quantizable in tensor_specs(cfg):
        if name.endswith(".mlp.gate.weight"):
            ignored.append(name[: -len(".weight")])
        for key, t in draw(name, shape, fp8 and quantizable, gen, device).items():
            shard[key] = t
            shard_bytes += t.numel() * t.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    config = dict(cfg)
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "ignored_layers": ignored}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    total = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(shapes()), required=True)
    ap.add_argument("--fp8", action="store_true", help="e4m3 projections with per-tensor scales (HF fp8 format)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = write(shapes()[args.shape], args.out, args.fp8, device)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    print(f"wrote {out}: {size / 1e9:.1f} GB")


if __name__ == "__main__":
    main()
