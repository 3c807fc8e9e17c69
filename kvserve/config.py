"""EngineArgs: every engine setting, under vLLM's flag names and defaults, and what follows from them."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.model.model_config import ModelConfig
from kvserve.sizing.memory_plan import KV_CACHE_DTYPES

logger = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class EngineArgs:
    # Model
    model: str | None = field(default=None, metadata={"help": "HF model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct.", "group": "Model"})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer directory (default: the model's).", "group": "Model"})
    skip_tokenizer_init: bool = field(default=False, metadata={"help": "Do not load a tokenizer: prompts must be token ids and outputs are not detokenized.", "group": "Model"})
    served_model_name: str | None = field(default=None, metadata={"help": "Model name in the API (default: the model argument).", "group": "Model"})
    dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16 | float16. auto: float32 on CPU, the checkpoint's half type (bfloat16 for float32 checkpoints) on GPU.", "group": "Model"})
    max_model_len: int | None = field(default=None, metadata={"help": "Context length (prompt + output); default: the model's.", "group": "Model"})
    load_format: str = field(default="auto", metadata={"help": "auto | safetensors | gguf | dummy (random weights from the config).", "group": "Model"})
    seed: int = field(default=0, metadata={"help": "Random seed for requests without their own seed and for dummy weights.", "group": "Model"})
    quantization: str | None = field(default=None, metadata={"help": "Weight quantization: awq | gptq | fp8 | compressed-tensors. Default: what the checkpoint's config.json says; fp8 on an unquantized checkpoint quantizes it at load (W8A8).", "group": "Model"})
    max_logprobs: int = field(default=20, metadata={"help": "Most logprobs / top_logprobs / prompt_logprobs a request may ask for; -1: no limit (then -1, the whole vocabulary, is allowed).", "group": "Model"})
    max_n: int = field(default=128, metadata={"help": "Most samples (n) one request may ask for (OpenAI's limit is 128).", "group": "Model"})
    revision: str | None = field(default=None, metadata={"help": "Hub revision (branch, tag or commit) of a model given by repo id (default: main).", "group": "Model"})
    tokenizer_revision: str | None = field(default=None, metadata={"help": "Hub revision of the tokenizer when --tokenizer is a repo id.", "group": "Model"})
    download_dir: str | None = field(default=None, metadata={"help": "Hugging Face cache directory for hub models (default: $HF_HOME/hub).", "group": "Model"})
    hf_token: str | None = field(default=None, metadata={"help": "Hugging Face token for gated or private repos (default: $HF_TOKEN).", "group": "Model"})
    trust_remote_code: bool = field(default=False, metadata={"help": "Accepted for vLLM compatibility: kvserve runs no code from model repos, only its own model classes.", "group": "Model"})
    generation_config: str = field(default="auto", metadata={"help": "auto: sampling defaults from the model's generation_config.json; vllm: ignore it; or a folder holding a generation_config.json.", "group": "Model"})
    override_generation_config: str | None = field(default=None, metadata={"help": "JSON object of sampling defaults applied over the generation config, e.g. '{\"temperature\": 0.5}'.", "group": "Model"})
    structured_outputs_config: str | None = field(default=None, metadata={"help": "Structured outputs, as JSON: {\"backend\": \"auto\" | \"xgrammar\" | \"guidance\", \"disable_any_whitespace\": bool, \"disable_additional_properties\": bool} (auto: xgrammar, llguidance where xgrammar refuses the constraint).", "group": "Structured outputs"})
    reasoning_parser: str | None = field(default=None, metadata={"help": "deepseek_r1 | qwen3: the model thinks before it answers; the thinking is returned as reasoning_content and a structured-output constraint applies to the answer only.", "group": "Structured outputs"})
    # Cache
    block_size: int | None = field(default=None, metadata={"help": "Tokens per KV cache block. Default: 16; 64 where the Triton attention backend loads a long prefill's K/V tiles with TMA (CUDA, a 16-bit KV cache, heads wider than 128: Gemma 2/3).", "group": "Cache"})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "Fraction of GPU memory this engine may use (weights + activations + KV cache).", "group": "Cache"})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={"help": "KV cache size in bytes; overrides gpu_memory_utilization. On CPU the default is 2 GiB.", "group": "Cache"})
    num_gpu_blocks_override: int | None = field(default=None, metadata={"help": "Exact number of KV blocks (testing).", "group": "Cache"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "Reuse KV blocks of shared prompt prefixes.", "group": "Cache"})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "KV cache dtype: auto (= model dtype) | fp8 | fp8_e4m3 (e4m3 with per-tensor k/v scales: twice the tokens).", "group": "Cache"})
    calculate_kv_scales: bool = field(default=False, metadata={"help": "With --kv-cache-dtype fp8: compute k_scale/v_scale from the first batch instead of the checkpoint's (or 1.0).", "group": "Cache"})
    swap_space: float = field(default=0, metadata={"help": "CPU memory in GiB (pinned on CUDA) that holds the K/V of requests preempted with --preemption-mode swap or auto.", "group": "Cache"})
    # Scheduler
    max_num_seqs: int = field(default=256, metadata={"help": "Most requests in one step.", "group": "Scheduler"})
    max_num_batched_tokens: int | None = field(default=None, metadata={"help": "Token budget of one step (default 8192 with chunked prefill, else max_model_len).", "group": "Scheduler"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "Split long prompts across steps and mix them with decodes.", "group": "Scheduler"})
    preemption_mode: str = field(default="recompute", metadata={"help": "recompute | swap | auto: what happens to a preempted request's K/V. recompute drops it; swap copies it to --swap-space and back (recompute when that is full); auto picks the cheaper per request, from costs measured at start-up.", "group": "Scheduler"})
    async_scheduling: bool | None = field(default=None, metadata={"help": "Schedule and prepare step N+1 while step N runs, keeping sampled ids on the device (default: on for CUDA, off on CPU).", "group": "Scheduler"})
    # Device and execution
    device: str = field(default="auto", metadata={"help": "auto | cuda | cpu.", "group": "Execution"})
    attention_backend: str = field(default="auto", metadata={"help": "auto | torch | triton (auto: triton on CUDA, torch on CPU).", "group": "Execution"})
    enforce_eager: bool = field(default=False, metadata={"help": "Disable CUDA graphs.", "group": "Execution"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "Tensor parallel ranks: each layer's heads and features split over this many devices (CPU: processes).", "group": "Parallel", "aliases": ["-tp"]})
    pipeline_parallel_size: int = field(default=1, metadata={"help": "Pipeline stages: the layers split over this many device groups (layers per stage: even, or VLLM_PP_LAYER_PARTITION=\"a,b\").", "group": "Parallel", "aliases": ["-pp"]})
    distributed_executor_backend: str | None = field(default=None, metadata={"help": "uni (in this process) | mp (one process per device on this host) | ray (one Ray actor per device, any number of nodes). Default: uni for one device, mp for several.", "group": "Parallel"})
    pp_layer_partition: str | None = field(default=None, metadata={"help": "Decoder layers per pipeline stage, e.g. \"20,12\" (default: $KVSERVE_PP_LAYER_PARTITION or $VLLM_PP_LAYER_PARTITION, else even).", "group": "Parallel"})
    enable_expert_parallel: bool = field(default=False, metadata={"help": "MoE layers: place whole experts on the tensor-parallel ranks (each rank holds num_experts / tp of them) instead of splitting every expert's intermediate features over the ranks. Attention stays tensor-parallel.", "group": "Parallel", "aliases": ["-ep"]})
    disable_custom_all_reduce: bool = field(default=False, metadata={"help": "Accepted for vLLM compatibility: kvserve's all-reduce is torch.distributed's (NCCL on GPU, gloo on CPU).", "group": "Parallel"})
    # Speculative decoding
    speculative_config: str | dict | None = field(default=None, metadata={"help": "Speculative decoding, as a JSON object in vLLM's keys, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'. Methods: ngram (prompt lookup), draft_model (\"model\": a smaller model with the same tokenizer), eagle3 (\"model\": an EAGLE-3 head).", "group": "Speculative decoding", "aliases": ["-sc"]})

    def __post_init__(self):
        self._validate_static()

    def _validate_static(self) -> None:
        def bad(flag: str, msg: str):
            raise ValueError(f"--{flag.replace('_', '-')}: {msg}")

        if self.dtype not in _DTYPES:
            bad("dtype", f"{self.dtype!r} is not one of {', '.join(_DTYPES)}.")
        if self.load_format not in _LOAD_FORMATS:
            bad("load_format", f"{self.load_format!r} is not one of {', '.join(_LOAD_FORMATS)}.")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            bad("attention_backend", f"{self.attention_backend!r} is not one of {', '.join(_ATTENTION_BACKENDS)}.")
        if self.block_size is not None and (
                self.block_size <= 0 or self.block_size & (self.block_size - 1) or self.block_size > 256):
            bad("block_size", f"must be a power of two between 1 and 256, got {self.block_size}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.max_logprobs < -1:
            bad("max_logprobs", f"must be -1 (no limit) or >= 0, got {self.max_logprobs}.")
        if self.max_n < 1:
            bad("max_n", f"must be >= 1, got {self.max_n}.")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad("max_model_len", f"must be >= 1, got {self.max_model_len}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            bad("num_gpu_blocks_override", f"must be >= 1, got {self.num_gpu_blocks_override}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            bad("kv_cache_memory_bytes", f"must be >= 1, got {self.kv_cache_memory_bytes}.")
        if self.tensor_parallel_size < 1:
            bad("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}.")
        if self.pipeline_parallel_size < 1:
            bad("pipeline_parallel_size", f"must be >= 1, got {self.pipeline_parallel_size}.")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            bad("distributed_executor_backend", f"{self.distributed_executor_backend!r} is not one of uni, mp, ray.")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            bad("distributed_executor_backend", f"uni runs one device in this process; --tensor-parallel-size "
                f"{self.tensor_parallel_size} x --pipeline-parallel-size {self.pipeline_parallel_size} needs mp or ray.")
        from kvserve.model.quantization import normalize_method

        normalize_method(self.quantization)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"{self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}.")
        if self.swap_space is None or self.swap_space < 0:
            bad("swap_space", f"must be >= 0 GiB, got {self.swap_space}.")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            bad("preemption_mode", f"{self.preemption_mode!r} is not one of recompute, swap, auto.")
        if self.preemption_mode != "recompute" and not self.swap_space:
            bad("preemption_mode", f"{self.preemption_mode} needs CPU memory to swap to: add --swap-space 4 "
                                   f"(GiB), or use --preemption-mode recompute.")
        from kvserve.structured_output.compiler import StructuredOutputsConfig
        from kvserve.structured_output.reasoning import REASONING_PARSERS

        StructuredOutputsConfig.from_json(self.structured_outputs_config)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            bad("reasoning_parser", f"{self.reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}.")
        if self.device not in ("auto", "cuda", "cpu"):
            bad("device", f"{self.device!r} is not one of auto, cuda, cpu.")
        from kvserve.speculative_config import check_runnable, parse_speculative_config

        # Parsed once, here: from now on the field holds a SpeculativeConfig (or None).
        self.speculative_config = parse_speculative_config(self.speculative_config, self.tensor_parallel_size)
        check_runnable(self.speculative_config)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """Unless chosen: uni for one device; for several, ray when a Ray cluster is given (RAY_ADDRESS, or
        Ray already initialized in this process), else mp (processes on this host)."""
        if self.distributed_executor_backend:
            return self.distributed_executor_backend
        if self.world_size == 1:
            return "uni"
        import sys

        ray = sys.modules.get("ray")
        return "ray" if os.environ.get("RAY_ADDRESS") or (ray is not None and ray.is_initialized()) else "mp"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def create_engine_config(self, count_devices: bool = True) -> "EngineConfig":
        """`count_devices=False` resolves the config for a machine other than this one (`kvserve plan`)."""
        return EngineConfig.from_args(self, count_devices)


@dataclass
class EngineConfig:
    """EngineArgs resolved against the model: concrete paths, lengths, dtype and device."""

    args: EngineArgs
    model_path: Path
    tokenizer_path: Path
    served_model_name: str
    model_config: ModelConfig
    max_model_len: int
    max_num_batched_tokens: int
    device: str
    dtype: str  # float32 | bfloat16 | float16
    attention_backend: str
    async_scheduling: bool
    layer_ranges: list = field(default_factory=list)  # [(first, end)] decoder layers per pipeline stage
    quant_config: object = None  # kvserve.model.quantization.QuantizationConfig, or None
    kv_cache_dtype: str = "auto"  # the KV cache's storage: "auto" (= dtype) or "fp8_e4m3"
    # Sampling defaults from the model's generation_config.json (vLLM's --generation-config auto): applied to
    # requests that leave these fields unset. Keys are SamplingParams names; max_tokens caps unset max_tokens.
    default_sampling: dict = field(default_factory=dict)
    # --speculative-config with a draft model or an EAGLE-3 head: its files and shapes (None otherwise; for a
    # head, its decoder layer's).
    draft_model_path: Path | None = None
    draft_model_config: ModelConfig | None = None

    @classmethod
    def from_args(cls, args: EngineArgs, count_devices: bool = True) -> "EngineConfig":
        from kvserve.model.default_model import DEFAULT_MODEL_NAME, find_default_gguf
        from kvserve.model.generation_config import default_sampling_fields
        from kvserve.model.hub import resolve_model_files
        from kvserve.model.model_config import load_hf_config_dict
        from kvserve.model.quantization import resolve_quant_config

        if args.model is None:
            model_path = find_default_gguf()
            default_name = DEFAULT_MODEL_NAME
        else:
            model_path = resolve_model_files(args.model, revision=args.revision, download_dir=args.download_dir,
                                             token=args.hf_token)
            default_name = args.model
        model_config = ModelConfig.from_path(model_path, trust_remote_code=args.trust_remote_code)
        quant_config = resolve_quant_config(args.quantization, load_hf_config_dict(model_path),
                                            is_gguf=model_path.suffix == ".gguf")
        device = args.device
        if device == "auto":
            device = "cuda" if _cuda_available() else "cpu"
        dtype = _resolve_dtype(args.dtype, model_config.torch_dtype, device)

        # Windowed layers attend to their window at any length: the limit is the model's positions.
        model_max = model_config.max_position_embeddings
        max_model_len = args.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(
                f"--max-model-len {max_model_len} is larger than the model's maximum context "
                f"({model_max}: max_position_embeddings). Use --max-model-len {model_max} or less."
            )
        if args.max_num_batched_tokens is not None:
            budget = args.max_num_batched_tokens
        else:
            budget = max(8192, args.max_num_seqs) if args.enable_chunked_prefill else max(max_model_len, args.max_num_seqs)
        if not args.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"--max-num-batched-tokens ({budget}) is smaller than --max-model-len ({max_model_len}) "
                f"with chunked prefill off, so long prompts could never be scheduled. Raise "
                f"--max-num-batched-tokens, lower --max-model-len, or pass --enable-chunked-prefill."
            )
        if budget < args.max_num_seqs:
            raise ValueError(
                f"--max-num-batched-tokens ({budget}) must be >= --max-num-seqs ({args.max_num_seqs}): "
                f"each running request needs at least one token per step."
            )
        backend = args.attention_backend
        if model_config.uses_mla:  # latent attention is computed in torch only (kvserve/ops/mla_attention.py)
            if backend == "triton":
                raise ValueError(f"--attention-backend triton: {model_config.architecture}'s multi-head latent "
                                 f"attention runs on the torch backend only; use --attention-backend auto or torch.")
            backend = "torch"
        elif backend == "auto":
            backend = "triton" if device == "cuda" else "torch"
        if args.block_size is None:
            args = dataclasses.replace(args, block_size=default_block_size(
                device, backend, dtype, args.kv_cache_dtype, model_config.head_dim))
        tokenizer_path = model_path
        if args.tokenizer:
            tokenizer_path = resolve_model_files(args.tokenizer, revision=args.tokenizer_revision,
                                                 download_dir=args.download_dir, token=args.hf_token, what="Tokenizer")
        layer_ranges = _check_parallel_layout(args, model_config, device, count_devices)
        draft_model_path, draft_model_config = _resolve_draft_model(args, model_config, max_model_len)
        # One line per resolution: `kvserve serve` resolves once, in the process that parsed the command line.
        logger.info("Engine config resolved (pid %d): %s, max_model_len %d, %s", os.getpid(), model_path,
                    max_model_len, device)
        return cls(
            draft_model_path=draft_model_path,
            draft_model_config=draft_model_config,
            layer_ranges=layer_ranges,
            args=args,
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            served_model_name=args.served_model_name or default_name,
            model_config=model_config,
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            device=device,
            dtype=dtype,
            attention_backend=backend,
            # Pipeline parallelism keeps several batches in flight instead, each request in at most one.
            async_scheduling=args.pipeline_parallel_size == 1 and (
                device == "cuda" if args.async_scheduling is None else args.async_scheduling),
            quant_config=quant_config,
            kv_cache_dtype="auto" if args.kv_cache_dtype == "auto" else "fp8_e4m3",
            default_sampling=default_sampling_fields(model_path, args.generation_config,
                                                     args.override_generation_config),
        )


def _resolve_draft_model(args: EngineArgs, target: ModelConfig, max_model_len: int
                         ) -> tuple[Path | None, ModelConfig | None]:
    """A draft model's (or EAGLE-3 head's) files and config, checked against the target: the same
    vocabulary (drafts are the target's token ids), the target's tensor-parallel split, one pipeline
    stage. For a head the config is its decoder layer's (what the memory plan sizes)."""
    spec = args.speculative_config
    if spec is None or spec.method not in ("draft_model", "eagle3"):
        return None, None
    from kvserve.model.hub import resolve_model_files
    from kvserve.model.model_config import load_hf_config_dict

    what = "EAGLE-3 head" if spec.method == "eagle3" else "Draft model"
    path = resolve_model_files(spec.model, download_dir=args.download_dir, token=args.hf_token, what=what)
    if spec.method == "eagle3":
        from kvserve.model.eagle3 import Eagle3Config

        try:
            head = Eagle3Config.from_hf_dict(load_hf_config_dict(path), target)
        except ValueError as e:
            raise ValueError(f"--speculative-config: {spec.model}: {e}.") from None
        # What the memory plan sizes: its one layer, and an LM head over its reduced vocabulary (the token
        # embedding is the target's).
        cfg = dataclasses.replace(head.layer, vocab_size=head.draft_vocab_size, tie_word_embeddings=True)
    else:
        cfg = ModelConfig.from_path(path, trust_remote_code=args.trust_remote_code)
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"--speculative-config: the draft model {spec.model} has a vocabulary of "
                             f"{cfg.vocab_size} tokens and the target {target.vocab_size}; a draft model must share "
                             f"the target's tokenizer (its drafts are the target's token ids). Use a draft of the "
                             f"same family, or \"method\": \"ngram\".")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"--speculative-config: the draft model {spec.model} handles "
                             f"{cfg.max_position_embeddings} positions, fewer than --max-model-len {max_model_len}; "
                             f"lower --max-model-len to {cfg.max_position_embeddings} or use a draft with a longer "
                             f"context.")
    if args.pipeline_parallel_size > 1:
        raise ValueError(f"--speculative-config: a {what.lower()} runs with --pipeline-parallel-size 1 only; use "
                         f"tensor parallelism, or \"method\": \"ngram\".")
    # Its K/V lives in the blocks of the target's first block table: only one that keeps every block will do.
    for model, groups in (("target", target.kv_cache_groups), (what.lower(), cfg.kv_cache_groups)):
        if len(groups) > 1 or groups[0].window is not None:
            raise ValueError(f"--speculative-config: a {what.lower()} with a {model} whose KV cache frees blocks "
                             f"behind a sliding window (windowed or interleaved layers) is not supported yet; use "
                             f"\"method\": \"ngram\".")
    misfit = _tensor_parallel_misfit(cfg, args.tensor_parallel_size)
    if misfit:
        raise ValueError(f"--speculative-config: the {what.lower()} is split like the target, and cannot be: "
                         f"{misfit} (its config; --tensor-parallel-size {args.tensor_parallel_size}). Choose one "
                         f"whose heads split {args.tensor_parallel_size} ways.")
    return path, cfg


