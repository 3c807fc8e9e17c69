"""Weight quantization methods: which one a checkpoint needs, and the --quantization check.

Each method (one file each) is a QuantizationConfig that hands linear layers a LinearMethod: it creates
the layer's parameters (packed int4 + scales + zeros, fp8 + scales) and applies them.
"""

from __future__ import annotations

import logging

from kvserve.model.quantization.awq import AWQConfig
from kvserve.model.quantization.base import QuantizationConfig
from kvserve.model.quantization.compressed_tensors import CompressedTensorsConfig
from kvserve.model.quantization.fp8 import Fp8Config
from kvserve.model.quantization.gptq import GPTQConfig
from kvserve.model.quantization.mxfp4 import Mxfp4Config

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "awq": AWQConfig,
    "gptq": GPTQConfig,
    "fp8": Fp8Config,
    "compressed-tensors": CompressedTensorsConfig,
    "mxfp4": Mxfp4Config,  # gpt-oss's experts, dequantized at load
}
# vLLM names for the same formats served by other kernels: the format is what matters here.
_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors"}


def supported_methods() -> str:
    return ", ".join(QUANTIZATION_METHODS)


def normalize_method(name: str | None) -> str | None:
    if name in (None, "", "none"):
        return None
    name = name.lower()
    name = _ALIASES.get(name, name)
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization: {name!r} is not supported (supported: {supported_methods()}).")
    return name


def resolve_quant_config(requested: str | None, hf_config: dict, is_gguf: bool = False) -> QuantizationConfig | None:
    """The checkpoint's quantization (config.json quantization_config) checked against --quantization;
    or, for an unquantized checkpoint, --quantization fp8 quantizes at load."""
    requested = normalize_method(requested)
    ckpt = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if is_gguf and requested not in (None, "fp8"):
        raise ValueError(f"--quantization {requested}: GGUF checkpoints are dequantized at load; {requested} "
                         f"needs an HF safetensors checkpoint in that format (fp8 can quantize any checkpoint).")
    if ckpt:
        method = normalize_method_from_checkpoint(ckpt)
        if requested is not None and requested != method:
            raise ValueError(f"--quantization {requested}: the checkpoint is quantized with {method!r} "
                             f"(config.json quantization_config); pass --quantization {method} or leave it unset.")
        cfg = QUANTIZATION_METHODS[method].from_config(ckpt)
        logger.info("Quantization: %s checkpoint", method)
        return cfg
    if requested is None:
        return None
    if requested != "fp8":
        raise ValueError(f"--quantization {requested}: this checkpoint is not quantized (no quantization_config in "
                         f"config.json); {requested} needs a {requested}-quantized checkpoint. Only fp8 quantizes "
                         f"an unquantized checkpoint at load.")
    logger.info("Quantization: fp8 (weights quantized at load, per-channel scales; dynamic per-token activations)")
    return Fp8Config(checkpoint_is_fp8=False)


def normalize_method_from_checkpoint(ckpt: dict) -> str:
    method = str(ckpt.get("quant_method", "")).lower()
    method = _ALIASES.get(method, method)
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"The checkpoint's quantization_config has quant_method {method!r}, which is not "
                         f"supported (supported: {supported_methods()}).")
    return method


def estimate_weight_bytes(model_config, dtype_bytes: int, quant_config: QuantizationConfig | None) -> int:
    """Weight memory before loading: linear layers at the method's bits, the rest (embeddings, norms,
    lm_head, which stay unquantized) in the serving dtype."""
    total = model_config.num_params() * dtype_bytes
    if quant_config is None:
        return total
    c = model_config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    linear = c.num_hidden_layers * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    return int(total - linear * dtype_bytes + linear * quant_config.bits_per_weight / 8)
