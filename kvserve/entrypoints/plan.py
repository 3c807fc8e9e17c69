"""`kvserve plan MODEL [engine flags] [--gpu NAME | --gpu-memory-gib X] [--json]`: will it fit, and if not,
what to change. Reads config.json (and the checkpoint's headers), never the weights; needs no GPU. The
numbers come from memory_plan, the same arithmetic the engine sizes its KV cache with."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvserve.sizing import memory_plan
from kvserve.sizing.memory_plan import GiB

# Memory as torch.cuda.mem_get_info reports it (a little under the marketing number).
KNOWN_GPUS: dict[str, float] = {
    "H200": 139.8,
    "B200": 178.4,
    "H100-80GB": 79.2,
    "H100-94GB": 93.1,
    "A100-80GB": 79.2,
    "A100-40GB": 39.4,
    "L40S": 44.4,
    "L40": 44.4,
    "A10G": 22.1,
    "L4": 22.0,
    "RTX-4090": 23.6,
    "RTX-3090": 23.6,
    "A6000": 47.4,
}
_ALIASES = {"H100": "H100-80GB", "A100": "A100-80GB", "4090": "RTX-4090", "3090": "RTX-3090"}
# Engine fields plan reads itself (EngineArgs may reject values it cannot run yet, a plan can still size them).
_PLAN_ONLY = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "quantization": None,
              "kv_cache_dtype": "auto", "swap_space": 0, "preemption_mode": "recompute"}


def gpu_bytes(name: str) -> int:
    key = name.upper().replace(" ", "-").replace("_", "-")
    key = _ALIASES.get(key, key)
    for known, gib in KNOWN_GPUS.items():
        if known.upper() == key:
            return int(gib * GiB)
    raise ValueError(f"--gpu {name!r} is not a known GPU ({', '.join(KNOWN_GPUS)}); pass --gpu-memory-gib instead.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvserve.entrypoints.cli_args import add_engine_args

    p.add_argument("model", help="HF model directory (config.json is enough) or .gguf file.")
    add_engine_args(p)
    for short, dest in (("-tp", "tensor_parallel_size"), ("-pp", "pipeline_parallel_size")):
        if short not in p._option_string_actions:
            p.add_argument(short, dest=dest, type=int, default=argparse.SUPPRESS,
                           help=f"Same as --{dest.replace('_', '-')}.")
    g = p.add_argument_group("Plan options")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--gpu", default="H100-80GB", help=f"One of {', '.join(KNOWN_GPUS)} (default H100-80GB).")
    where.add_argument("--gpu-memory-gib", type=float, default=None, help="GPU memory in GiB, instead of --gpu.")
    g.add_argument("--others-gib", type=float, default=memory_plan.CUDA_CONTEXT_BYTES / GiB,
                   help="Memory held before the engine starts (CUDA context, other processes), in GiB.")
    g.add_argument("--json", action="store_true", help="Print the plan as JSON.")


def plan_inputs_from_namespace(ns: argparse.Namespace) -> memory_plan.PlanInputs:
    from kvserve.config import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {name: getattr(ns, name) for name in fields if hasattr(ns, name) and name not in _PLAN_ONLY}
    kwargs.update(model=ns.model, device="cuda")
    kwargs.update({k: v for k, v in _PLAN_ONLY.items() if k in fields})
    # Lengths, budgets and dtype exactly as the engine derives them.
    config = EngineArgs(**kwargs).create_engine_config(count_devices=False)
    quant = getattr(ns, "quantization", None)
    quant = None if quant in (None, "none") else quant
    if quant is not None and quant not in memory_plan.QUANTIZATIONS:
        raise ValueError(f"--quantization {quant!r}: plan knows {', '.join(memory_plan.QUANTIZATIONS)}.")
    total = int(ns.gpu_memory_gib * GiB) if ns.gpu_memory_gib is not None else gpu_bytes(ns.gpu)
    checkpoint = None
    if config.args.load_format != "dummy":
        tensors = memory_plan.checkpoint_tensors(config.model_path)
        if tensors:
            checkpoint = memory_plan.checkpoint_weight_bytes(
                tensors, memory_plan.DTYPE_BYTES[config.dtype], config.model_config.tie_word_embeddings)
    return memory_plan.PlanInputs(
        model_config=config.model_config, dtype=config.dtype, max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.args.max_num_seqs,
        block_size=config.args.block_size, gpu_memory_utilization=config.args.gpu_memory_utilization,
        kv_cache_dtype=getattr(ns, "kv_cache_dtype", "auto") or "auto",
        tensor_parallel_size=getattr(ns, "tensor_parallel_size", 1) or 1,
        pipeline_parallel_size=getattr(ns, "pipeline_parallel_size", 1) or 1,
        enable_expert_parallel=bool(getattr(ns, "enable_expert_parallel", False)),
        # --quantization asks how the model would fit so (computed); else the checkpoint's own format.
        **(dict(quantization=quant, quantized_at_load=True) if quant is not None
           else memory_plan.weights_format(config.quant_config)),
        enforce_eager=config.args.enforce_eager,
        kv_cache_memory_bytes=config.args.kv_cache_memory_bytes,
        num_gpu_blocks_override=config.args.num_gpu_blocks_override, total_gpu_bytes=total,
        others_bytes=int(ns.others_gib * GiB), checkpoint_weights=checkpoint,
        draft_model_config=config.draft_model_config,
    )


def format_plan(plan: memory_plan.MemoryPlan, verdict: memory_plan.Verdict, model: str, gpu: str) -> str:
    p = plan.inputs
    cfg = p.model_config
    kv_dtype = memory_plan.kv_cache_dtype_bytes(p.kv_cache_dtype, p.dtype)
    gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    lines = [
        f"Model: {model} ({cfg.architecture}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
        f"{cfg.num_key_value_heads} KV heads)",
        f"Settings: {p.dtype}, weights {p.quantization or 'unquantized'}, KV cache {p.kv_cache_dtype} "
        f"({kv_dtype} B/value), tp {p.tensor_parallel_size} x pp {p.pipeline_parallel_size}, max_model_len "
        f"{p.max_model_len}, max_num_seqs {p.max_num_seqs}, max_num_batched_tokens {p.max_num_batched_tokens}, "
        f"block_size {p.block_size}",
        f"GPU: {gpu}, {gib(p.total_gpu_bytes)} x {p.gpu_memory_utilization} = {gib(plan.budget)} for this engine, "
        f"{gib(p.others_bytes)} held by others",
    ]
    if cfg.num_experts:
        lines.append(f"Mixture of experts: {cfg.num_experts} experts, {cfg.num_experts_per_tok} per token, in "
                     f"{cfg.num_moe_layers} of {cfg.num_hidden_layers} layers"
                     + (", whole experts per GPU (expert parallel)" if p.enable_expert_parallel else "")
                     + f"; {cfg.num_params() / 1e9:.2f} B parameters, {cfg.num_active_params() / 1e9:.2f} B "
                       f"active per token")
    groups = cfg.kv_cache_groups
    if len(groups) > 1 or groups[0].window is not None:
        counts: dict = {}
        for g in groups:
            counts[g.window] = counts.get(g.window, 0) + 1
        kinds = [f"{n} {'full' if w is None else f'windowed ({w} tokens)'}" for w, n in counts.items()]
        lines.append(f"KV cache groups: {', '.join(kinds)}, up to {max(len(g.layers) for g in groups)} layers each "
                     f"(a block holds one group's layers; a windowed group frees blocks behind its window)")
    draft = p.draft_model_config
    if draft is not None:
        first = plan.ranks[0]
        lines.append(f"Draft model (speculative decoding): {draft.num_hidden_layers} layers, {draft.num_key_value_heads} "
                     f"KV heads; {gib(first.draft_weights)} of weights and {first.draft_kv_bytes_per_token:,} B of KV "
                     f"per token on each GPU, counted below")
    lines.append("")
    stages = plan.ranks
    header = ["per GPU"] + [f"stage {r.stage} ({r.layers} layers)" if len(stages) > 1 else "each GPU" for r in stages]
    rows = [
        ("weights", [gib(r.weights) + (f" ({plan.weights_source})" if i == 0 else "") for i, r in enumerate(stages)]),
        ("activation peak", [gib(r.activation_peak) for r in stages]),
        ("CUDA graph reserve", [gib(r.graph_reserve) for r in stages]),
        ("KV cache", [gib(max(r.kv_bytes, 0)) if r.kv_bytes > 0 else f"none ({gib(r.kv_bytes)})" for r in stages]),
        ("KV bytes per token", [f"{r.kv_bytes_per_token:,} B" for r in stages]),
    ]
    width = max(len(h) for h in header[1:] + [c for _, cells in rows for c in cells]) + 2
    out = [f"{header[0]:<26}" + "".join(f"{h:>{width}}" for h in header[1:])]
    out += [f"{name:<26}" + "".join(f"{c:>{width}}" for c in cells) for name, cells in rows]
    out += [
        f"{'KV blocks (each GPU)':<26}{max(plan.num_blocks, 0):>{width},}",
        f"{'KV tokens':<26}{plan.kv_tokens:>{width},}",
        f"{'max concurrency':<26}{plan.max_concurrency:>{width - 1}.2f}x  (requests of {p.max_model_len} tokens)",
    ]
    lines += out + ["", f"Verdict: {verdict.message}"]
    if verdict.flag:
        lines.append(f"Change: {verdict.suggestion}")
    lines += [f"Note: {n}" for n in verdict.notes]
    return "\n".join(lines)


def run(ns: argparse.Namespace) -> int:
    inputs = plan_inputs_from_namespace(ns)
    plan = memory_plan.make_plan(inputs)
    verdict = memory_plan.advise(inputs)
    gpu = f"{ns.gpu_memory_gib:g} GiB" if ns.gpu_memory_gib is not None else ns.gpu
    if ns.json:
        out = plan.to_dict()
        out.update(model=ns.model, gpu=gpu, total_gpu_bytes=inputs.total_gpu_bytes,
                   tensor_parallel_size=inputs.tensor_parallel_size,
                   pipeline_parallel_size=inputs.pipeline_parallel_size,
                   verdict={"step": verdict.step, "flag": verdict.flag, "value": verdict.value,
                            "message": verdict.message, "notes": verdict.notes})
        json.dump(out, sys.stdout, indent=2)
        print()
    else:
        print(format_plan(plan, verdict, ns.model, gpu))
    return 0