def _check_parallel_layout(args: EngineArgs, cfg: ModelConfig, device: str,
                           count_devices: bool = True) -> list[tuple[int, int]]:
    """Impossible layouts fail here, before any process starts, naming the numbers and the flag."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    misfit = _tensor_parallel_misfit(cfg, tp)
    if misfit:
        fitting = [n for n in range(1, cfg.num_attention_heads + 1) if not _tensor_parallel_misfit(cfg, n)]
        raise ValueError(f"{misfit}, so --tensor-parallel-size {tp} cannot split this model. Sizes that fit "
                         f"every rule (attention heads, KV heads, vocabulary): {', '.join(map(str, fitting))}.")
    if pp > cfg.num_hidden_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} is larger than the model's {cfg.num_hidden_layers} layers; "
                         f"use --pipeline-parallel-size {cfg.num_hidden_layers} or less.")
    from kvserve.distributed.layer_partition import layer_partition

    # Decided here, once: every worker gets the same ranges (a malformed partition fails now).
    layer_ranges = layer_partition(cfg.num_hidden_layers, pp, args.pp_layer_partition)
    if count_devices and device == "cuda" and args.executor_backend != "ray":
        import torch

        if torch.version.cuda is None and torch.version.hip is None:
            raise ValueError(f"--device cuda, but this torch ({torch.__version__}) is built without CUDA. Install a "
                             f"CUDA build of torch (README: Install, GPU machine), or use --device cpu.")
        visible = torch.cuda.device_count()
        if tp * pp > visible:
            raise ValueError(f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} = {tp * pp} GPUs, but "
                             f"only {visible} are visible on this host (CUDA_VISIBLE_DEVICES). Lower the sizes, or "
                             f"use --distributed-executor-backend ray on a cluster with more GPUs.")
    return layer_ranges


def _tensor_parallel_misfit(cfg: ModelConfig, tp: int) -> str | None:
    """Why `tp` ranks cannot split this model, or None: every rule, so advice can name sizes that pass all."""
    if cfg.num_attention_heads % tp:
        return f"The model's {cfg.num_attention_heads} attention heads are not divisible by {tp}"
    kv = cfg.num_key_value_heads
    if (kv % tp) if tp <= kv else (tp % kv):
        return (f"The model's {kv} KV heads and {tp} ranks do not fit: one must divide the other (KV heads are "
                f"split, or replicated when there are fewer than ranks)")
    if cfg.vocab_size % tp:
        return f"The vocabulary ({cfg.vocab_size} tokens) is not divisible by {tp}"
    return None


DEFAULT_BLOCK_SIZE = 16


def default_block_size(device: str, attention_backend: str, dtype: str, kv_cache_dtype: str, head_dim: int) -> int:
    """--block-size when it is not given: what the Triton backend prefers for this cache on a GPU
    (TritonAttentionLaunch.preferred_block_size), else DEFAULT_BLOCK_SIZE."""
    if device == "cuda" and attention_backend == "triton" and kv_cache_dtype == "auto":
        try:  # the backend's class, with whatever a benchmark set on it
            from kvserve.ops.triton_attention import TritonAttentionBackend as launch
        except ImportError:  # no triton here (`kvserve plan` on a laptop): the same settings, read without it
            from kvserve.ops.triton_attention_launch import TritonAttentionLaunch as launch
        return launch.preferred_block_size(head_dim, dtype) or DEFAULT_BLOCK_SIZE
    return DEFAULT_BLOCK_SIZE


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _resolve_dtype(requested: str, checkpoint_dtype: str, device: str) -> str:
    aliases = {"float": "float32", "half": "float16"}
    requested = aliases.get(requested, requested)
    if requested != "auto":
        return requested
    if device == "cpu":
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"
