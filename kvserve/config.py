"""EngineArgs: every engine setting, under vLLM's flag names and defaults, and what follows from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.model.model_config import ModelConfig

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
    quantization: str | None = field(default=None, metadata={"help": "Weight quantization (none supported yet).", "group": "Model"})
    revision: str | None = field(default=None, metadata={"help": "Hub revision (branch, tag or commit) of a model given by repo id (default: main).", "group": "Model"})
    tokenizer_revision: str | None = field(default=None, metadata={"help": "Hub revision of the tokenizer when --tokenizer is a repo id.", "group": "Model"})
    download_dir: str | None = field(default=None, metadata={"help": "Hugging Face cache directory for hub models (default: $HF_HOME/hub).", "group": "Model"})
    hf_token: str | None = field(default=None, metadata={"help": "Hugging Face token for gated or private repos (default: $HF_TOKEN).", "group": "Model"})
    trust_remote_code: bool = field(default=False, metadata={"help": "Accepted for vLLM compatibility: kvserve runs no code from model repos, only its own model classes.", "group": "Model"})
    generation_config: str = field(default="auto", metadata={"help": "auto: sampling defaults from the model's generation_config.json; vllm: ignore it; or a folder holding a generation_config.json.", "group": "Model"})
    override_generation_config: str | None = field(default=None, metadata={"help": "JSON object of sampling defaults applied over the generation config, e.g. '{\"temperature\": 0.5}'.", "group": "Model"})
    # Cache
    block_size: int = field(default=16, metadata={"help": "Tokens per KV cache block.", "group": "Cache"})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "Fraction of GPU memory this engine may use (weights + activations + KV cache).", "group": "Cache"})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={"help": "KV cache size in bytes; overrides gpu_memory_utilization. On CPU the default is 2 GiB.", "group": "Cache"})
    num_gpu_blocks_override: int | None = field(default=None, metadata={"help": "Exact number of KV blocks (testing).", "group": "Cache"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "Reuse KV blocks of shared prompt prefixes.", "group": "Cache"})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "KV cache dtype (auto = model dtype).", "group": "Cache"})
    swap_space: float = field(default=0, metadata={"help": "CPU swap space in GiB for preempted requests (not yet supported; preemption recomputes).", "group": "Cache"})
    # Scheduler
    max_num_seqs: int = field(default=256, metadata={"help": "Most requests in one step.", "group": "Scheduler"})
    max_num_batched_tokens: int | None = field(default=None, metadata={"help": "Token budget of one step (default 8192 with chunked prefill, else max_model_len).", "group": "Scheduler"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "Split long prompts across steps and mix them with decodes.", "group": "Scheduler"})
    async_scheduling: bool | None = field(default=None, metadata={"help": "Schedule and prepare step N+1 while step N runs, keeping sampled ids on the device (default: on for CUDA, off on CPU).", "group": "Scheduler"})
    # Device and execution
    device: str = field(default="auto", metadata={"help": "auto | cuda | cpu.", "group": "Execution"})
    attention_backend: str = field(default="auto", metadata={"help": "auto | torch | triton (auto: triton on CUDA, torch on CPU).", "group": "Execution"})
    enforce_eager: bool = field(default=False, metadata={"help": "Disable CUDA graphs.", "group": "Execution"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "Tensor parallel ranks (only 1 for now).", "group": "Execution"})
    pipeline_parallel_size: int = field(default=1, metadata={"help": "Pipeline stages (only 1 for now).", "group": "Execution"})

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
        if self.block_size <= 0 or self.block_size & (self.block_size - 1) or self.block_size > 256:
            bad("block_size", f"must be a power of two between 1 and 256, got {self.block_size}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}.")
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
        if self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1:
            bad("tensor_parallel_size", "tensor and pipeline parallelism are not implemented yet; use 1.")
        if self.quantization not in (None, "none"):
            bad("quantization", f"{self.quantization!r} is not supported yet; leave it unset.")
        if self.kv_cache_dtype not in ("auto",):
            bad("kv_cache_dtype", f"{self.kv_cache_dtype!r} is not supported yet; use auto.")
        if self.swap_space not in (0, 0.0, None):
            bad("swap_space", "swap preemption is not implemented yet; preemption recomputes. Use 0.")
        if self.device not in ("auto", "cuda", "cpu"):
            bad("device", f"{self.device!r} is not one of auto, cuda, cpu.")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def create_engine_config(self) -> "EngineConfig":
        return EngineConfig.from_args(self)


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
    # Sampling defaults from the model's generation_config.json (vLLM's --generation-config auto): applied to
    # requests that leave these fields unset. Keys are SamplingParams names; max_tokens caps unset max_tokens.
    default_sampling: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: EngineArgs) -> "EngineConfig":
        from kvserve.model.default_model import DEFAULT_MODEL_NAME, find_default_gguf

        from kvserve.model.generation_config import default_sampling_fields
        from kvserve.model.hub import resolve_model_files

        if args.model is None:
            model_path = find_default_gguf()
            default_name = DEFAULT_MODEL_NAME
        else:
            model_path = resolve_model_files(args.model, revision=args.revision, download_dir=args.download_dir,
                                             token=args.hf_token)
            default_name = args.model
        model_config = ModelConfig.from_path(model_path, trust_remote_code=args.trust_remote_code)
        device = args.device
        if device == "auto":
            device = "cuda" if _cuda_available() else "cpu"
        dtype = _resolve_dtype(args.dtype, model_config.torch_dtype, device)

        model_max = model_config.max_position_embeddings
        if model_config.sliding_window:
            # Sliding-window attention is not implemented: stay inside the window, where it is exact.
            model_max = min(model_max, model_config.sliding_window)
        max_model_len = args.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(
                f"--max-model-len {max_model_len} is larger than the model's maximum context "
                f"({model_max}: max_position_embeddings, or the sliding window, which kvserve does not "
                f"implement yet). Use --max-model-len {model_max} or less."
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
        if backend == "auto":
            backend = "triton" if device == "cuda" else "torch"
        tokenizer_path = model_path
        if args.tokenizer:
            tokenizer_path = resolve_model_files(args.tokenizer, revision=args.tokenizer_revision,
                                                 download_dir=args.download_dir, token=args.hf_token, what="Tokenizer")
        return cls(
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
            async_scheduling=device == "cuda" if args.async_scheduling is None else args.async_scheduling,
            default_sampling=default_sampling_fields(model_path, args.generation_config,
                                                     args.override_generation_config),
        )


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
