"""Every flag of vLLM 0.26.0's `vllm serve` gets an answer from `kvserve serve`, never argparse's bare
"unrecognized arguments".

A flag our real parser defines is implemented, and this table is never consulted for it: so when a flag
is built (a new EngineArgs field or server option), it leaves this table by itself; deleting its line
here is tidying, not a requirement. For every other vLLM flag the table says one of:
  - IGNORED: accepted, with a one-line warning that it has no effect here (tuning knobs, GPU kernels,
    logging): the outputs are the same with and without it;
  - REFUSED: an error that says why and what to use instead (the flag would change what the server
    does or returns, so ignoring it would mislead). A flag given its neutral value (NEUTRAL, e.g.
    `--data-parallel-size 1`) or a boolean turned off (`--no-enable-lora`) is accepted silently.
The kind of value each flag takes (ARITY) is vLLM's, so an unknown flag's value is consumed with it and
never mistaken for the model name.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger("kvserve.flags")

VLLM_VERSION = "0.26.0"

# ---- the kind of value each flag takes on vLLM's command line (everything else takes one value) ----------
BOOL = "bool"  # --x / --no-x
FLAG = "flag"  # --x only
MULTI = "multi"  # --x A [B ...]
VALUE = "value"
_BOOLS = """allow-credentials allow-deprecated-quantization async-scheduling calculate-kv-scales cudagraph-metrics
data-parallel-external-lb data-parallel-hybrid-lb disable-cascade-attn disable-chunked-mm-input
disable-custom-all-reduce disable-fastapi-docs disable-hybrid-kv-cache-manager disable-nccl-for-dp-synchronization
disable-sliding-window disable-uvicorn-access-log enable-auto-tool-choice enable-bf16x3-router-gemm
enable-chunked-prefill enable-cumem-allocator enable-dbo enable-elastic-ep enable-ep-weight-filter enable-eplb
enable-expert-parallel enable-flash-late-interaction enable-flashinfer-autotune enable-force-include-usage
enable-layerwise-nvtx-tracing enable-log-deltas enable-log-outputs enable-log-requests
enable-logging-iteration-details enable-lora enable-mamba-cache-stochastic-rounding enable-mfu-metrics
enable-mixed-moe-lora-format enable-mm-embeds enable-mm-processor-stats enable-moe-shared-loras enable-offline-docs
enable-per-request-metrics enable-prefix-caching enable-prompt-embeds enable-prompt-tokens-details
enable-request-id-headers enable-return-routed-experts enable-server-load-tracking enable-sleep-mode
enable-ssl-refresh enable-tokenizer-info-endpoint enable-tower-connector-lora enforce-eager
exclude-tools-when-tool-choice-none fail-on-environ-validation fully-sharded-loras interleave-mm-strings
jit-monitor-verbose kv-cache-metrics kv-sharing-fast-prefill language-model-only log-error-stack mm-encoder-only
numa-bind ray-workers-use-nsight return-tokens-as-token-ids scheduler-reserve-full-isl skip-mm-profiling
skip-tokenizer-init specialize-active-lora tokens-only trust-remote-code trust-request-chat-template
use-fp64-gumbel use-tqdm-on-load"""
_FLAGS = "aggregate-engine-logging data-parallel-multi-port-external-lb disable-log-stats grpc headless"
_MULTIS = """allowed-media-domains api-key collect-detailed-traces cpu-offload-params cudagraph-capture-sizes
ignore-patterns kv-cache-dtype-skip-layers logits-processors lora-modules lora-target-modules numa-bind-cpus
numa-bind-nodes offload-params served-model-name"""
ARITY = {**{"--" + n: BOOL for n in _BOOLS.split()}, **{"--" + n: FLAG for n in _FLAGS.split()},
         **{"--" + n: MULTI for n in _MULTIS.split()}}

# vLLM's short aliases. An alias of a flag our parser defines becomes an alias of ours.
ALIASES = {
    "-ac": "--attention-config", "-asc": "--api-server-count", "-cc": "--compilation-config",
    "-dc": "--diffusion-config", "-dcp": "--decode-context-parallel-size", "-dp": "--data-parallel-size",
    "-dpa": "--data-parallel-address", "-dpb": "--data-parallel-backend", "-dpe": "--data-parallel-external-lb",
    "-dph": "--data-parallel-hybrid-lb", "-dpl": "--data-parallel-size-local",
    "-dpm": "--data-parallel-multi-port-external-lb", "-dpn": "--data-parallel-rank",
    "-dpp": "--data-parallel-rpc-port", "-dpr": "--data-parallel-start-rank", "-ep": "--enable-expert-parallel",
    "-n": "--nnodes", "-pcp": "--prefill-context-parallel-size", "-pp": "--pipeline-parallel-size",
    "-q": "--quantization", "-r": "--node-rank", "-sc": "--speculative-config", "-tp": "--tensor-parallel-size",
}

# ---- reasons, shared by many flags ------------------------------------------------------------------------
_KERNELS = "a vLLM kernel, compilation or memory-allocator setting; kvserve picks its own kernels and CUDA graphs (--enforce-eager turns graphs off)"
_TUNING = "a vLLM scheduling or loading tuning knob; kvserve's scheduler and loader do not have it"
_OBSERVE = "a vLLM logging, metrics or tracing setting; kvserve logs stats every 10 s and exports /metrics"
_HTTP = "a vLLM HTTP front-end setting kvserve does not have (no CORS, docs or access-log options)"
_MULTIMODAL = "multimodal inputs: kvserve serves text-only models"
_MOE = "a mixture-of-experts tuning or load-balancing setting kvserve does not have (its MoE layers place experts with --enable-expert-parallel)"
_LORA_OPT = "a LoRA setting, and kvserve has no LoRA adapters"
_DP = "data parallelism is not supported: run one kvserve server per GPU (or group) behind a load balancer"
_MULTINODE = "multi-node serving is not supported: kvserve runs on one machine"
_CP = "context parallelism is not supported"
_SPEC = "give speculative decoding as one JSON object: --speculative-config '{\"method\": ..., \"num_speculative_tokens\": ...}'"
_TOOLS = "tool calling is not supported yet; remove the flag (requests with tools get a 400)"
_REASONING = "reasoning parsers are not supported yet; the reasoning text stays in the message content"
_TLS = "TLS is not built in: put a TLS-terminating proxy (nginx, caddy, a cloud load balancer) in front of kvserve"
_PLUGIN = "kvserve loads no plugins or custom classes"

IGNORED: dict[str, str] = {
    "--additional-config": "vLLM platform-specific extra config; kvserve has none",
    "--aggregate-engine-logging": _OBSERVE,
    "--all2all-backend": _MOE,
    "--allow-credentials": _HTTP,
    "--allow-deprecated-quantization": "no deprecated quantization methods exist in kvserve",
    "--allowed-headers": _HTTP,
    "--allowed-local-media-path": _MULTIMODAL,
    "--allowed-media-domains": _MULTIMODAL,
    "--allowed-methods": _HTTP,
    "--allowed-origins": _HTTP,
    "--api-server-count": "kvserve runs one API server process",
    "--attention-config": _KERNELS,
    "--code-revision": "kvserve runs no code from model repositories",
    "--collect-detailed-traces": _OBSERVE,
    "--compilation-config": _KERNELS,
    "--config-format": "kvserve reads the HF config.json (or GGUF metadata)",
    "--cp-kv-cache-interleave-size": _CP,
    "--cpu-distributed-timeout-seconds": "kvserve runs one process group on one machine",
    "--cpu-offload-params": "weight offloading is off (--cpu-offload-gb is not supported)",
    "--cudagraph-capture-sizes": _KERNELS,
    "--cudagraph-metrics": _OBSERVE,
    "--data-parallel-address": _DP,
    "--data-parallel-backend": _DP,
    "--data-parallel-external-lb": _DP,
    "--data-parallel-hybrid-lb": _DP,
    "--data-parallel-multi-port-external-lb": _DP,
    "--data-parallel-rpc-port": _DP,
    "--data-parallel-size-local": _DP,
    "--data-parallel-start-rank": _DP,
    "--data-parallel-supervisor-port": _DP,
    "--dbo-decode-token-threshold": _KERNELS,
    "--dbo-prefill-token-threshold": _KERNELS,
    "--dcp-comm-backend": _CP,
    "--dcp-kv-cache-interleave-size": _CP,
    "--disable-access-log-for-endpoints": _HTTP,
    "--disable-cascade-attn": _KERNELS,
    "--disable-chunked-mm-input": _MULTIMODAL,
    "--disable-fastapi-docs": _HTTP,
    "--disable-hybrid-kv-cache-manager": "kvserve has one KV cache manager for every layer",
    "--disable-nccl-for-dp-synchronization": _DP,
    "--disable-sliding-window": ("kvserve runs windowed layers with their window at every length; prompts "
                                 "within the window get the same tokens either way"),
    "--disable-uvicorn-access-log": _HTTP,
    "--distributed-timeout-seconds": "kvserve runs one process group on one machine",
    "--dp-supervisor-probe-failure-threshold": _DP,
    "--dp-supervisor-probe-interval-s": _DP,
    "--dp-supervisor-probe-timeout-s": _DP,
    "--enable-bf16x3-router-gemm": _MOE,
    "--enable-cumem-allocator": _KERNELS,
    "--enable-dbo": _KERNELS,
    "--enable-elastic-ep": _MOE,
    "--enable-ep-weight-filter": _MOE,
    "--enable-eplb": _MOE,
    "--enable-flash-late-interaction": _KERNELS,
    "--enable-flashinfer-autotune": _KERNELS,
    "--enable-layerwise-nvtx-tracing": _OBSERVE,
    "--enable-log-deltas": _OBSERVE,
    "--enable-log-outputs": _OBSERVE,
    "--enable-logging-iteration-details": _OBSERVE,
    "--enable-mamba-cache-stochastic-rounding": "kvserve has no Mamba models",
    "--enable-mfu-metrics": _OBSERVE,
    "--enable-mixed-moe-lora-format": _LORA_OPT,
    "--enable-mm-processor-stats": _MULTIMODAL,
    "--enable-moe-shared-loras": _LORA_OPT,
    "--enable-offline-docs": _HTTP,
    "--enable-per-request-metrics": _OBSERVE,
    "--enable-prompt-tokens-details": "usage has no prompt_tokens_details in kvserve",
    "--enable-request-id-headers": _HTTP,
    "--enable-return-routed-experts": _MOE,
    "--enable-server-load-tracking": _OBSERVE,
    "--enable-ssl-refresh": _TLS,
    "--enable-tower-connector-lora": _LORA_OPT,
    "--eplb-config": _MOE,
    "--exclude-tools-when-tool-choice-none": _TOOLS,
    "--expert-placement-strategy": _MOE,
    "--fail-on-environ-validation": "kvserve does not validate VLLM_* environment variables",
    "--fingerprint-mode": _OBSERVE,
    "--fingerprint-value": _OBSERVE,
    "--fully-sharded-loras": _LORA_OPT,
    "--gdn-prefill-backend": _KERNELS,
    "--h11-max-header-count": _HTTP,
    "--h11-max-incomplete-event-size": _HTTP,
    "--ignore-patterns": "kvserve fetches only config, tokenizer and safetensors files from the hub",
    "--interleave-mm-strings": _MULTIMODAL,
    "--ir-op-priority": _KERNELS,
    "--jit-monitor-mode": _KERNELS,
    "--jit-monitor-verbose": _KERNELS,
    "--kernel-config": _KERNELS,
    "--kv-cache-dtype-skip-layers": "every layer's KV cache has the --kv-cache-dtype dtype",
    "--kv-cache-metrics": _OBSERVE,
    "--kv-cache-metrics-sample": _OBSERVE,
    "--kv-events-config": _OBSERVE,
    "--kv-offloading-backend": "KV offloading to CPU memory is not supported; blocks stay on the device",
    "--kv-offloading-size": "KV offloading to CPU memory is not supported; blocks stay on the device",
    "--kv-sharing-fast-prefill": _KERNELS,
    "--language-model-only": _MULTIMODAL,
    "--limit-mm-per-prompt": _MULTIMODAL,
    "--linear-backend": _KERNELS,
    "--log-config-file": "kvserve configures Python logging itself",
    "--log-error-stack": _OBSERVE,
    "--long-prefill-token-threshold": _TUNING,
    "--lora-dtype": _LORA_OPT,
    "--lora-target-modules": _LORA_OPT,
    "--mamba-backend": "kvserve has no Mamba models",
    "--mamba-block-size": "kvserve has no Mamba models",
    "--mamba-cache-dtype": "kvserve has no Mamba models",
    "--mamba-cache-mode": "kvserve has no Mamba models",
    "--mamba-cache-philox-rounds": "kvserve has no Mamba models",
    "--mamba-config": "kvserve has no Mamba models",
    "--mamba-ssm-cache-dtype": "kvserve has no Mamba models",
    "--master-addr": _MULTINODE,
    "--master-port": _MULTINODE,
    "--max-cpu-loras": _LORA_OPT,
    "--max-cudagraph-capture-size": _KERNELS,
    "--max-log-len": _OBSERVE,
    "--max-long-partial-prefills": _TUNING,
    "--max-lora-rank": _LORA_OPT,
    "--max-loras": _LORA_OPT,
    "--max-num-partial-prefills": _TUNING,
    "--max-num-scheduled-tokens": _TUNING + " (--max-num-batched-tokens bounds a step)",
    "--max-parallel-loading-workers": _TUNING,
    "--media-io-kwargs": _MULTIMODAL,
    "--mm-encoder-attn-backend": _MULTIMODAL,
    "--mm-encoder-attn-dtype": _MULTIMODAL,
    "--mm-encoder-fp8-scale-path": _MULTIMODAL,
    "--mm-encoder-fp8-scale-save-margin": _MULTIMODAL,
    "--mm-encoder-fp8-scale-save-path": _MULTIMODAL,
    "--mm-encoder-tp-mode": _MULTIMODAL,
    "--mm-ipc-gpu-memory-gb": _MULTIMODAL,
    "--mm-processor-cache-gb": _MULTIMODAL,
    "--mm-processor-cache-type": _MULTIMODAL,
    "--mm-processor-kwargs": _MULTIMODAL,
    "--mm-shm-cache-max-object-size-mb": _MULTIMODAL,
    "--mm-tensor-ipc": _MULTIMODAL,
    "--model-loader-extra-config": _TUNING,
    "--moe-backend": _MOE,
    "--numa-bind": _TUNING,
    "--numa-bind-cpus": _TUNING,
    "--numa-bind-nodes": _TUNING,
    "--offload-backend": "weight offloading is not supported; weights stay on the device",
    "--offload-group-size": "weight offloading is not supported; weights stay on the device",
    "--offload-num-in-group": "weight offloading is not supported; weights stay on the device",
    "--offload-params": "weight offloading is not supported; weights stay on the device",
    "--offload-prefetch-step": "weight offloading is not supported; weights stay on the device",
    "--optimization-level": _KERNELS,
    "--otlp-traces-endpoint": _OBSERVE,
    "--performance-mode": _TUNING,
    "--prefill-schedule-interval": _TUNING,
    "--prefix-caching-hash-algo": "kvserve always hashes prefix-cache blocks with sha256",
    "--prefix-match-unit": _TUNING,
    "--profiler-config": _OBSERVE,
    "--pt-load-map-location": "kvserve loads safetensors and GGUF, never pickled .pt/.bin files",
    "--ray-workers-use-nsight": _OBSERVE,
    "--renderer-num-workers": _TUNING,
    "--root-path": _HTTP,
    "--safetensors-load-strategy": _TUNING,
    "--safetensors-prefetch-block-size": _TUNING,
    "--safetensors-prefetch-num-threads": _TUNING,
    "--scheduler-reserve-full-isl": _TUNING,
    "--show-hidden-metrics-for-version": _OBSERVE,
    "--skip-mm-profiling": _MULTIMODAL,
    "--specialize-active-lora": _LORA_OPT,
    "--stream-interval": "kvserve streams every token as it is sampled",
    "--ubatch-size": _KERNELS,
    "--use-fp64-gumbel": _KERNELS,
    "--use-tqdm-on-load": _OBSERVE,
    "--video-pruning-rate": _MULTIMODAL,
}

REFUSED: dict[str, str] = {
    "--chat-template-content-format": "kvserve renders message content in its one format (auto)",
    "--config": "YAML config files are not read: put the flags on the command line",
    "--convert": "pooling/embedding conversion is not supported: kvserve serves generative models",
    "--cpu-offload-gb": "weight offloading to CPU is not supported: use a smaller model or a larger GPU",
    "--data-parallel-rank": _DP,
    "--data-parallel-size": _DP,
    "--decode-context-parallel-size": _CP,
    "--default-chat-template-kwargs": "not supported yet: send chat_template_kwargs in each request",
    "--default-mm-loras": _MULTIMODAL,
    "--device-ids": "choose GPUs with CUDA_VISIBLE_DEVICES instead",
    "--diffusion-config": "diffusion models are not supported",
    "--ec-transfer-config": "disaggregated serving is not supported",
    "--enable-force-include-usage": "not supported: ask for stream_options.include_usage in the request",
    "--enable-lora": "LoRA adapters are not supported yet: merge the adapter into the weights first",
    "--enable-mm-embeds": _MULTIMODAL,
    "--enable-prompt-embeds": "prompt embeddings are not supported: send text or token ids",
    "--enable-sleep-mode": "sleep mode is not supported: stop and restart the server",
    "--enable-tokenizer-info-endpoint": "there is no /tokenizer_info endpoint; /tokenize and /detokenize exist",
    "--grpc": "only the HTTP (OpenAI-compatible) API is served",
    "--headless": _MULTINODE,
    "--hf-config-path": "put the config.json in the model folder (or use a model whose repo has one)",
    "--hf-overrides": "config overrides are not supported: edit a copy of the model's config.json",
    "--io-processor-plugin": _PLUGIN,
    "--kv-transfer-config": "disaggregated prefill / KV transfer is not supported",
    "--logits-processors": _PLUGIN,
    "--logprobs-mode": "kvserve returns raw logprobs (raw_logprobs), the only mode",
    "--lora-modules": "LoRA adapters are not supported yet: merge the adapter into the weights first",
    "--middleware": _PLUGIN,
    "--mm-encoder-only": _MULTIMODAL,
    "--model-class-overrides": _PLUGIN,
    "--model-impl": "kvserve runs only its own model code (auto)",
    "--model-weights": "give the weights' folder as the model",
    "--nnodes": _MULTINODE,
    "--node-rank": _MULTINODE,
    "--override-attention-dtype": "the attention dtype is the model's --dtype",
    "--pooler-config": "pooling models are not supported",
    "--prefill-context-parallel-size": _CP,
    "--quantization-config": "not supported: the checkpoint's own quantization config is read",
    "--reasoning-config": _REASONING,
    "--reasoning-parser-plugin": _REASONING,
    "--return-tokens-as-token-ids": "not supported: logprobs carry the token text",
    "--runner": "only the generate runner exists",
    "--scheduler-cls": _PLUGIN,
    "--scheduling-policy": "only fcfs scheduling is implemented",
    "--spec-method": _SPEC,
    "--spec-model": _SPEC,
    "--spec-tokens": _SPEC,
    "--ssl-ca-certs": _TLS,
    "--ssl-cert-reqs": _TLS,
    "--ssl-certfile": _TLS,
    "--ssl-ciphers": _TLS,
    "--ssl-keyfile": _TLS,
    "--tokenizer-mode": "kvserve loads Hugging Face tokenizers only (auto)",
    "--tokens-only": "not supported: the server always detokenizes (or use --skip-tokenizer-init)",
    "--tool-parser-plugin": _TOOLS,
    "--tool-server": _TOOLS,
    "--uds": "Unix domain sockets are not supported: use --host and --port",
    "--watermark": "watermarking is not supported",
    "--weight-transfer-config": "weight transfer is not supported",
    "--worker-cls": _PLUGIN,
    "--worker-extension-cls": _PLUGIN,
}

# Refused flags that are accepted silently when given the value that means "off" / "what kvserve does".
NEUTRAL: dict[str, tuple[str, ...]] = {
    "--data-parallel-size": ("1",), "--data-parallel-rank": ("0",), "--decode-context-parallel-size": ("1",),
    "--prefill-context-parallel-size": ("1",), "--nnodes": ("1",), "--node-rank": ("0",),
    "--cpu-offload-gb": ("0", "0.0"), "--model-impl": ("auto",), "--runner": ("auto", "generate"),
    "--scheduling-policy": ("fcfs",), "--tokenizer-mode": ("auto", "hf"), "--logprobs-mode": ("raw_logprobs",),
    "--convert": ("auto", "none"), "--chat-template-content-format": ("auto",),
}

def status_of(flag: str) -> str | None:
    """'ignored' or 'refused' for a vLLM flag our parser lacks; None if the table lacks it."""
    long = ALIASES.get(flag, flag)
    for name, table in (("refused", REFUSED), ("ignored", IGNORED)):
        if long in table:
            return name
    return None


class _IgnoredFlag(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        if option_string.startswith("--no-"):
            return  # turning off a feature kvserve does not have needs no warning
        logger.warning("%s has no effect in kvserve: %s.", option_string, self.help_text)


class _RefusedFlag(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        if option_string.startswith("--no-"):
            return  # off is what kvserve does
        given = values if isinstance(values, str) else None
        if given is not None and given.strip().lower() in self.neutral:
            return
        parser.error(f"{option_string} (a vLLM flag) is not supported by kvserve: {self.help_text}.")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Give `parser` every vLLM serve flag it does not define itself: an alias, a warning or a refusal."""
    defined = set(parser._option_string_actions)  # noqa: SLF001 - argparse offers no public lookup
    by_flag = {a: a_ for a_ in parser._actions for a in a_.option_strings}  # noqa: SLF001
    for alias, long in ALIASES.items():
        if alias not in defined and long in by_flag:
            target = by_flag[long]
            parser.add_argument(alias, dest=target.dest, type=target.type, choices=target.choices,
                                nargs=target.nargs, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            defined.add(alias)
    for table, action, name in ((REFUSED, _RefusedFlag, "refused"), (IGNORED, _IgnoredFlag, "ignored")):
        for long, reason in table.items():
            if long in defined:
                continue  # implemented: the real parser wins
            names = [long] + [a for a, target in ALIASES.items() if target == long and a not in defined]
            arity = ARITY.get(long, VALUE)
            if arity == BOOL and "--no-" + long[2:] not in defined:
                names.append("--no-" + long[2:])
            nargs = {BOOL: 0, FLAG: 0, MULTI: "+", VALUE: None}[arity]
            act = parser.add_argument(*names, action=action, nargs=nargs, default=argparse.SUPPRESS,
                                     dest=f"vllm_{name.replace(' ', '_')}_{long[2:].replace('-', '_')}",
                                     help=argparse.SUPPRESS)
            act.help_text = reason
            act.neutral = NEUTRAL.get(long, ())
            defined.update(names)
